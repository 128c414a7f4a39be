"""BlockPool and its free queue: exact block ids, LRU order, hash index bookkeeping."""

from __future__ import annotations

import pytest

from tandem.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from tandem.core.kv_cache_utils import hash_block_tokens


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def h(i: int) -> bytes:
    return hash_block_tokens(None, [i])


def test_fresh_pool_hands_out_blocks_in_id_order() -> None:
    pool = BlockPool(6)
    assert free_ids(pool) == [0, 1, 2, 3, 4, 5]
    assert pool.is_whole and pool.usage == 0.0
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 3 and pool.usage == 0.5
    assert not pool.is_whole
    pool.check_invariants()
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    pool.free_blocks(reversed(blocks))
    pool.check_invariants()
    assert pool.is_whole


def test_blocks_freed_tail_first_are_evicted_first() -> None:
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 0 1 2
    b = pool.get_new_blocks(2)  # 3 4
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [5, 2, 1, 0]
    pool.free_blocks(reversed(b))
    assert free_ids(pool) == [5, 2, 1, 0, 4, 3]
    # LRU: the head goes first.
    assert [x.block_id for x in pool.get_new_blocks(3)] == [5, 2, 1]
    assert free_ids(pool) == [0, 4, 3]


def test_touch_revives_a_free_cached_block_from_the_middle() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks[:2], [h(0), h(1)])
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1, 0]
    hit = pool.get_cached_block(h(1))
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert free_ids(pool) == [3, 2, 0]
    # A second holder only bumps the count.
    pool.touch([hit])
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 3
    pool.check_invariants()
    pool.free_blocks([hit])
    assert free_ids(pool) == [3, 2, 0]
    pool.free_blocks([hit])
    assert free_ids(pool) == [3, 2, 0, 1]
    assert hit.block_hash == h(1)  # still cached while free
    pool.check_invariants()
    assert pool.is_whole


def test_reusing_a_cached_block_evicts_its_hash() -> None:
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(0), h(1)])
    pool.free_blocks(reversed(blocks))  # queue: 1 0
    (reused,) = pool.get_new_blocks(1)
    assert reused.block_id == 1
    assert reused.block_hash is None
    assert pool.get_cached_block(h(1)) is None
    assert pool.get_cached_block(h(0)) is blocks[0]
    pool.check_invariants()
    pool.free_blocks([reused])
    assert pool.is_whole


def test_one_block_per_hash_and_hit_blocks_keep_their_hash() -> None:
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks([a], [h(7)])
    pool.cache_full_blocks([b], [h(7)])  # same content computed twice: b stays unregistered
    assert b.block_hash is None and pool.get_cached_block(h(7)) is a
    pool.cache_full_blocks([a], [h(7)])  # re-registering a hit block is a no-op
    with pytest.raises(ValueError):
        pool.cache_full_blocks([a], [h(8)])
    with pytest.raises(ValueError):
        pool.cache_full_blocks([c], [])
    pool.check_invariants()
    pool.free_blocks([c, b, a])
    assert pool.is_whole


def test_uncache_and_reset_prefix_cache() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(0), h(1)])
    pool.uncache_block(blocks[1])
    assert blocks[1].block_hash is None and pool.get_cached_block(h(1)) is None
    assert not pool.reset_prefix_cache()  # refused while in use
    assert pool.get_cached_block(h(0)) is blocks[0]
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h(0)) is None
    assert all(b.block_hash is None for b in pool.blocks)
    pool.check_invariants()


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(0), h(1)])
    assert pool.get_cached_block(h(0)) is None
    pool.free_blocks(blocks)
    pool.check_invariants()


def test_freeing_too_often_is_an_error() -> None:
    pool = BlockPool(2)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(ValueError):
        pool.free_blocks([blk])


def test_check_invariants_catches_corruption() -> None:
    pool = BlockPool(3)
    blk = pool.get_new_blocks(1)[0]
    blk.ref_cnt = 0  # says free, but is not in the queue
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool = BlockPool(3)
    blk = pool.get_new_blocks(1)[0]
    blk.block_hash = h(3)  # hash not in the index
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_free_queue_operations() -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = FreeKVCacheBlockQueue(blocks)
    assert len(q) == 4
    q.remove(blocks[2])
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 1, 3]
    with pytest.raises(ValueError):
        q.remove(blocks[2])
    with pytest.raises(ValueError):
        q.append(blocks[0])
    q.append(blocks[2])
    assert [b.block_id for b in q.popleft_n(2)] == [0, 1]
    assert [b.block_id for b in q.get_all_free_blocks()] == [3, 2]
    q.popleft()
    q.popleft()
    assert len(q) == 0
    with pytest.raises(ValueError):
        q.popleft()
    q.append_n(blocks[:2])
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 1]


class _Events:
    """Records `on_cache_event` calls in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[bytes], list[bytes]]] = []

    def __call__(self, added: list[bytes], evicted: list[bytes]) -> None:
        self.calls.append((list(added), list(evicted)))

    def take(self) -> list[tuple[list[bytes], list[bytes]]]:
        calls, self.calls = self.calls, []
        return calls


def test_cache_events_report_every_index_change_once_and_in_order() -> None:
    pool = BlockPool(3)
    events = _Events()
    pool.on_cache_event = events
    a, b, c = pool.get_new_blocks(3)
    assert events.take() == []  # nothing was cached: no eviction, no call
    pool.cache_full_blocks([a, b], [h(0), h(1)])
    assert events.take() == [([h(0), h(1)], [])]
    pool.cache_full_blocks([c], [h(0)])  # duplicate content: nothing registered
    pool.cache_full_blocks([a], [h(0)])  # hit block re-registered: no change
    assert events.take() == []
    pool.cache_full_blocks([c], [h(2)])
    assert events.take() == [([h(2)], [])]
    pool.uncache_block(c)
    assert events.take() == [([], [h(2)])]
    pool.uncache_block(c)  # already gone
    assert events.take() == []
    pool.free_blocks([c, b, a])  # queue: c b a; freeing evicts nothing
    assert events.take() == []
    pool.get_new_blocks(2)  # reuses c (no hash) and b (h1): one eviction
    assert events.take() == [([], [h(1)])]
    assert pool.cached_block_hashes() == [h(0)]
    pool.check_invariants()


def test_cache_events_on_reset_and_replay_to_the_same_set() -> None:
    pool = BlockPool(4)
    events = _Events()
    pool.on_cache_event = events
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, [h(i) for i in range(4)])
    pool.free_blocks(reversed(blocks))
    new = pool.get_new_blocks(2)  # evicts h3, h2 (freed tail first)
    pool.cache_full_blocks(new, [h(8), h(9)])
    pool.free_blocks(reversed(new))
    # Replaying the events gives exactly the pool's index.
    held: set[bytes] = set()
    for added, evicted in events.calls:
        assert not set(added) & set(evicted)
        held -= set(evicted)
        held |= set(added)
    assert held == set(pool.cached_block_hashes()) == {h(0), h(1), h(8), h(9)}
    events.take()
    assert pool.reset_prefix_cache()
    ((added, evicted),) = events.take()
    assert added == [] and set(evicted) == held
    assert pool.cached_block_hashes() == []
    pool.check_invariants()


def test_no_listener_no_change_in_behaviour() -> None:
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(0), h(1)])
    pool.free_blocks(reversed(blocks))
    assert [b.block_id for b in pool.get_new_blocks(1)] == [1]
    assert pool.cached_block_hashes() == [h(0)]
