"""Prefix-cache directory in a Redis server (redis-py asyncio, hiredis parser when installed).

Keys (all under `key_prefix`, default "tandem:"):

    {prefix}workers        SET of worker ids that may hold blocks
    {prefix}w:{worker_id}  SET of the block hashes that worker holds; PEXPIRE = its deadline

Invariant: `{prefix}w:{id}` exists => `id` is in `{prefix}workers`. Every write that creates
a worker's set adds the id to the registry in the same script. The lookup script drops
registry ids whose set has gone (expired, removed, emptied), so expiry needs no sweeper:
when a worker stops reporting, Redis deletes its set at the deadline and the next lookup
forgets the id.

One round trip per call. `publish`, `replace_worker` and `longest_prefix` are Lua scripts
(EVALSHA, falling back to EVAL once when the server has not cached the script, e.g. after
a restart); a script runs atomically. Hashes travel packed into one argument (see
`pack_hashes`): building a command of a thousand separate arguments costs the client
more than the server's whole lookup. The lookup walks the chain per worker with SMISMEMBER
in growing chunks (16, 64, 256, 1024 hashes) and stops at the first miss, unpacking only
the hashes it reaches.

Needs Redis >= 6.2 (SMISMEMBER) on a single server or primary; the scripts touch keys they
do not declare, so Redis Cluster is not supported.

Every failure to talk to the server becomes `DirectoryUnavailable`, fast: short socket and
connect timeouts and at most `retries` immediate retries (one retry lets a pooled
connection that died with a server restart reconnect without surfacing an error).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from tandem_services.directory.base import (
    DEFAULT_WORKER_TTL_S,
    DirectoryUnavailable,
    PrefixDirectory,
    check_block_hashes,
    check_worker_id,
)

# Shared by the scripts. A packed list is (width, blob): width > 0 means fixed-width
# hashes back to back; width 0 means each hash is preceded by one length byte.
_LUA_COMMON = """
local function unpacker(width, blob)
  local parsed, n, pos, size = {}, 0, 1, #blob
  -- Parse up to `want` hashes (cumulative); returns the table and how many it holds.
  return function(want)
    while n < want and pos <= size do
      local len = width
      if width == 0 then
        len = string.byte(blob, pos)
        pos = pos + 1
      end
      n = n + 1
      parsed[n] = string.sub(blob, pos, pos + len - 1)
      pos = pos + len
    end
    return parsed, n
  end
end

local function apply(cmd, key, width, blob)
  local parsed, n = unpacker(width, blob)(math.huge)
  for first = 1, n, 1024 do
    redis.call(cmd, key, unpack(parsed, first, math.min(first + 1023, n)))
  end
  return n
end

local function set_expiry(key, ttl_ms)
  if ttl_ms > 0 then
    redis.call('PEXPIRE', key, ttl_ms)
  else
    redis.call('PERSIST', key)
  end
end
"""

# ARGV: prefix, worker id, ttl ms (0: none), evicted width, evicted blob, added width, added
# blob. Returns 1 when the worker's set existed before the call, else 0.
PUBLISH_LUA = (
    _LUA_COMMON
    + """
local key = ARGV[1] .. 'w:' .. ARGV[2]
local existed = redis.call('EXISTS', key)
apply('SREM', key, tonumber(ARGV[4]), ARGV[5])
if apply('SADD', key, tonumber(ARGV[6]), ARGV[7]) > 0 then
  redis.call('SADD', ARGV[1] .. 'workers', ARGV[2])
end
set_expiry(key, tonumber(ARGV[3]))
return existed
"""
)

# ARGV: prefix, worker id, ttl ms (0: none), width, blob. The worker's set becomes exactly
# the given hashes.
REPLACE_LUA = (
    _LUA_COMMON
    + """
local key = ARGV[1] .. 'w:' .. ARGV[2]
redis.call('DEL', key)
if apply('SADD', key, tonumber(ARGV[4]), ARGV[5]) > 0 then
  redis.call('SADD', ARGV[1] .. 'workers', ARGV[2])
  set_expiry(key, tonumber(ARGV[3]))
else
  redis.call('SREM', ARGV[1] .. 'workers', ARGV[2])
