"""The log in Redis (docs/wal.md, The log on Redis): one stream per session.

Keys of a session, `<base>` = `ctxgate:wal:<tag><tenant>:<session>` (`<tag>`: the session's
hash tag on a Redis Cluster, `redis_backend.RedisTarget.tag`; empty on one node):

    <base>               stream; entry id `<seq>-0`, fields `seq` and `line` (the file's line, CRC included)
    <base>:checkpoints   sorted set of the checkpoints' seqs: when to archive and where to cut,
                         without reading the stream
    <base>:records       hash, record key -> the compaction record's JSON: each record stored once;
                         every checkpoint in the stream names its records
    <base>:archives      sorted set of archive keys by first seq
    <base>:archive:<first>-<last>   hash {lines, records}, zlib; expires after the retention
    ctxgate:wal:logs[:<tag>]   hash, JSON [tenant, session] -> last append (ms): the list of
                         logs; on a cluster one per shard, beside the sessions of that shard

One Lua script appends: it checks the stream's last seq, stores the new records, then the
entries, so a reader never sees a checkpoint naming a record that is not there, and a seq is
never written twice (an entry id must grow). Every key the script touches carries the
session's tag, the list of logs included, so on a cluster it runs on one slot.
"""
from __future__ import annotations

import logging
import time
import zlib
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import orjson
from redis.exceptions import RedisError, WatchError

from ctxgate.redis_backend import UNAVAILABLE, RedisTarget
from .backend import Appended, Erased, Fence, LogInfo, LogRead, WalFenced, WalUnavailable
from .events import EventType, decode_line, encode_line, timestamp
from .paths import safe_name
from .reader import Damage, WalScan, scan_bytes, scan_entries
from .records import REF, is_ref, record_key

log = logging.getLogger("ctxgate.wal")
_FAILURES: tuple[type[BaseException], ...] = (RedisError, *UNAVAILABLE)
"""What says Redis did not take a call: the log refuses the append, never a 500."""
LOGS = "ctxgate:wal:logs"
_RETRIES = 5
_APPEND = """
local args = #ARGV
if #KEYS == 5 then
  if redis.call('GET', KEYS[5]) ~= ARGV[args] then return {-1, 0, 0} end
  args = args - 1
end
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local last = 0
if #top > 0 then last = tonumber(string.match(top[1][1], '^(%d+)')) end
local n = tonumber(ARGV[3])
if tonumber(ARGV[5]) <= last then
  for i = 0, n - 1 do
    local id = ARGV[5 + 3 * i] .. '-0'
    local got = redis.call('XRANGE', KEYS[1], id, id)
    if #got == 0 or got[1][2][4] ~= ARGV[6 + 3 * i] then return {0, last, 0} end
  end
  return {1, last, redis.call('ZCARD', KEYS[2])}
end
for i = 5 + 3 * n, args, 2 do redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1]) end
for i = 0, n - 1 do
  local seq = ARGV[5 + 3 * i]
  redis.call('XADD', KEYS[1], seq .. '-0', 'seq', seq, 'line', ARGV[6 + 3 * i])
  if ARGV[7 + 3 * i] == '1' then redis.call('ZADD', KEYS[2], seq, seq) end
end
if tonumber(ARGV[4]) > 0 then
  for k = 1, 3 do redis.call('PEXPIRE', KEYS[k], ARGV[4]) end
end
redis.call('HSET', KEYS[4], ARGV[2], ARGV[1])
return {2, tonumber(ARGV[5 + 3 * (n - 1)]), redis.call('ZCARD', KEYS[2])}
"""
"""KEYS: stream, checkpoints, records, LOGS, and a fence's key when there is one. ARGV: now
(ms), the log's LOGS field, n, the idle TTL (ms, 0: none), then n times (seq, line, is
checkpoint), then (record key, record JSON) pairs, then the fence's token. Returns (-1, ...)
writing nothing when the fence's key does not hold its token, (0, last seq) when the first
seq is not past the stream's last and the entries are not those already there (the caller
numbers them again), (1, ...) when they are all there already, (2, last seq, checkpoints)
when appended."""
_UNAPPEND = """
for i = 1, #ARGV do
  redis.call('XDEL', KEYS[1], ARGV[i] .. '-0')
  redis.call('ZREM', KEYS[2], ARGV[i])
end
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local id = '0-0'
if #top > 0 then id = top[1][1] end
local seq = string.match(id, '^(%d+)')
if not redis.pcall('XSETID', KEYS[1], id, 'ENTRIESADDED', seq, 'MAXDELETEDID', id)['ok'] then
  redis.call('XSETID', KEYS[1], id)
end
return 1
"""
"""KEYS: stream, checkpoints. ARGV: the seqs of an append no replica acknowledged. Removes
them and sets the stream's last id back to what is left, so the turn, refused, leaves nothing
behind and its retry takes the same seqs. (XSETID's Redis 7 form first, then Redis 6's.)"""


