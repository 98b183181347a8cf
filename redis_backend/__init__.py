"""How ctxgate reaches Redis: one node or a Redis Cluster (`target.py`), and which of
redis-py's errors mean "Redis is away for now" rather than a fault of ours."""
from .target import CLUSTER_SCHEMES, REDIS_SCHEMES, SHARDS, RedisTarget, RedisUrlError, UNAVAILABLE, is_redis_url

__all__ = ["CLUSTER_SCHEMES", "REDIS_SCHEMES", "SHARDS", "RedisTarget", "RedisUrlError", "UNAVAILABLE", "is_redis_url"]
