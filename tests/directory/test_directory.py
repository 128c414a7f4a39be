"""One suite, both `PrefixDirectory` backends (in memory and a real redis-server)."""

from __future__ import annotations

import asyncio

import pytest

from tandem_services.directory.base import PrefixDirectory
from tests.directory.helpers import DirectoryFactory, chain, run_with

A, B, C, D = "prefill-a", "prefill-b", "prefill-c", "prefill-d"


def test_empty_directory_and_empty_chain(make_directory: DirectoryFactory) -> None:
    async def body(d: PrefixDirectory) -> None:
        assert await d.longest_prefix([]) == {}
        assert await d.longest_prefix(chain("x", 4)) == {}
        await d.publish(A, chain("x", 2))
        assert await d.longest_prefix([]) == {}
        assert await d.longest_prefix(chain("other", 3)) == {}
        assert await d.num_blocks(B) == 0
        assert await d.workers() == {A}

    run_with(make_directory, body)


def test_add_then_longest_prefix(make_directory: DirectoryFactory) -> None:
    h = chain("sys", 6)

    async def body(d: PrefixDirectory) -> None:
        assert await d.publish(A, h[:3]) is False  # held nothing before
        assert await d.publish(A, [h[0]]) is True  # duplicate add: no change
        assert await d.num_blocks(A) == 3
        assert await d.longest_prefix(h) == {A: 3}
        assert await d.longest_prefix(h[:2]) == {A: 2}
        assert await d.longest_prefix(h[1:]) == {A: 2}  # hashes are opaque: h1, h2 held
        assert await d.longest_prefix([h[3], h[0]]) == {}  # first block missing: nothing

    run_with(make_directory, body)


def test_chains_with_gaps_several_workers(make_directory: DirectoryFactory) -> None:
    h = chain("gaps", 5)

    async def body(d: PrefixDirectory) -> None:
        await d.publish(A, [h[0], h[1], h[3], h[4]])  # gap at 2: counts 2
        await d.publish(B, h[1:])  # misses the first block: absent
        await d.publish(C, [h[0]])
        await d.publish(D, h)
        assert await d.longest_prefix(h) == {A: 2, C: 1, D: 5}
        assert await d.workers() == {A, B, C, D}

    run_with(make_directory, body)


def test_long_chain_counts_cross_script_chunks(make_directory: DirectoryFactory) -> None:
    # The Redis script walks in growing chunks (16, 64, 256, ...): stop points on both
    # sides of each chunk boundary must count exactly.
    h = chain("long", 400)
    lengths = {"w0": 1, "w15": 15, "w16": 16, "w17": 17, "w80": 80, "w81": 81, "w337": 337}
    lengths["w400"] = 400

    async def body(d: PrefixDirectory) -> None:
        for w, n in lengths.items():
            await d.publish(w, h[:n] + h[n + 1 :])  # everything but block n
        assert await d.longest_prefix(h) == lengths
        assert await d.longest_prefix(h[:16]) == {w: min(n, 16) for w, n in lengths.items()}

    run_with(make_directory, body)


def test_evict(make_directory: DirectoryFactory) -> None:
    h = chain("evict", 4)

    async def body(d: PrefixDirectory) -> None:
        await d.publish(A, h)
        await d.publish(B, h)
        await d.publish(A, [], [h[1]])
        assert await d.longest_prefix(h) == {A: 1, B: 4}
        assert await d.num_blocks(A) == 3
        await d.publish(B, [], [h[0]])  # B keeps 3 blocks but none is reachable
        assert await d.longest_prefix(h) == {A: 1}
        await d.publish(A, [], [h[0], h[2], h[3]])  # A holds nothing now
        assert await d.num_blocks(A) == 0
        assert await d.workers() == {B}
        assert await d.longest_prefix(h) == {}

    run_with(make_directory, body)


def test_evictions_apply_before_additions(make_directory: DirectoryFactory) -> None:
    h = chain("order", 2)

    async def body(d: PrefixDirectory) -> None:
        await d.publish(A, [h[0]])
        await d.publish(A, [h[0], h[1]], [h[0]])
        assert await d.longest_prefix(h) == {A: 2}

    run_with(make_directory, body)


