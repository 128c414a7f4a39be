"""DirectoryPublisher: batching, ordering, expiry recovery, and a Redis outage."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

from tandem_services.directory.base import PrefixDirectory
from tandem_services.directory.publisher import DirectoryPublisher
from tandem_services.directory.redis_directory import RedisDirectory
from tests.directory.helpers import DirectoryFactory, chain, run_with
from tests.redis_server import RedisServer

W = "prefill-0"


async def wait_until(check: Callable[[], Awaitable[bool]], timeout_s: float = 3.0) -> float:
    """Poll `check` until true; returns the seconds it took (fails after `timeout_s`)."""
    start = time.monotonic()
    while not await check():
        assert time.monotonic() - start < timeout_s, "condition not reached in time"
        await asyncio.sleep(0.005)
    return time.monotonic() - start


class FakePool:
    """Stands in for a block pool's set of cached hashes (the engine is not under test)."""

    def __init__(self, held: list[bytes] | None = None) -> None:
        self.held = set(held or [])

    def add(self, pub: DirectoryPublisher, hashes: list[bytes]) -> None:
        self.held.update(hashes)
        pub.record(added=hashes)

    def evict(self, pub: DirectoryPublisher, hashes: list[bytes]) -> None:
        self.held.difference_update(hashes)
        pub.record(evicted=hashes)

    def snapshot(self) -> list[bytes]:
        return list(self.held)


def test_start_publishes_what_the_worker_holds(make_directory: DirectoryFactory) -> None:
    h = chain("start", 5)

    async def body(d: PrefixDirectory) -> None:
        await d.publish(W, chain("stale", 3))  # left by a previous run of this worker id
        pool = FakePool(h)
        pub = DirectoryPublisher(d, W, pool.snapshot)
        assert pub.dirty
        await pub.start()
        await wait_until(lambda: _holds(d, h, 5))
        assert await d.num_blocks(W) == 5  # the stale entries are gone
        assert not pub.dirty and pub.num_republishes == 1
        await pub.stop()
        assert await d.num_blocks(W) == 0  # stop() removes the worker

    run_with(make_directory, body)


def test_flush_after_bounded_delay_in_one_batch(make_directory: DirectoryFactory) -> None:
    h = chain("delay", 6)

    async def body(d: PrefixDirectory) -> None:
        pool = FakePool()
        pub = DirectoryPublisher(d, W, pool.snapshot, max_delay_s=0.1, max_batch=512)
        await pub.start()
        await wait_until(lambda: _not_dirty(pub))
        for i in range(3):  # three steps' worth of changes inside one delay window
            pool.add(pub, h[2 * i : 2 * i + 2])
        assert await d.num_blocks(W) == 0  # not yet: the delay bounds, it does not skip
        took = await wait_until(lambda: _holds(d, h, 6))
        assert 0.05 <= took < 1.0
        assert pub.num_flushes == 1 and pub.num_published_hashes == 6
        await pub.stop()

    run_with(make_directory, body)


def test_full_batch_flushes_without_waiting(make_directory: DirectoryFactory) -> None:
    h = chain("full", 8)

    async def body(d: PrefixDirectory) -> None:
        pool = FakePool()
        pub = DirectoryPublisher(d, W, pool.snapshot, max_delay_s=30.0, max_batch=4)
        await pub.start()
        await wait_until(lambda: _not_dirty(pub))
        pool.add(pub, h[:3])
        await asyncio.sleep(0.1)
        assert await d.num_blocks(W) == 0  # 3 < max_batch and the delay is long
        pool.add(pub, h[3:4])
        took = await wait_until(lambda: _holds(d, h, 4))
        assert took < 1.0
        assert pub.num_flushes == 1
        await pub.stop()

    run_with(make_directory, body)


def test_last_change_per_hash_wins(make_directory: DirectoryFactory) -> None:
    h = chain("coalesce", 3)

    async def body(d: PrefixDirectory) -> None:
        pool = FakePool(h)
        pub = DirectoryPublisher(d, W, pool.snapshot)
        assert await pub.flush()  # first flush: the full publish
        pool.evict(pub, [h[1]])
        pool.add(pub, [h[1]])  # re-cached in the same window: held
        pool.evict(pub, [h[2]])
        assert pub.num_pending == 2
        assert await pub.flush()
        assert await d.longest_prefix(h) == {W: 2}
        assert await d.num_blocks(W) == 2

    run_with(make_directory, body)


