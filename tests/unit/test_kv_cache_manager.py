"""KVCacheManager: allocation, prefix hits, tail-first free, no side effects when short."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.request import Request
from tandem.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def make_req(tokens: list[int], salt: str | None = None) -> Request:
    return Request(f"r{next(_ids)}", tokens, SamplingParams(), cache_salt=salt)


def free_ids(mgr: KVCacheManager) -> list[int]:
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def admit(mgr: KVCacheManager, req: Request, num_new: int | None = None) -> list[int]:
    """Admit with prefix hits, as the scheduler does, and pretend the step ran."""
    hits, num_hit = mgr.get_computed_blocks(req)
    n = req.num_tokens - num_hit if num_new is None else num_new
    assert mgr.allocate_slots(req, n, num_hit, hits) is not None
    req.num_computed_tokens = num_hit + n
    return mgr.get_block_ids(req.request_id)


def test_allocate_registers_full_blocks_and_grows_append_only() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_req(list(range(10)))
    assert mgr.get_computed_blocks(req) == ([], 0)
    new = mgr.allocate_slots(req, 10)
    assert new is not None and [b.block_id for b in new] == [0, 1, 2]
    assert mgr.get_block_ids(req.request_id) == [0, 1, 2]
    # Blocks 0 and 1 are full after this step: registered at allocation time.
    pool = mgr.block_pool
    assert len(req.block_hashes) == 2
    assert pool.get_cached_block(req.block_hashes[0]).block_id == 0
    assert pool.get_cached_block(req.block_hashes[1]).block_id == 1
    assert pool.blocks[2].block_hash is None
    req.num_computed_tokens = 10
    # Decode: tokens 10, 11 fit block 2; token 12 needs block 3.
    for tok in (10, 11):
        req.append_output_token_ids([tok])
        assert mgr.allocate_slots(req, 1) == []
        req.num_computed_tokens += 1
    assert pool.blocks[2].block_hash == req.block_hashes[2]
    req.append_output_token_ids([12])
    new = mgr.allocate_slots(req, 1)
    assert [b.block_id for b in new] == [3]
    assert mgr.get_block_ids(req.request_id) == [0, 1, 2, 3]
    req.num_computed_tokens += 1
    mgr.check_invariants()
    mgr.free(req)
    assert free_ids(mgr) == [4, 5, 6, 7, 3, 2, 1, 0]
    assert mgr.block_pool.is_whole
    mgr.check_invariants()


def test_prefix_hit_shares_blocks_and_is_never_the_whole_prompt() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_req(list(range(10)))
    assert admit(mgr, a) == [0, 1, 2]
    b = make_req([*range(8), 50, 51, 52])
    hits, n = mgr.get_computed_blocks(b)
    assert [x.block_id for x in hits] == [0, 1] and n == 8
    new = mgr.allocate_slots(b, 3, 8, hits)
    assert [x.block_id for x in new] == [3]
    assert mgr.get_block_ids(b.request_id) == [0, 1, 3]
    assert [mgr.block_pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    b.num_computed_tokens = 11
    # A prompt of exactly two cached blocks hits only one: one token must remain to compute.
    c = make_req(list(range(8)))
    hits, n = mgr.get_computed_blocks(c)
    assert [x.block_id for x in hits] == [0] and n == 4
    # Nine tokens: two blocks may hit, token 8 is computed.
    d = make_req(list(range(9)))
    assert mgr.get_computed_blocks(d)[1] == 8
    # Another cache salt never hits.
    e = make_req(list(range(10)), salt="other")
    assert mgr.get_computed_blocks(e) == ([], 0)
    for r in (a, b):
        mgr.free(r)
    mgr.check_invariants()
    assert mgr.block_pool.is_whole
    stats = mgr.prefix_cache_stats
    assert (stats.num_requests, stats.num_query_tokens, stats.num_hit_tokens) == (2, 21, 8)


def test_hit_on_free_blocks_revives_them_in_lru_order() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_req(list(range(12)))
    admit(mgr, a)  # blocks 0 1 2, all full
    mgr.free(a)
    assert free_ids(mgr) == [3, 4, 5, 2, 1, 0]
    b = make_req([*range(8), 99, 98])
    assert admit(mgr, b) == [0, 1, 3]  # hits 0, 1 leave the free queue; 3 is the head
    assert free_ids(mgr) == [4, 5, 2]
    # Block 2 (a's third block) is still cached; the next allocation evicts LRU-first.
    c = make_req([70] * 9)
    assert admit(mgr, c) == [4, 5, 2]
    assert mgr.block_pool.get_cached_block(a.block_hashes[2]) is None  # evicted on reuse
    mgr.free(b)
    mgr.free(c)
    mgr.check_invariants()
    assert mgr.block_pool.is_whole


def test_short_pool_returns_none_without_side_effects() -> None:
    mgr = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_req(list(range(9)))
    admit(mgr, a)  # blocks 0 1 (cached) 2
    mgr.free(a)
    before = (free_ids(mgr), [(b.ref_cnt, b.block_hash) for b in mgr.block_pool.blocks])
    # 16 tokens: 2 hit blocks (revived from the free queue) + 2 new = 4 > 3.
    b = make_req([*range(8), *[60] * 8])
    hits, n = mgr.get_computed_blocks(b)
    assert n == 8
    assert mgr.allocate_slots(b, 8, n, hits) is None
    after = (free_ids(mgr), [(x.ref_cnt, x.block_hash) for x in mgr.block_pool.blocks])
    assert after == before
    assert mgr.get_block_ids(b.request_id) == []
    assert mgr.prefix_cache_stats.num_requests == 1
    # 12 tokens: 2 hit blocks + 1 new = 3: fits exactly.
    c = make_req([*range(8), *[60] * 4])
    assert admit(mgr, c) == [0, 1, 2]
    assert mgr.num_free_blocks == 0 and mgr.usage == 1.0
    mgr.free(c)
    assert mgr.block_pool.is_whole


def test_free_drops_registrations_of_a_step_that_never_ran() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_req(list(range(10)))
    assert mgr.allocate_slots(a, 10) is not None  # registers blocks 0 and 1
    # Preempted before the step ran: num_computed_tokens is still 0, nothing was written.
    mgr.free(a)
    b = make_req(list(range(10)))
    assert mgr.get_computed_blocks(b) == ([], 0)
    mgr.check_invariants()
    # A chunk that ran keeps its blocks cached; the next chunk's registrations are dropped.
    c = make_req(list(range(16)))
    assert mgr.allocate_slots(c, 8) is not None
    c.num_computed_tokens = 8
    assert mgr.allocate_slots(c, 8) is not None  # registers blocks 2 and 3
    mgr.free(c)  # preempted with 8 tokens computed
    _, n = mgr.get_computed_blocks(make_req([*range(16), 1]))
    assert n == 8
    mgr.check_invariants()


def test_free_right_after_a_hit_keeps_the_hit_blocks_cached() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    admit_req = make_req(list(range(9)))
    admit(mgr, admit_req)
    mgr.free(admit_req)
    b = make_req(list(range(9)))
    hits, n = mgr.get_computed_blocks(b)
    assert mgr.allocate_slots(b, 1, n, hits) is not None
    mgr.free(b)  # num_computed_tokens still 0: the hits were valid all along
    assert mgr.get_computed_blocks(make_req(list(range(9))))[1] == 8
    mgr.check_invariants()
    assert mgr.block_pool.is_whole


def test_caching_disabled_and_max_model_len() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=False, max_model_len=12)
    assert mgr.max_num_blocks_per_req == 3
    a = make_req(list(range(8)))
    admit(mgr, a)
    assert mgr.get_computed_blocks(make_req(list(range(9)))) == ([], 0)
    assert a.block_hashes == []
    b = make_req(list(range(13)))
    with pytest.raises(ValueError):
        mgr.allocate_slots(b, 13)
    mgr.free(a)
    mgr.free(b)  # holds nothing: no-op
    assert mgr.get_block_ids("unknown") == []
    assert mgr.block_pool.is_whole
    assert mgr.prefix_cache_stats.num_query_tokens == 0


def test_external_computed_tokens_get_fresh_blocks() -> None:
    # KV pushed from another worker: computed tokens without hit blocks.
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_req(list(range(10)))
    new = mgr.allocate_slots(req, 0, num_new_computed_tokens=9)
    assert [b.block_id for b in new] == [0, 1, 2]
    req.num_computed_tokens = 9
    assert mgr.allocate_slots(req, 1) == []
    mgr.free(req)
    assert mgr.block_pool.is_whole


def test_reset_prefix_cache() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_req(list(range(9)))
    admit(mgr, a)
    assert not mgr.reset_prefix_cache()
    mgr.free(a)
    assert mgr.reset_prefix_cache()
    assert mgr.get_computed_blocks(make_req(list(range(9)))) == ([], 0)


# ---- property test: random admissions, chunks, preemptions and frees ------------------------

_PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5]]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_sequences_keep_invariants_and_cache_contents_right(data: st.DataObject) -> None:
    """Simulate KV writes per slot: every prefix hit must point at blocks whose written
    tokens equal the request's tokens, the pool stays consistent after each operation, and
    it is whole once everything is freed."""
    bs = 2
    mgr = KVCacheManager(num_blocks=10, block_size=bs)
    written: dict[int, list[int | None]] = {i: [None] * bs for i in range(10)}
    live: list[Request] = []

    def run_chunk(req: Request, n: int) -> None:
        table = mgr.get_block_ids(req.request_id)
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
            written[table[pos // bs]][pos % bs] = req.all_token_ids[pos]
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token_ids([data.draw(st.integers(0, 3), label="sampled")])

    for _ in range(data.draw(st.integers(1, 30), label="num_ops")):
        op = data.draw(st.sampled_from(["admit", "chunk", "preempt", "free"]), label="op")
        if op == "admit":
            tokens = data.draw(st.sampled_from(_PREFIXES), label="prefix") + data.draw(
                st.lists(st.integers(0, 3), max_size=5), label="tail"
            )
            req = Request(f"r{next(_ids)}", tokens, SamplingParams())
            hits, num_hit = mgr.get_computed_blocks(req)
            assert num_hit < req.num_tokens
            for i, blk in enumerate(hits):
                assert written[blk.block_id] == req.all_token_ids[i * bs : (i + 1) * bs]
            n = data.draw(st.integers(1, req.num_tokens - num_hit), label="chunk")
            if mgr.allocate_slots(req, n, num_hit, hits) is not None:
                req.num_computed_tokens = num_hit
                run_chunk(req, n)
                live.append(req)
        elif live:
            req = live[data.draw(st.integers(0, len(live) - 1), label="which")]
            if op == "free":
                mgr.free(req)
                live.remove(req)
            else:
                remaining = req.num_tokens - req.num_computed_tokens
                n = data.draw(st.integers(1, remaining), label="chunk")
                ok = mgr.allocate_slots(req, n) is not None
                if op == "preempt" or not ok:
                    mgr.free(req)  # preempted by recompute, the step never ran
                    live.remove(req)
                else:
                    run_chunk(req, n)
        mgr.check_invariants()
    for req in live:
        mgr.free(req)
    mgr.check_invariants()
    assert mgr.block_pool.is_whole
