"""Fixtures of the directory tests: one suite, both backends."""

from __future__ import annotations

import pytest

from tandem_services.directory.memory import InMemoryDirectory
from tests.directory.helpers import DirectoryFactory


@pytest.fixture(params=["memory", "redis"])
def make_directory(request: pytest.FixtureRequest) -> DirectoryFactory:
    """`make(**kwargs)` builds a fresh directory of the parametrized backend.

    Redis directories share the session server and get a key prefix of their own.
    """
    if request.param == "memory":
        return InMemoryDirectory
    from tandem_services.directory.redis_directory import RedisDirectory

    server = request.getfixturevalue("redis_server")
    prefix = request.getfixturevalue("redis_key_prefix")

    def make(**kwargs: object) -> RedisDirectory:
        return RedisDirectory(server.url, key_prefix=prefix, **kwargs)  # type: ignore[arg-type]

    return make