def key_part(value: str) -> str:
    """A tenant or session id as a key part: `safe_name` (the file backend's), and hashed when
    it holds the key separator, so two (tenant, session) pairs never share a key."""
    name = safe_name(value)
    return name if ":" not in name else safe_name(value + "\0")


class _Keys:
    def __init__(self, tenant: str, session: str, target: RedisTarget) -> None:
        tag = target.tag(tenant, session)
        self.base = f"ctxgate:wal:{tag}{key_part(tenant)}:{key_part(session)}"
        self.logs = _logs_key(tag)
        self.checkpoints = self.base + ":checkpoints"
        self.records = self.base + ":records"
        self.archives = self.base + ":archives"
        self.field = orjson.dumps([tenant, session])


def _logs_key(tag: str) -> str:
    return f"{LOGS}:{tag}" if tag else LOGS


@contextmanager
def reachable() -> Iterator[None]:
    try:
        yield
    except _FAILURES as e:
        raise WalUnavailable(f"Redis: {e}") from None


class RedisLog:
    def __init__(self, url: str, archive_every: int = 10, retention_s: float = 7 * 86400.0,
                 clock: Callable[[], float] = time.time, wait_replicas: int = 0, wait_timeout_ms: int = 1000,
                 idle_ttl_s: float | None = None) -> None:
        self._target = RedisTarget.parse(url)
        self._url = url
        self.where = self._target.masked  # no password in what the CLI prints
        self._redis: Any = self._target.sync_client(socket_timeout=10, socket_connect_timeout=5)
        """Typed loosely: redis-py's sync replies are unions of bytes and str this module never sees."""
        self._append_script = self._redis.register_script(_APPEND)
        self._unappend_script = self._redis.register_script(_UNAPPEND)
        self._archive_every = archive_every
        self._retention_ms = max(1, int(retention_s * 1000))
        self._clock = clock
        self._wait_replicas = wait_replicas
        self._wait_timeout_ms = wait_timeout_ms
        self._idle_ttl_ms = max(1, int(idle_ttl_s * 1000)) if idle_ttl_s else 0
        self._last: dict[str, int] = {}
        """The last seq this process wrote or read per stream: the next append's first guess."""

    # -- writing ---------------------------------------------------------------------------

    def checks(self, fence: Fence) -> bool:
        """A fence on this Redis: its key shares the session's hash tag, so the append script
        reads it in the same slot."""
        return fence.where == self._url

    def append(self, tenant: str, session: str, events: list[dict[str, Any]], after_seq: int = 0,
               sync: bool = False, fence: Fence | None = None) -> Appended:
        """`sync` is Redis's persistence and `wait_replicas` (docs/wal.md): every append is
        acknowledged the same way. A `fence` on this Redis is checked in the append's script (its
        key shares the session's hash tag); one on another Redis cannot be, and is ignored."""
        if not events:
            return Appended([])
        keys = _Keys(tenant, session, self._target)
        now = timestamp(self._clock())
        last = self._last.get(keys.base, 0)
        for _ in range(_RETRIES):
            seq = max(after_seq, last)
            written = [{"seq": seq + i, "type": e["type"], "timestamp": now, **{k: v for k, v in e.items()
                                                                                 if k != "type"}}
                       for i, e in enumerate(events, start=1)]
            done, last, checkpoints = self._put(keys, written, fence if fence and self.checks(fence) else None)
            if done < 0:
                raise WalFenced(f"the lease on {tenant}/{session} lapsed: the log took nothing")
            if done:
                break
        else:
            raise WalUnavailable(f"the log of {tenant}/{session} kept growing under {_RETRIES} appends")
        self._last[keys.base] = last
        cut = max((e["seq"] for e in written if e["type"] == EventType.CHECKPOINT.value), default=0)
        archived = None
        if cut and checkpoints > self._archive_every:
            try:
                archived = self._archive_before(keys, cut)
            except WalUnavailable as e:  # the events are in: the next checkpoint archives instead
                log.warning("WAL %s: archive pass not done: %s", keys.base, e)
        return Appended(written, archived)

    def put_events(self, tenant: str, session: str, events: list[dict[str, Any]]) -> bool:
        """Append events that carry their seqs already (an import, a retried append): False when
        they are all there already; WalUnavailable when other events hold those seqs."""
        keys = _Keys(tenant, session, self._target)
        done, last, _ = self._put(keys, events)
        if not done:
            raise WalUnavailable(f"seq {events[0]['seq']} is not past {last}, the last of {keys.base}")
        self._last[keys.base] = max(self._last.get(keys.base, 0), last)
        return done == 2

    def _put(self, keys: _Keys, events: list[dict[str, Any]], fence: Fence | None = None) -> tuple[int, int, int]:
        args: list[Any] = [int(self._clock() * 1000), keys.field, len(events), self._idle_ttl_ms]
        records: list[Any] = []
        for event in events:
            event, held = _records_named(event)
            records += [x for key, record in held.items() for x in (key, record)]
            args += [event["seq"], encode_line(event), int(event["type"] == EventType.CHECKPOINT.value)]
        with reachable():
            names = [keys.base, keys.checkpoints, keys.records, keys.logs]
            if fence is not None:
                names, records = names + [fence.key], records + [fence.token]
            done, last, checkpoints = self._append_script(keys=names, args=args + records)
            if done > 0 and self._wait_replicas:
                # On a cluster WAIT goes to the master of the session's slot, the one that took it.
                where = {"target_nodes": self._redis.get_node_from_key(keys.base)} if self._target.cluster else {}
                acked = self._redis.wait(self._wait_replicas, self._wait_timeout_ms, **where)
                if acked < self._wait_replicas:
                    if done == 2:
                        self._unappend_script(keys=[keys.base, keys.checkpoints], args=[e["seq"] for e in events])
                    raise WalUnavailable(f"{acked} of {self._wait_replicas} Redis replicas acknowledged the append "
                                         f"in {self._wait_timeout_ms} ms (wal.redis_wait_replicas)")
        return int(done), int(last), int(checkpoints)

    def _archive_before(self, keys: _Keys, cut: int) -> str | None:
        """Move the entries before seq `cut` (a checkpoint) to a compressed archive key with the
        records their checkpoints name, so it reads back alone; keep in the records hash only
        what the checkpoints left in the stream name. WATCHed: an append meanwhile retries it."""
        with reachable(), self._redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(keys.base, keys.records)
                    head = pipe.xrange(keys.base, "-", f"({cut}-0")
                    if not head:
                        return None
                    named = _names([f[b"line"] for _, f in head])
                    kept = _names([f[b"line"] for _, f in pipe.xrange(keys.base, f"{cut}-0", "+")])
                    stored = dict(zip(named, pipe.hmget(keys.records, named))) if named else {}
                    dropped = [k for k in pipe.hkeys(keys.records) if k.decode() not in kept]
                    first, last = _seq_of(head[0][0]), _seq_of(head[-1][0])
                    name = f"{keys.base}:archive:{first}-{last}"
                    lines = b"".join(f[b"line"] for _, f in head)
                    held = b"{" + b",".join(orjson.dumps(k) + b":" + v for k, v in stored.items() if v) + b"}"
                    pipe.multi()
                    pipe.hset(name, mapping={"lines": zlib.compress(lines), "records": zlib.compress(held)})
                    pipe.pexpire(name, self._retention_ms)
                    pipe.zadd(keys.archives, {name: first})
                    pipe.pexpire(keys.archives, self._retention_ms)  # goes with the newest archive it lists
                    pipe.xtrim(keys.base, minid=f"{cut}-0", approximate=False)
                    pipe.zremrangebyscore(keys.checkpoints, "-inf", f"({cut}")
                    if dropped:
                        pipe.hdel(keys.records, *dropped)
                    pipe.execute()
                    return name
                except WatchError:
                    continue

    def archive(self, tenant: str, session: str) -> str | None:
        keys = _Keys(tenant, session, self._target)
        with reachable():
            latest = self._redis.zrevrange(keys.checkpoints, 0, 0)
        return self._archive_before(keys, int(latest[0])) if latest else None

    def prune(self, retention_s: float, now: float) -> list[str]:
        """Redis expires archives itself (their TTL is the retention); an index entry that
        outlived its key is dropped when the history is next read."""
        return []

    def erase(self, tenant: str, session: str) -> Erased:
        """The stream, its indexes and records, every archive key, and its place in the list of logs."""
        keys = _Keys(tenant, session, self._target)
        with reachable():
            archives = self._redis.zrange(keys.archives, 0, -1)
            live = self._redis.exists(keys.base)
            gone = self._redis.delete(*archives) if archives else 0
            self._redis.delete(keys.base, keys.checkpoints, keys.records, keys.archives)
            self._redis.hdel(keys.logs, keys.field)
        self._last.pop(keys.base, None)
        return Erased(live=int(live), archives=int(gone))

    # -- reading ---------------------------------------------------------------------------

    def exists(self, tenant: str, session: str) -> bool:
        with reachable():
            return bool(self._redis.exists(_Keys(tenant, session, self._target).base))

    def open(self, tenant: str, session: str) -> LogRead:
        read = self._read(_Keys(tenant, session, self._target), history=False)
        self._last[_Keys(tenant, session, self._target).base] = max((s.last_seq for s in read.scans), default=0)
        return read

    def live(self, tenant: str, session: str) -> WalScan:
        keys = _Keys(tenant, session, self._target)
        with reachable():
            return scan_entries(keys.base, [f[b"line"] for _, f in self._redis.xrange(keys.base)])

    def history(self, tenant: str, session: str) -> LogRead:
        return self._read(_Keys(tenant, session, self._target), history=True)

    def _read(self, keys: _Keys, history: bool) -> LogRead:
        with reachable():
            with self._redis.pipeline(transaction=True) as pipe:
                pipe.xrange(keys.base)
                pipe.hgetall(keys.records)
                pipe.zrange(keys.archives, 0, -1)
                entries, stored, archive_names = pipe.execute()
            live = scan_entries(keys.base, [_fields(f).get(b"line", b"") for _, f in entries])
            records = _loaded(stored)
            held = set(records)
            scans = [live]
            if history or not any(isinstance(c.get("state"), dict) for c in live.checkpoints):
                scans = self._archives(keys, archive_names, records) + [live]
        return LogRead(scans, records, held)

    def _archives(self, keys: _Keys, names: list[bytes], records: dict[str, dict[str, Any]]) -> list[WalScan]:
        """The archives oldest first; their records added to `records`. One expired is dropped
        from the index."""
        with self._redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hgetall(name)
            found = pipe.execute()
        scans, gone = [], []
        for name, archive in zip(names, found):
            if not archive:
                gone.append(name)
                continue
            try:
                lines, held = zlib.decompress(archive[b"lines"]), orjson.loads(zlib.decompress(archive[b"records"]))
            except (KeyError, zlib.error, orjson.JSONDecodeError):
                scans.append(WalScan(name.decode(), damaged=[Damage(0, "archive not readable", name.decode())]))
                continue
            scans.append(scan_bytes(name.decode(), lines))
            for key, record in held.items():
                records.setdefault(key, record)
        if gone:
            self._redis.zrem(keys.archives, *gone)
        return scans

    def version(self, tenant: str, session: str) -> tuple[Any, ...]:
        keys = _Keys(tenant, session, self._target)
        with reachable():
            with self._redis.pipeline(transaction=True) as pipe:
                pipe.xrevrange(keys.base, count=1)
                pipe.zcard(keys.archives)
                top, archives = pipe.execute()
        return (top[0][0] if top else b"", archives)

    def sessions(self, tenant: str | None = None) -> list[LogInfo]:
        """Every log listed; one whose stream expired (`wal.redis_idle_ttl_days`) leaves the list."""
        with reachable():
            with self._redis.pipeline(transaction=False) as pipe:  # every shard's list (one on one node)
                for tag in self._target.shard_tags():
                    pipe.hgetall(_logs_key(tag))
                shards = pipe.execute()
            found = []
            for logs in shards:
                for field, written_ms in logs.items():
                    t, s = orjson.loads(field)
                    if tenant is None or t == tenant:
                        found.append(LogInfo(t, s, _Keys(t, s, self._target).base, int(written_ms) / 1000))
            with self._redis.pipeline(transaction=False) as pipe:
                for info in found:
                    pipe.exists(info.where)
                there = pipe.execute()
            for info, exists in zip(found, there):
                if not exists:
                    keys = _Keys(info.tenant, info.session, self._target)
                    self._redis.hdel(keys.logs, keys.field)
        return sorted((i for i, exists in zip(found, there) if exists), key=lambda i: (i.tenant, i.session))

    def changed_externally(self, tenant: str, session: str) -> bool:
        keys = _Keys(tenant, session, self._target)
        if keys.base not in self._last:
            return False
        try:
            top = self._redis.xrevrange(keys.base, count=1)
        except _FAILURES:  # noticed on a later turn; this one's append refuses it meanwhile
            return False
        return (_seq_of(top[0][0]) if top else 0) != self._last[keys.base]

    def ping(self) -> bool:
        try:
            return bool(self._redis.ping())
        except _FAILURES:
            return False

    def close(self) -> None:
        self._redis.close()


