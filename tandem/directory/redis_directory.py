"""Prefix-cache directory in a Redis server (redis-py asyncio, hiredis parser when installed).

Keys (all under `key_prefix`, default "tandem:"):

    {prefix}workers        SET of worker ids that may hold blocks
    {prefix}w:{worker_id}  SET of the block hashes that worker holds; PEXPIRE = its deadline

Invariant: `{prefix}w:{id}` exists => `id` is in `{prefix}workers`. Every write that creates
a worker's set adds the id to the registry in the same MULTI/EXEC. The lookup script drops
registry ids whose set has gone (expired, removed, emptied), so expiry needs no sweeper:
when a worker stops reporting, Redis deletes its set at the deadline and the next lookup
forgets the id.

Round trips: `publish`, `replace_worker`, `heartbeat`, `remove_worker`: one pipelined
transaction each. `longest_prefix`: one EVALSHA of a Lua script that walks the chain per
worker with SMISMEMBER in growing chunks and stops at the first miss (falls back to EVAL
once when the server has not cached the script, e.g. after a restart).

Needs Redis >= 6.2 (SMISMEMBER) on a single server or primary; the script touches keys it
does not declare, so Redis Cluster is not supported.

Every failure to talk to the server becomes `DirectoryUnavailable`, fast: short socket and
connect timeouts and at most `retries` immediate retries (one retry lets a pooled
connection that died with a server restart reconnect without surfacing an error).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterable, Iterator, Sequence
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from tandem.directory.base import (
    DEFAULT_WORKER_TTL_S,
    DirectoryUnavailable,
    PrefixDirectory,
    check_block_hashes,
    check_worker_id,
)

# ARGV[1]: key prefix; ARGV[2..]: the chain's block hashes in order.
# Returns a flat array {worker id, leading block count, ...} of workers with a count > 0.
LONGEST_PREFIX_LUA = """
local prefix = ARGV[1]
local registry = prefix .. 'workers'
local last_arg = #ARGV
local out = {}
if last_arg < 2 then
  return out
end
for _, w in ipairs(redis.call('SMEMBERS', registry)) do
  local key = prefix .. 'w:' .. w
  if redis.call('EXISTS', key) == 0 then
    redis.call('SREM', registry, w)
  else
    local count = 0
    local first = 2
    local chunk = 16
    local missed = false
    while not missed and first <= last_arg do
      local last = math.min(first + chunk - 1, last_arg)
      local held = redis.call('SMISMEMBER', key, unpack(ARGV, first, last))
      for j = 1, #held do
        if held[j] == 1 then
          count = count + 1
        else
          missed = true
          break
        end
      end
      first = last + 1
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
LONGEST_PREFIX_SHA = hashlib.sha1(LONGEST_PREFIX_LUA.encode()).hexdigest()

# Hashes per SADD in a full republish (keeps each command's argument list bounded).
_SADD_CHUNK = 8192


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
        key = self.worker_key(worker_id)
        with self._unavailable_on_error():
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.exists(key)
                if evicted:
                    pipe.srem(key, *evicted)
                if added:
                    pipe.sadd(key, *added)
                    pipe.sadd(self._registry_key, worker_id)
                self._queue_expiry(pipe, key, self.ttl_for(worker_id))
                results = await pipe.execute()
        return bool(results[0])

    async def replace_worker(self, worker_id: str, block_hashes: Iterable[bytes]) -> None:
        check_worker_id(worker_id)
        hashes = list(dict.fromkeys(block_hashes))
        check_block_hashes(hashes)
        key = self.worker_key(worker_id)
        with self._unavailable_on_error():
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(key)
                for start in range(0, len(hashes), _SADD_CHUNK):
                    pipe.sadd(key, *hashes[start : start + _SADD_CHUNK])
                if hashes:
                    pipe.sadd(self._registry_key, worker_id)
                    self._queue_expiry(pipe, key, self.ttl_for(worker_id))
                else:
                    pipe.srem(self._registry_key, worker_id)
                await pipe.execute()

    async def longest_prefix(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        if not block_hashes:
            return {}
        args = (self.key_prefix, *block_hashes)
        with self._unavailable_on_error():
            try:
                flat = await self._client.evalsha(LONGEST_PREFIX_SHA, 0, *args)
            except NoScriptError:
                flat = await self._client.eval(LONGEST_PREFIX_LUA, 0, *args)
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

    @staticmethod
    def _queue_expiry(pipe: aioredis.client.Pipeline, key: str, ttl_s: float | None) -> None:
        if ttl_s is None:
            pipe.persist(key)
        else:
            pipe.pexpire(key, _ttl_ms(ttl_s))

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


def _ttl_ms(ttl_s: float) -> int:
    return max(1, math.ceil(ttl_s * 1000))