def test_record_from_the_engine_thread(make_directory: DirectoryFactory) -> None:
    h = chain("thread", 40)

    async def body(d: PrefixDirectory) -> None:
        pool = FakePool()
        pub = DirectoryPublisher(d, W, pool.snapshot, max_delay_s=0.02, max_batch=16)
        await pub.start()
        await wait_until(lambda: _not_dirty(pub))

        def engine_steps() -> None:
            for i in range(0, 40, 4):
                pool.add(pub, h[i : i + 4])
                time.sleep(0.002)
            pool.evict(pub, h[30:])

        t = threading.Thread(target=engine_steps)
        t.start()
        await asyncio.to_thread(t.join)
        await wait_until(lambda: _holds(d, h, 30))
        await wait_until(lambda: _num_blocks_is(d, 30))
        await pub.stop()

    run_with(make_directory, body)


def test_expired_entries_are_republished(make_directory: DirectoryFactory) -> None:
    # A worker stalled past its ttl: the directory dropped it; the next heartbeat notices.
    h = chain("stall", 4)

    async def body(d: PrefixDirectory) -> None:
        pool = FakePool(h)
        pub = DirectoryPublisher(d, W, pool.snapshot, ttl_s=0.15)
        assert await pub.flush()
        await asyncio.sleep(0.25)
        assert await d.longest_prefix(h) == {}
        assert await pub.heartbeat() is False
        assert pub.dirty
        assert await pub.flush()
        assert await d.longest_prefix(h) == {W: 4}
        assert pub.num_republishes == 2

    run_with(make_directory, body, worker_ttl_s=30.0)


def test_publish_into_emptied_directory_republishes(make_directory: DirectoryFactory) -> None:
    # The entries went (expiry, or a restarted server) before the publisher heard of it.
    h = chain("emptied", 4)

    async def body(d: PrefixDirectory) -> None:
        pool = FakePool(h[:3])
        pub = DirectoryPublisher(d, W, pool.snapshot)
        assert await pub.flush()
        await d.remove_worker(W)
        pool.add(pub, [h[3]])
        assert await pub.flush()  # publish answers "held nothing": full republish follows
        assert await d.longest_prefix(h) == {W: 4}
        assert pub.num_republishes == 2

    run_with(make_directory, body)


def test_heartbeats_keep_an_idle_worker_alive(make_directory: DirectoryFactory) -> None:
    h = chain("idle", 3)

    async def body(d: PrefixDirectory) -> None:
        pool = FakePool(h)
        pub = DirectoryPublisher(d, W, pool.snapshot, ttl_s=0.3)  # heartbeat every 0.1 s
        await pub.start()
        await wait_until(lambda: _not_dirty(pub))
        await asyncio.sleep(0.7)  # more than twice the ttl, nothing recorded
        assert await d.longest_prefix(h) == {W: 3}
        pool.add(pub, chain("idle-more", 1))
        await pub.stop(remove=False)  # flushes what is pending, keeps the entries
        assert await d.num_blocks(W) == 4
        await asyncio.sleep(0.4)  # no more heartbeats: like a crashed worker
        assert await d.num_blocks(W) == 0

    run_with(make_directory, body)


def test_redis_outage_and_recovery(redis_server_factory: Callable[..., RedisServer]) -> None:
    server = redis_server_factory()
    h = chain("outage", 12)

    async def main() -> None:
        d = RedisDirectory(server.url)
        pool = FakePool(h[:4])
        pub = DirectoryPublisher(d, W, pool.snapshot, max_delay_s=0.01, retry_interval_s=0.05)
        try:
            await pub.start()
            await wait_until(lambda: _not_dirty(pub))
            assert await d.num_blocks(W) == 4
            server.stop()
            pool.add(pub, h[4:8])  # this batch is lost with the server
            await wait_until(lambda: _true(pub.dirty))
            assert pub.num_unavailable_errors >= 1
            pool.add(pub, h[8:10])  # changes during the outage: dropped, not queued
            pool.evict(pub, [h[0]])
            pool.add(pub, [h[0]])
            await wait_until(lambda: _true(pub.num_pending == 0))  # no backlog kept
            assert pub.num_dropped_hashes >= 6
            server.start()  # a fresh, empty server on the same port
            took = await wait_until(lambda: _holds(d, h, 10))
            assert took < 2.0
            assert await d.num_blocks(W) == 10  # exactly the pool's set
            assert not pub.dirty
            pool.add(pub, h[10:])  # and normal batches resume
            await wait_until(lambda: _holds(d, h, 12))
        finally:
            await pub.stop()
            await d.close()

    asyncio.run(main())


async def _holds(d: PrefixDirectory, h: list[bytes], n: int) -> bool:
    return (await d.longest_prefix(h)).get(W, 0) == n


async def _num_blocks_is(d: PrefixDirectory, n: int) -> bool:
    return await d.num_blocks(W) == n


async def _not_dirty(pub: DirectoryPublisher) -> bool:
    return not pub.dirty


async def _true(value: bool) -> bool:
    return value
