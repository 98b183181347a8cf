"""The deploy files: every YAML parses, ctxgate's own configs load, Redis keeps an AOF on a
volume of its own, and ctxgate replicas share no writable volume (so nothing a replica
needs can hide on one replica's disk). Docker and Kubernetes do not run here: this checks
the files, not a running deployment."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from ctxgate.proxy.config import load_config
from ctxgate.redis_backend import RedisTarget

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
COMPOSE = DEPLOY / "docker-compose.yaml"
KUBERNETES = DEPLOY / "kubernetes"
CLUSTER = DEPLOY / "redis-cluster"


def _documents(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert all(isinstance(d, dict) for d in docs), path
    return docs


def _kube() -> list[dict[str, Any]]:
    return [d for path in sorted(KUBERNETES.glob("*.yaml")) for d in _documents(path)]


def _kind(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in _kube() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _walk(node: Any) -> Iterator[tuple[Any, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value
            yield from _walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item)


def _arguments(words: list[str]) -> dict[str, str]:
    """`--name value` pairs of a redis-server command line."""
    return {words[i][2:]: words[i + 1] for i in range(len(words) - 1) if words[i].startswith("--")}


def test_every_deploy_yaml_parses() -> None:
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert {f.name for f in files} >= {"docker-compose.yaml", "ctxgate.example.yaml", "ctxgate.yaml", "redis.yaml"}
    for path in files:
        assert _documents(path), path


def test_the_ctxgate_configs_load(tmp_path: Path) -> None:
    configmap = _kind("ConfigMap", "ctxgate-config")["data"]["ctxgate.yaml"]
    (tmp_path / "configmap.yaml").write_text(configmap)
    for path in (DEPLOY / "ctxgate.example.yaml", tmp_path / "configmap.yaml"):
        config = load_config(path)
        assert config.ctxgate.state.startswith("redis://"), path


# -- docker compose ----------------------------------------------------------------------------

def _compose_services() -> dict[str, dict[str, Any]]:
    services = _documents(COMPOSE)[0]["services"]
    assert isinstance(services, dict)
    return services


def _ctxgate_services() -> dict[str, dict[str, Any]]:
    found = {name: s for name, s in _compose_services().items() if "build" in s}
    assert len(found) >= 2, "compose runs at least two ctxgate replicas"
    return found


def _writable_mounts(service: dict[str, Any]) -> set[str]:
    """The source of every volume mounted read-write (named volume or host path)."""
    sources = set()
    for mount in service.get("volumes", []):
        if isinstance(mount, dict):
            if not mount.get("read_only"):
                sources.add(str(mount["source"]))
            continue
        source, _, rest = str(mount).partition(":")
        if "ro" not in rest.split(":")[1:]:
            sources.add(source)
    return sources


def test_compose_replicas_share_no_writable_volume() -> None:
    seen: dict[str, str] = {}
    for name, service in _ctxgate_services().items():
        for source in _writable_mounts(service):
            assert source not in seen, f"{name} and {seen[source]} both mount {source} writable"
            seen[source] = name
        env = service["environment"]
        assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
        assert env["CTXGATE_CONFIG"]


def test_compose_redis_keeps_an_aof_on_its_own_volume() -> None:
    redis = _compose_services()["redis"]
    args = _arguments(redis["command"])
    assert args["appendonly"] == "yes" and args["appendfsync"] == "everysec"
    own = _writable_mounts(redis)
    assert own and not own & set().union(*(_writable_mounts(s) for s in _ctxgate_services().values()))
    assert "redis-data" in _documents(COMPOSE)[0]["volumes"]


# -- kubernetes --------------------------------------------------------------------------------

def test_kubernetes_has_no_read_write_many() -> None:
    modes = [value for d in _kube() for key, value in _walk(d) if key == "accessModes"]
    assert modes, "redis has a volume claim"
    assert all("ReadWriteMany" not in m for m in modes), modes


def test_kubernetes_replicas_mount_nothing_shared() -> None:
    pod = _kind("Deployment", "ctxgate")["spec"]["template"]["spec"]
    for volume in pod["volumes"]:
        kinds = set(volume) - {"name"}
        assert kinds <= {"configMap", "secret", "emptyDir"}, volume  # per pod, or read-only
    assert not [d for d in _kube() if d["kind"] == "PersistentVolumeClaim"]


def test_kubernetes_probes_env_and_autoscaler() -> None:
    deployment = _kind("Deployment", "ctxgate")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    hpa = _kind("HorizontalPodAutoscaler", "ctxgate")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "ctxgate"}
    assert 1 < hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_kubernetes_redis_keeps_an_aof_on_a_volume_of_its_own() -> None:
    redis = _kind("StatefulSet", "ctxgate-redis")["spec"]
    container = redis["template"]["spec"]["containers"][0]
    args = _arguments(container["args"])
    assert args["appendonly"] == "yes" and args["appendfsync"] == "everysec"
    claims = redis["volumeClaimTemplates"]
    assert [c["spec"]["accessModes"] for c in claims] == [["ReadWriteOnce"]]
    assert {m["name"] for m in container["volumeMounts"]} == {c["metadata"]["name"] for c in claims}
    assert redis["replicas"] == 1


@pytest.mark.parametrize("path", [COMPOSE, KUBERNETES / "redis.yaml"])
def test_the_aof_fsync_choice_is_explained(path: Path) -> None:
    assert "appendfsync always" in path.read_text()


# -- a Redis Cluster -------------------------------------------------------------------------

def test_the_cluster_config_loads_and_names_a_cluster(tmp_path: Path) -> None:
    config = load_config(str(CLUSTER / "ctxgate.yaml")).ctxgate
    target = RedisTarget.parse(config.state)
    assert target.cluster and len(target.nodes) >= 2  # a start does not depend on one node
    assert config.wal.redis_wait_replicas == 1


def test_compose_cluster_nodes_keep_an_aof_each_on_a_volume_of_their_own() -> None:
    services = _documents(CLUSTER / "docker-compose.yaml")[0]["services"]
    nodes = {name: s for name, s in services.items() if name.startswith("redis-") and name != "redis-cluster-init"}
    assert len(nodes) == 6
    volumes = [next(iter(_writable_mounts(s))) for s in nodes.values()]
    assert len(set(volumes)) == 6
    for node in nodes.values():
        args = _arguments(node["command"])
        assert args["cluster-enabled"] == "yes" and args["appendonly"] == "yes" and args["appendfsync"] == "always"
    assert "--cluster-replicas 1" in " ".join(services["redis-cluster-init"]["command"])
    ctxgate = {name: s for name, s in services.items() if name.startswith("ctxgate-")}
    assert len(ctxgate) == 2 and not set(volumes) & set().union(*(_writable_mounts(s) for s in ctxgate.values()))


def test_kubernetes_cluster_nodes_keep_an_aof_each_on_a_claim_of_their_own() -> None:
    docs = _documents(CLUSTER / "kubernetes.yaml")
    nodes = next(d for d in docs if d["kind"] == "StatefulSet")["spec"]
    assert nodes["replicas"] == 6
    script = " ".join(nodes["template"]["spec"]["containers"][0]["args"])
    assert "--cluster-enabled yes" in script and "--appendonly yes" in script and "--appendfsync always" in script
    assert [c["spec"]["accessModes"] for c in nodes["volumeClaimTemplates"]] == [["ReadWriteOnce"]]
    job = next(d for d in docs if d["kind"] == "Job")
    assert "--cluster-replicas 1" in " ".join(job["spec"]["template"]["spec"]["containers"][0]["args"])