def _records_named(event: dict[str, Any]) -> tuple[dict[str, Any], dict[str, bytes]]:
    """A checkpoint with every record named, and the records it held in full (to store once)."""
    state = event.get("state")
    if event["type"] != EventType.CHECKPOINT.value or not isinstance(state, dict):
        return event, {}
    held: dict[str, bytes] = {}
    names = []
    for record in state.get("records") or []:
        if is_ref(record):
            names.append(record)
        else:
            key = record_key(record)
            held[key] = orjson.dumps(record)
            names.append({REF: key})
    return {**event, "state": {**state, "records": names}}, held


def _names(lines: list[bytes]) -> list[str]:
    """The record keys the checkpoints among `lines` name (a damaged line names none)."""
    found: dict[str, None] = {}
    for line in lines:
        if b'"type":"CHECKPOINT"' not in line:
            continue
        try:
            state = decode_line(line).get("state")
        except ValueError:
            continue
        for record in state.get("records") or [] if isinstance(state, dict) else []:
            if is_ref(record):
                found[record[REF]] = None
    return list(found)


def _loaded(stored: dict[bytes, bytes]) -> dict[str, dict[str, Any]]:
    records = {}
    for key, raw in stored.items():
        try:
            records[key.decode()] = orjson.loads(raw)
        except orjson.JSONDecodeError:  # left out: recovery warns of a record no checkpoint holds
            continue
    return records


def _fields(fields: dict[bytes, bytes] | list[bytes]) -> dict[bytes, bytes]:
    """A stream entry's fields: redis-py's cluster client leaves them a flat list inside MULTI."""
    return fields if isinstance(fields, dict) else dict(zip(fields[::2], fields[1::2]))


def _seq_of(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[0])
