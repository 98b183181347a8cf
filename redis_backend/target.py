"""A Redis URL as ctxgate reads it: one node, or a Redis Cluster.

    redis://[user:password@]host:port[/db]      one node (`rediss://` with TLS, `unix://` a socket)
    redis+cluster://[user:password@]host:port[,host:port...]   a Redis Cluster, found from
                                                these seed nodes (`rediss+cluster://` with TLS)

On a cluster, a MULTI/EXEC or a Lua script may only touch keys of one hash slot. So every
key a store writes together carries one hash tag (`tag`): the keys of one session share
their session's tag, the keys of one tenant their tenant's. A tag is one of `SHARDS` shards
chosen by a hash of the names, not the names themselves: what spans sessions (the list of
WAL logs) is kept once per shard, beside the sessions of that shard, so it is written in the
same script as a session's keys and never becomes one hot key. On one node the tag is empty
and every key keeps the name it always had.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import xxhash
from redis.exceptions import (ClusterDownError, ConnectionError as RedisConnectionError, InvalidResponse,
                              ReadOnlyError, RedisClusterException, TimeoutError as RedisTimeoutError, TryAgainError)

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
SHARDS = 256
"""Hash tags on a cluster. Enough to spread over any cluster a gateway will meet (each master
holds many shards); few enough that a listing reads every shard's index in one pipeline."""

UNAVAILABLE: tuple[type[BaseException], ...] = (
    RedisConnectionError, RedisTimeoutError, InvalidResponse, ClusterDownError, TryAgainError, ReadOnlyError,
    RedisClusterException)
"""Redis away, partitioned, or a cluster between a master's failure and its replica's
promotion (CLUSTERDOWN, TRYAGAIN, a write to a demoted master, no node for a slot): the
request may be retried, so a 503, not an internal error. `RedisClusterException` also covers
a command spanning slots, which ctxgate's key names never make."""


class RedisUrlError(ValueError):
    """A Redis URL that cannot be used; the message names it with its password masked."""


def is_redis_url(url: str) -> bool:
    return url.startswith(REDIS_SCHEMES + CLUSTER_SCHEMES)


def masked(url: str) -> str:
    """`url` with any password replaced by `***` (what logs and errors print)."""
    return re.sub(r"(//[^:@/,]*:)[^@/]*@", r"\1***@", url)


@dataclass(frozen=True)
class RedisTarget:
    url: str
    cluster: bool
    nodes: tuple[tuple[str, int], ...] = ()
    """A cluster's seed nodes."""
    username: str | None = None
    password: str | None = None
    tls: bool = False

    @classmethod
    def parse(cls, url: str) -> "RedisTarget":
        if url.startswith(REDIS_SCHEMES):
            return cls(url, cluster=False)
        if not url.startswith(CLUSTER_SCHEMES):
            raise RedisUrlError(f"{masked(url)} is not a Redis URL (redis://, rediss://, unix://, redis+cluster://, "
                                "rediss+cluster://)")
        scheme, rest = url.split("://", 1)
        where, _, path = rest.partition("/")
        if path.strip("0"):
            raise RedisUrlError(f"{masked(url)}: a Redis Cluster has one database, 0")
        credentials, _, hosts = where.rpartition("@")
        username, _, password = credentials.partition(":") if ":" in credentials else ("", "", credentials)
        nodes = []
        for part in hosts.split(","):
            host, sep, port = part.strip().rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise RedisUrlError(f"{masked(url)}: each cluster node is host:port, not {part!r}")
            nodes.append((host.strip("[]"), int(port)))
        return cls(url, cluster=True, nodes=tuple(nodes), username=unquote(username) or None,
                   password=unquote(password) or None, tls=scheme == "rediss+cluster")

    @property
    def masked(self) -> str:
        return masked(self.url)

    def tag(self, *names: str) -> str:
        """The hash tag of the keys named by `names` (a tenant, or a tenant and a session):
        `{xx}` on a cluster, empty on one node."""
        if not self.cluster:
            return ""
        return self.shard_tag(xxhash.xxh3_64_intdigest("\0".join(names).encode()) % SHARDS)

    def shard_tags(self) -> list[str]:
        """Every tag `tag` can give: where a per-shard index lives."""
        return [self.shard_tag(shard) for shard in range(SHARDS)] if self.cluster else [""]

    @staticmethod
    def shard_tag(shard: int) -> str:
        return "{%02x}" % shard

    def _cluster_args(self) -> dict[str, Any]:
        return {"username": self.username, "password": self.password, "ssl": self.tls}

    def async_client(self, **options: Any) -> Any:
        """A redis.asyncio client: `Redis` for one node, `RedisCluster` for a cluster."""
        if not self.cluster:
            import redis.asyncio as redis

            return redis.from_url(self.url, **options)
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self.nodes], **self._cluster_args(), **options)

    def sync_client(self, **options: Any) -> Any:
        if not self.cluster:
            import redis

            return redis.Redis.from_url(self.url, **options)
        from redis.cluster import ClusterNode, RedisCluster

        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self.nodes], **self._cluster_args(), **options)

    def check(self, timeout_s: float = 5.0) -> None:
        """At start: a cluster URL must reach a node that is in cluster mode; a one-node URL that
        answers must not be a cluster node (its replies would be MOVED for most keys). A one-node
        URL that does not answer is let through: the gateway starts and reports it unready."""
        import redis
        from redis.exceptions import RedisError

        if not self.cluster:
            try:
                client = self.sync_client(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
                try:
                    enabled = client.info("cluster").get("cluster_enabled")
                finally:
                    client.close()
            except RedisError:
                return
            if enabled:
                scheme = "rediss+cluster" if self.url.startswith("rediss://") else "redis+cluster"
                raise RedisUrlError(f"{self.masked} is a node of a Redis Cluster: name the cluster as "
                                    f"{scheme}://host:port[,host:port...]")
            return
        errors = []
        for host, port in self.nodes:
            client = redis.Redis(host=host, port=port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                 **self._cluster_args())
            try:
                enabled = client.info("cluster").get("cluster_enabled")
            except RedisError as e:
                errors.append(f"{host}:{port}: {e}")
                continue
            finally:
                client.close()
            if not enabled:
                raise RedisUrlError(f"{self.masked}: {host}:{port} is not in cluster mode (cluster_enabled:0); "
                                    "for one Redis node use redis://host:port")
            return
        raise RedisUrlError(f"{self.masked}: no cluster node answered ({'; '.join(errors)})")