def test_explicit_removal(make_directory: DirectoryFactory) -> None:
    h = chain("remove", 3)

    async def body(d: PrefixDirectory) -> None:
        await d.publish(A, h)
        await d.publish(B, h[:2])
        await d.remove_worker(A)
        await d.remove_worker("never-seen")
        assert await d.longest_prefix(h) == {B: 2}
        assert await d.num_blocks(A) == 0
        assert await d.workers() == {B}
        assert await d.heartbeat(A) is False
        assert await d.publish(A, [h[0]]) is False  # a worker that comes back starts empty
        assert await d.longest_prefix(h) == {A: 1, B: 2}

    run_with(make_directory, body)


def test_replace_worker(make_directory: DirectoryFactory) -> None:
    h = chain("replace", 4)

    async def body(d: PrefixDirectory) -> None:
        await d.publish(A, [h[0], h[3]])
        await d.replace_worker(A, h[:3])
        assert await d.num_blocks(A) == 3
        assert await d.longest_prefix(h) == {A: 3}
        await d.replace_worker(A, [])
        assert await d.num_blocks(A) == 0
        assert await d.longest_prefix(h) == {}
        assert await d.workers() == set()

    run_with(make_directory, body)


def test_worker_expiry(make_directory: DirectoryFactory) -> None:
    h = chain("ttl", 3)

    async def body(d: PrefixDirectory) -> None:
        assert await d.heartbeat(B, ttl_s=30.0) is False  # nothing held yet
        await d.publish(A, h)  # the directory's default ttl: 0.3 s
        await d.publish(B, h[:2])  # B's own ttl (30 s) from its heartbeat
        assert await d.longest_prefix(h) == {A: 3, B: 2}
        await asyncio.sleep(0.45)
        assert await d.longest_prefix(h) == {B: 2}
        assert await d.num_blocks(A) == 0
        assert await d.workers() == {B}
        assert await d.heartbeat(A) is False
        assert await d.publish(A, [h[0]]) is False  # tells the worker to republish

    run_with(make_directory, body, worker_ttl_s=0.3)


def test_heartbeat_keeps_worker_alive(make_directory: DirectoryFactory) -> None:
    h = chain("alive", 2)

    async def body(d: PrefixDirectory) -> None:
        await d.publish(A, h)
        await d.publish(B, h)
        for _ in range(4):  # 0.6 s in all: twice the ttl
            await asyncio.sleep(0.15)
            assert await d.heartbeat(A) is True
        assert await d.longest_prefix(h) == {A: 2}  # B stopped reporting

    run_with(make_directory, body, worker_ttl_s=0.3)


def test_no_ttl_never_expires(make_directory: DirectoryFactory) -> None:
    h = chain("forever", 2)

    async def body(d: PrefixDirectory) -> None:
        await d.publish(A, h)
        assert await d.heartbeat(A) is True
        await asyncio.sleep(0.05)
        assert await d.longest_prefix(h) == {A: 2}

    run_with(make_directory, body, worker_ttl_s=None)


def test_hashes_of_mixed_lengths(make_directory: DirectoryFactory) -> None:
    # Opaque bytes: any length from 1 to 64, any byte values (the Redis backend packs them
    # with a length byte each when they differ in length).
    h = [bytes([i % 256]) * (1 + (i * 7) % 64) for i in range(40)] + [b"\x01\x02", b"\xff" * 64]
    h[3] = b"\x00\r\n*1\r\n"

    async def body(d: PrefixDirectory) -> None:
        await d.publish(A, h)
        await d.publish(B, h[:30], [])
        assert await d.longest_prefix(h) == {A: 42, B: 30}
        await d.publish(A, [h[0]], [h[41], h[20], h[0]])
        assert await d.longest_prefix(h) == {A: 20, B: 30}
        await d.replace_worker(B, h[:3] + h[4:])
        assert await d.longest_prefix(h) == {A: 20, B: 3}
        assert await d.num_blocks(B) == 41

    run_with(make_directory, body)


def test_rejects_bad_input(make_directory: DirectoryFactory) -> None:
    async def body(d: PrefixDirectory) -> None:
        with pytest.raises(ValueError, match="worker_id"):
            await d.publish("", [b"x"])
        with pytest.raises(ValueError, match="block hash"):
            await d.publish(A, ["not-bytes"])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="block hash"):
            await d.publish(A, [b"x" * 65])
        with pytest.raises(ValueError, match="block hash"):
            await d.publish(A, [b""])
        with pytest.raises(ValueError, match="ttl_s"):
            await d.heartbeat(A, ttl_s=0)

    run_with(make_directory, body)
    with pytest.raises(ValueError, match="worker_ttl_s"):
        make_directory(worker_ttl_s=0)
