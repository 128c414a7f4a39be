"""pytest plugin: real redis-server fixtures (no mock Redis anywhere).

Registered from tests/conftest.py with `pytest_plugins = ["tests.conftest_redis"]`.

- `redis_server` (session): one shared server; tests isolate themselves by key prefix
  (`redis_key_prefix`), never by flushing.
- `redis_server_factory` (function): starts private servers a test may stop and start again
  (outage tests); all are killed at teardown.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from tests.redis_server import RedisServer, RedisServerError


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A redis-server on a free loopback port for the whole session."""
    try:
        server = RedisServer().start()
    except RedisServerError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_key_prefix() -> str:
    """A key prefix no other test uses."""
    return f"tandem-test:{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """`make(**kwargs) -> RedisServer` (started); every server is closed after the test."""
    servers: list[RedisServer] = []

    def make(**kwargs: object) -> RedisServer:
        try:
            server = RedisServer(**kwargs)  # type: ignore[arg-type]
        except RedisServerError as exc:
            pytest.fail(str(exc), pytrace=False)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.close()
