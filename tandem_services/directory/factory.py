"""Directory settings (from `--redis-url` and friends) -> a `PrefixDirectory`."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.extras import require
from tandem_services.directory.base import DEFAULT_WORKER_TTL_S, PrefixDirectory
from tandem_services.directory.memory import InMemoryDirectory


@dataclass(frozen=True)
class DirectoryConfig:
    """Where the prefix-cache directory lives. An empty `redis_url` means in memory.

    The TLS files and `redis_tls` apply to Redis only; `rediss://` URLs imply TLS.
    """

    redis_url: str = ""
    redis_password: str | None = None
    redis_username: str | None = None
    redis_tls: bool = False
    redis_tls_ca_certs: str | None = None
    redis_tls_certfile: str | None = None
    redis_tls_keyfile: str | None = None
    redis_tls_check_hostname: bool = True
    key_prefix: str = "tandem:"
    worker_ttl_s: float = DEFAULT_WORKER_TTL_S
    socket_timeout_s: float = 0.5

    def __post_init__(self) -> None:
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"redis_url must start with redis://, rediss:// or unix://: {self.redis_url}"
            )
        if self.worker_ttl_s <= 0:
            raise ValueError(f"worker_ttl_s must be > 0, got {self.worker_ttl_s}")
        if self.socket_timeout_s <= 0:
            raise ValueError(f"socket_timeout_s must be > 0, got {self.socket_timeout_s}")
        if not self.key_prefix:
            raise ValueError("key_prefix must not be empty")

    @property
    def uses_redis(self) -> bool:
        return bool(self.redis_url)


def require_redis() -> None:
    """Raise MissingExtraError (one line naming the `redis` extra) unless redis imports."""
    require("redis", "redis", "the Redis prefix-cache directory (--redis-url)")


def make_directory(config: DirectoryConfig) -> PrefixDirectory:
    """A `RedisDirectory` when a URL is set (imports redis lazily), else `InMemoryDirectory`."""
    if not config.uses_redis:
        return InMemoryDirectory(worker_ttl_s=config.worker_ttl_s)
    require_redis()
    from tandem_services.directory.redis_directory import RedisDirectory

    return RedisDirectory(
        config.redis_url,
        password=config.redis_password,
        username=config.redis_username,
        tls=config.redis_tls,
        tls_ca_certs=config.redis_tls_ca_certs,
        tls_certfile=config.redis_tls_certfile,
        tls_keyfile=config.redis_tls_keyfile,
        tls_check_hostname=config.redis_tls_check_hostname,
        key_prefix=config.key_prefix,
        worker_ttl_s=config.worker_ttl_s,
        socket_timeout_s=config.socket_timeout_s,
        connect_timeout_s=config.socket_timeout_s,
    )