end
return 1
"""
)

# ARGV: prefix, width, blob of the chain's hashes in order.
# Returns a flat array {worker id, leading block count, ...} of workers with a count > 0.
LONGEST_PREFIX_LUA = (
    _LUA_COMMON
    + """
local prefix = ARGV[1]
local registry = prefix .. 'workers'
local hashes = unpacker(tonumber(ARGV[2]), ARGV[3])
local out = {}
for _, w in ipairs(redis.call('SMEMBERS', registry)) do
  local key = prefix .. 'w:' .. w
  if redis.call('EXISTS', key) == 0 then
    redis.call('SREM', registry, w)
  else
    local count, chunk, missed = 0, 16, false
    while not missed do
      local parsed, n = hashes(count + chunk)
      if n <= count then
        break
      end
      local held = redis.call('SMISMEMBER', key, unpack(parsed, count + 1, n))
      for j = 1, #held do
        if held[j] == 1 then
          count = count + 1
        else
          missed = true
          break
        end
      end
      chunk = math.min(chunk * 4, 1024)
    end
    if count > 0 then
      out[#out + 1] = w
      out[#out + 1] = count
    end
  end
end
return out
"""
)


@dataclass(frozen=True)
class _Script:
    source: str
    sha: str

    @classmethod
    def of(cls, source: str) -> _Script:
        return cls(source, hashlib.sha1(source.encode()).hexdigest())


_PUBLISH = _Script.of(PUBLISH_LUA)
_REPLACE = _Script.of(REPLACE_LUA)
_LONGEST_PREFIX = _Script.of(LONGEST_PREFIX_LUA)


def pack_hashes(hashes: Sequence[bytes]) -> tuple[int, bytes]:
    """`(width, blob)` for the scripts: fixed width when all hashes share a length (the
    usual case), else width 0 and a length byte before each hash."""
    if not hashes:
        return 0, b""
    width = len(hashes[0])
    if all(len(h) == width for h in hashes):
        return width, b"".join(hashes)
    return 0, b"".join(bytes((len(h),)) + h for h in hashes)


def redact_url(url: str) -> str:
    """`url` without its password, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.hostname or ""
    if parts.port is not None:
        netloc = f"{netloc}:{parts.port}"
    netloc = f"{parts.username or ''}:***@{netloc}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class RedisDirectory(PrefixDirectory):
    """A `PrefixDirectory` in Redis, shared by every scheduler and worker process.

    `url` is `redis://host:port/db` or `rediss://...` (TLS); `tls=True` turns a `redis://`
    URL into TLS too. `password` / `username` override the URL's credentials.
    """

    def __init__(
        self,
        url: str,
        *,
        password: str | None = None,
        username: str | None = None,
        tls: bool = False,
        tls_ca_certs: str | None = None,
        tls_certfile: str | None = None,
        tls_keyfile: str | None = None,
        tls_check_hostname: bool = True,
        key_prefix: str = "tandem:",
        worker_ttl_s: float | None = DEFAULT_WORKER_TTL_S,
        socket_timeout_s: float = 0.5,
        connect_timeout_s: float = 0.5,
        retries: int = 1,
        max_connections: int | None = None,
    ) -> None:
        super().__init__(worker_ttl_s)
        if not url:
            raise ValueError("RedisDirectory needs a redis:// or rediss:// url")
        scheme = urlsplit(url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"redis url must start with redis://, rediss:// or unix://: {url}")
        if socket_timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("socket_timeout_s and connect_timeout_s must be > 0")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if tls and scheme == "redis":
            url = "rediss" + url[len("redis") :]
            scheme = "rediss"
        kwargs: dict[str, object] = {
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": connect_timeout_s,
            "retry": Retry(NoBackoff(), retries),
            "decode_responses": False,
        }
        if password is not None:
            kwargs["password"] = password
        if username is not None:
            kwargs["username"] = username
        if max_connections is not None:
            kwargs["max_connections"] = max_connections
        if scheme == "rediss":
            kwargs["ssl_check_hostname"] = tls_check_hostname
            if tls_ca_certs:
                kwargs["ssl_ca_certs"] = tls_ca_certs
            if tls_certfile:
                kwargs["ssl_certfile"] = tls_certfile
            if tls_keyfile:
                kwargs["ssl_keyfile"] = tls_keyfile
        elif tls_ca_certs or tls_certfile or tls_keyfile:
            raise ValueError("TLS files given for a plain redis:// url; pass tls=True")
        self.url = redact_url(url)
        self.key_prefix = key_prefix
        self._registry_key = f"{key_prefix}workers"
        self._client = aioredis.Redis.from_url(url, **kwargs)

    def worker_key(self, worker_id: str) -> str:
        """The Redis key of the set of hashes `worker_id` holds."""
        return f"{self.key_prefix}w:{worker_id}"

    async def publish(
        self, worker_id: str, added: Sequence[bytes], evicted: Sequence[bytes] = ()
    ) -> bool:
        check_worker_id(worker_id)
        check_block_hashes(added)
        check_block_hashes(evicted)
        ev_width, ev_blob = pack_hashes(evicted)
        add_width, add_blob = pack_hashes(added)
        ttl = _ttl_ms(self.ttl_for(worker_id))
        args = (self.key_prefix, worker_id, ttl, ev_width, ev_blob, add_width, add_blob)
        return bool(await self._run_script(_PUBLISH, args))

    async def replace_worker(self, worker_id: str, block_hashes: Iterable[bytes]) -> None:
        check_worker_id(worker_id)
        hashes = list(block_hashes)
        check_block_hashes(hashes)
        width, blob = pack_hashes(hashes)
        ttl = _ttl_ms(self.ttl_for(worker_id))
        await self._run_script(_REPLACE, (self.key_prefix, worker_id, ttl, width, blob))

    async def longest_prefix(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        if not block_hashes:
            return {}
        width, blob = pack_hashes(block_hashes)
        flat = await self._run_script(_LONGEST_PREFIX, (self.key_prefix, width, blob))
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def heartbeat(self, worker_id: str, ttl_s: float | None = None) -> bool:
        check_worker_id(worker_id)
        ttl = self.set_worker_ttl(worker_id, ttl_s)
        key = self.worker_key(worker_id)
        with self._unavailable_on_error():
            if ttl is None:
                return bool(await self._client.exists(key))
            return bool(await self._client.pexpire(key, _ttl_ms(ttl)))

    async def remove_worker(self, worker_id: str) -> None:
        check_worker_id(worker_id)
        self._ttl_s.pop(worker_id, None)
        with self._unavailable_on_error():
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(self.worker_key(worker_id))
                pipe.srem(self._registry_key, worker_id)
                await pipe.execute()

    async def num_blocks(self, worker_id: str) -> int:
        with self._unavailable_on_error():
            return int(await self._client.scard(self.worker_key(worker_id)))

    async def workers(self) -> set[str]:
        with self._unavailable_on_error():
            ids = [w.decode() for w in await self._client.smembers(self._registry_key)]
            if not ids:
                return set()
            async with self._client.pipeline(transaction=False) as pipe:
                for w in ids:
                    pipe.exists(self.worker_key(w))
                present = await pipe.execute()
        return {w for w, p in zip(ids, present, strict=True) if p}

    async def ping(self) -> bool:
        """Whether the server answers now (never raises)."""
        try:
            with self._unavailable_on_error(count=False):
                return bool(await self._client.ping())
        except DirectoryUnavailable:
            return False

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._client.aclose()

    async def _run_script(self, script: _Script, args: tuple[object, ...]) -> object:
        with self._unavailable_on_error():
            try:
                return await self._client.evalsha(script.sha, 0, *args)
            except NoScriptError:
                return await self._client.eval(script.source, 0, *args)

    @contextlib.contextmanager
    def _unavailable_on_error(self, count: bool = True) -> Iterator[None]:
        try:
            yield
        except (RedisError, OSError) as exc:
            if count:
                self.num_unavailable_errors += 1
            raise DirectoryUnavailable(
                f"prefix directory at {self.url} unavailable: {type(exc).__name__}: {exc}"
            ) from exc


def _ttl_ms(ttl_s: float | None) -> int:
    """Milliseconds for PEXPIRE; 0 means no expiry."""
    return 0 if ttl_s is None else max(1, math.ceil(ttl_s * 1000))
