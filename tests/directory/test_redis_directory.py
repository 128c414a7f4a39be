"""What only the Redis backend has: one round trip, script cache, auth, outages, keys."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem_services.directory.base import DirectoryUnavailable
from tandem_services.directory.factory import DirectoryConfig, make_directory
from tandem_services.directory.memory import InMemoryDirectory
from tandem_services.directory.redis_directory import RedisDirectory, redact_url
from tests.directory.helpers import chain
from tests.redis_server import RedisServer

A, B = "prefill-a", "prefill-b"


def test_one_round_trip_per_call(redis_server: RedisServer, redis_key_prefix: str) -> None:
    h = chain("rt", 300)

    async def main() -> None:
        d = RedisDirectory(redis_server.url, key_prefix=redis_key_prefix)
        try:
            await d.publish(A, h[:200])
            await d.publish(B, h[:7])
            await d._client.script_flush()  # as after a server restart: EVALSHA misses once
            sent: list[str] = []
            original = d._client.execute_command

            async def counting(*args: object, **kwargs: object) -> object:
                sent.append(str(args[0]))
                return await original(*args, **kwargs)

            d._client.execute_command = counting  # type: ignore[method-assign]
            assert await d.longest_prefix(h) == {A: 200, B: 7}
            assert sent == ["EVALSHA", "EVAL"]  # script cache miss: one EVAL fallback
            sent.clear()
            assert await d.longest_prefix(h) == {A: 200, B: 7}
            await d.publish(B, h[7:9], [h[0]])
            await d.replace_worker(B, h[:9])
            assert await d.longest_prefix(h) == {A: 200, B: 9}
            assert sent == ["EVALSHA", "EVALSHA", "EVAL", "EVALSHA", "EVAL", "EVALSHA"]
            sent.clear()
            await d.publish(B, [h[9]])
            assert sent == ["EVALSHA"]
        finally:
            await d.close()

    asyncio.run(main())


def test_keys_carry_the_ttl_and_prefix(redis_server: RedisServer, redis_key_prefix: str) -> None:
    async def main() -> None:
        d = RedisDirectory(redis_server.url, key_prefix=redis_key_prefix, worker_ttl_s=20.0)
        try:
            await d.publish(A, chain("k", 2))
            pttl = await d._client.pttl(d.worker_key(A))
            assert 19_000 < pttl <= 20_000
            await d.heartbeat(A, ttl_s=5.0)
            assert 4_000 < await d._client.pttl(d.worker_key(A)) <= 5_000
            await d.publish(A, chain("k2", 1))  # later publishes keep the heartbeat's ttl
            assert 4_000 < await d._client.pttl(d.worker_key(A)) <= 5_000
            keys = {k.decode() async for k in d._client.scan_iter(f"{redis_key_prefix}*")}
            assert keys == {f"{redis_key_prefix}workers", f"{redis_key_prefix}w:{A}"}
        finally:
            await d.close()

    asyncio.run(main())


def test_expired_worker_leaves_the_registry(
    redis_server: RedisServer, redis_key_prefix: str
) -> None:
    async def main() -> None:
        d = RedisDirectory(redis_server.url, key_prefix=redis_key_prefix, worker_ttl_s=0.1)
        try:
            await d.publish(A, chain("reg", 1))
            registry = f"{redis_key_prefix}workers"
            assert await d._client.smembers(registry) == {A.encode()}
            await asyncio.sleep(0.2)
            assert await d.longest_prefix(chain("reg", 1)) == {}
            assert await d._client.smembers(registry) == set()  # the script cleaned it
        finally:
            await d.close()

    asyncio.run(main())


def test_password(redis_server_factory: Callable[..., RedisServer]) -> None:
    server = redis_server_factory(password="s3cret")

    async def main() -> None:
        good = RedisDirectory(server.url, password="s3cret")
        bad = RedisDirectory(server.url, password="wrong")
        try:
            await good.publish(A, chain("pw", 1))
            assert await good.longest_prefix(chain("pw", 1)) == {A: 1}
            with pytest.raises(DirectoryUnavailable):
                await bad.longest_prefix(chain("pw", 1))
        finally:
            await good.close()
            await bad.close()

    asyncio.run(main())


def test_outage_raises_quickly_then_recovers(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    server = redis_server_factory()
    h = chain("outage", 3)

    async def main() -> None:
        d = RedisDirectory(server.url)
        try:
            await d.publish(A, h)
            assert await d.longest_prefix(h) == {A: 3}
            server.stop()
            calls = [
                lambda: d.longest_prefix(h),
                lambda: d.publish(A, h),
                lambda: d.replace_worker(A, h),
                lambda: d.heartbeat(A),
                lambda: d.remove_worker(A),
                lambda: d.num_blocks(A),
                lambda: d.workers(),
            ]
            for call in calls:
                start = time.monotonic()
                with pytest.raises(DirectoryUnavailable, match="unavailable"):
                    await call()
                assert time.monotonic() - start < 1.0
            assert d.num_unavailable_errors == len(calls)
            assert await d.ping() is False
            server.start()  # an empty server on the same port: the same client reconnects
            assert await d.ping() is True
            assert await d.longest_prefix(h) == {}
            assert await d.publish(A, h) is False
            assert await d.longest_prefix(h) == {A: 3}
        finally:
            await d.close()

    asyncio.run(main())


def test_restart_between_calls_is_invisible(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    # The pooled connection dies with the server; one immediate retry reconnects.
    server = redis_server_factory()

    async def main() -> None:
        d = RedisDirectory(server.url)
        try:
            await d.publish(A, chain("r", 1))
            server.stop()
            server.start()
            assert await d.longest_prefix(chain("r", 1)) == {}
        finally:
            await d.close()

    asyncio.run(main())


def test_nothing_listening_fails_fast() -> None:
    from tests.ports import free_port

    async def main() -> None:
        d = RedisDirectory(f"redis://127.0.0.1:{free_port()}/0")
        try:
            start = time.monotonic()
            with pytest.raises(DirectoryUnavailable):
                await d.longest_prefix(chain("none", 2))
            assert time.monotonic() - start < 1.0
        finally:
            await d.close()

    asyncio.run(main())


def test_redact_url() -> None:
    assert redact_url("redis://:pw@host:6379/0") == "redis://:***@host:6379/0"
    assert redact_url("rediss://user:pw@h:1/2") == "rediss://user:***@h:1/2"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"


def test_config_and_factory(redis_server: RedisServer) -> None:
    assert isinstance(make_directory(DirectoryConfig()), InMemoryDirectory)
    with pytest.raises(ValueError, match="redis_url"):
        DirectoryConfig(redis_url="http://x")
    with pytest.raises(ValueError, match="TLS files"):
        RedisDirectory("redis://127.0.0.1:1/0", tls_ca_certs="/ca.pem")
    d = make_directory(DirectoryConfig(redis_url=redis_server.url, worker_ttl_s=7.0))
    assert isinstance(d, RedisDirectory)
    assert d.worker_ttl_s == 7.0
    tls = RedisDirectory("redis://127.0.0.1:1/0", tls=True)
    assert tls.url.startswith("rediss://")

    async def ping_and_close() -> bool:
        try:
            return await d.ping()
        finally:
            await d.close()
            await tls.close()

    assert asyncio.run(ping_and_close()) is True


def _self_signed_cert(tmp_path: Path) -> tuple[str, str]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl CLI not found (needed to make a test certificate)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "1",
            "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return str(cert), str(key)


def test_tls(redis_server_factory: Callable[..., RedisServer], tmp_path: Path) -> None:
    certfile, keyfile = _self_signed_cert(tmp_path)
    server = redis_server_factory(tls_cert=(certfile, keyfile))
    assert server.url.startswith("rediss://")
    plain_url = server.url.replace("rediss://", "redis://")

    async def main() -> None:
        trusted = RedisDirectory(plain_url, tls=True, tls_ca_certs=certfile)
        untrusted = RedisDirectory(server.url)  # the system CAs do not know this certificate
        plain = RedisDirectory(plain_url, socket_timeout_s=0.1, retries=0)
        try:
            await trusted.publish(A, chain("tls", 2))
            assert await trusted.longest_prefix(chain("tls", 2)) == {A: 2}
            with pytest.raises(DirectoryUnavailable):
                await untrusted.longest_prefix(chain("tls", 2))
            with pytest.raises(DirectoryUnavailable):
                await plain.longest_prefix(chain("tls", 2))
        finally:
            for d in (trusted, untrusted, plain):
                await d.close()

    asyncio.run(main())
