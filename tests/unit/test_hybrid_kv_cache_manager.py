"""The KV cache spec by attention kind and the hybrid manager: one pool, a table per group,
sliding groups freeing blocks as the window moves, prefix hits, preemption, capacity."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.config import CacheConfig, SchedulerConfig
from tandem.core.hybrid_kv_cache_manager import (
    NULL_BLOCK,
    HybridKVCacheManager,
    build_kv_cache_manager,
)
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.kv_cache_spec import NULL_BLOCK_ID, KVCacheGroupSpec, KVCacheSpec
from tandem.core.outputs import ModelRunnerOutput
from tandem.core.scheduler import Scheduler
from tandem.request import Request
from tandem.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def make_req(tokens: list[int], max_tokens: int | None = None) -> Request:
    params = SamplingParams() if max_tokens is None else SamplingParams(max_tokens=max_tokens)
    return Request(f"h{next(_ids)}", tokens, params)


def hybrid(window: int = 8, num_blocks: int = 64, caching: bool = True) -> HybridKVCacheManager:
    """One full layer, one sliding layer: groups [full, sliding]."""
    spec = KVCacheSpec.from_layer_windows(BS, [window, None])
    mgr = build_kv_cache_manager(spec, num_blocks, enable_caching=caching)
    assert isinstance(mgr, HybridKVCacheManager)
    return mgr


def step(mgr: HybridKVCacheManager, req: Request, n: int) -> None:
    assert mgr.allocate_slots(req, n) is not None
    req.num_computed_tokens += n


def admit(mgr: HybridKVCacheManager, req: Request, n: int | None = None) -> int:
    hits, num_hit = mgr.get_computed_blocks(req)
    n = req.num_tokens - num_hit if n is None else n
    assert mgr.allocate_slots(req, n, num_hit, hits) is not None
    req.num_computed_tokens = num_hit + n
    return num_hit


def test_spec_groups_by_kind_with_equal_sizes() -> None:
    # Gemma 3's pattern at 12 layers: 5 sliding then 1 full, twice.
    windows = [512] * 5 + [None] + [512] * 5 + [None]
    spec = KVCacheSpec.from_layer_windows(16, windows)
    assert spec.layers_per_group == 2
    assert [g.sliding_window for g in spec.groups] == [None] + [512] * 5
    assert spec.groups[0].layer_indices == (5, 11)
    assert spec.groups[1].layer_indices == (0, 1)
    assert spec.groups[3].layer_indices == (4, 6)
    assert spec.layer_slots()[6] == (3, 1)
    assert sorted(spec.layer_slots()) == sorted({(g, s) for g in range(6) for s in range(2)})
    # One kind: the plain cache; hybrid off: one group keeping every block.
    assert KVCacheSpec.from_layer_windows(16, [None] * 4) == KVCacheSpec.full(16, 4)
    off = KVCacheSpec.from_layer_windows(16, windows, hybrid=False)
    assert off.is_plain and off.layers_per_group == 12
    only_sliding = KVCacheSpec.from_layer_windows(16, [64] * 3)
    assert not only_sliding.is_plain and only_sliding.num_groups == 1
    assert isinstance(build_kv_cache_manager(KVCacheSpec.full(16, 4), 8), KVCacheManager)
    with pytest.raises(ValueError, match="cover layers"):
        KVCacheSpec(16, (KVCacheGroupSpec(None, (0, 2)),), 2)


def test_capacity_counts_a_sliding_group_at_window_blocks_plus_one() -> None:
    windows = [512] * 5 + [None]
    spec = KVCacheSpec.from_layer_windows(16, windows)  # 6 groups of 1 layer
    assert spec.num_groups == 6
    # 8192 tokens: 512 blocks in the full group, cdiv(512, 16) + 1 = 33 in each sliding one.
    assert spec.max_blocks_per_request(8192) == 512 + 5 * 33
    assert spec.max_concurrency(677 * 4, 8192) == pytest.approx(4.0)
    # Short requests: a sliding group never needs more than the request's own blocks.
    assert spec.max_blocks_per_request(100) == 6 * 7
    # The same cache memory with the hybrid manager off: blocks 6x the bytes, 512 a request.
    off = KVCacheSpec.from_layer_windows(16, windows, hybrid=False)
    assert off.max_concurrency(677 * 4 // 6, 8192) < 1.0
    # The tokens of context the cache holds (vLLM's "KV cache size"): concurrency times
    # max_model_len, a prefill chunk of the token budget (here 16) counted.
    per_request = 512 + 5 * (-(-(512 + 16 - 2) // 16) + 1)
    assert spec.kv_cache_size_tokens(1000, 8192, 16) == 1000 * 8192 // per_request
    assert off.kv_cache_size_tokens(1000, 8192, 16) == 16000
    assert KVCacheSpec.from_layer_windows(16, [64, 64]).kv_cache_size_tokens(10, 8192, 1) == (
        10 * 8192 // (-(-63 // 16) + 1)
    )


def test_sliding_group_frees_blocks_as_the_window_moves() -> None:
    mgr = hybrid(window=8)
    req = make_req(list(range(12)), max_tokens=100)
    admit(mgr, req)
    # 12 tokens computed: queries from 12 on read keys > 12 - 8 = 4: block 0 (0..3) is done,
    # but it is freed only at the next allocation.
    assert mgr.get_group_block_ids(req.request_id, 0) == [0, 2, 4]
    assert mgr.get_group_block_ids(req.request_id, 1) == [1, 3, 5]
    tok = 100
    for _ in range(12):
        req.append_output_token_ids([tok])
        tok += 1
        step(mgr, req, 1)
        mgr.check_invariants()
    # 24 tokens computed, the last allocation at 23: keys > 23 - 8 = 15 -> blocks 0..3 freed.
    full = mgr.get_group_block_ids(req.request_id, 0)
    sliding = mgr.get_group_block_ids(req.request_id, 1)
    assert len(full) == len(sliding) == 6
    assert NULL_BLOCK_ID not in full[1:]
    assert sliding[:4] == [NULL_BLOCK_ID] * 4 and NULL_BLOCK_ID not in sliding[4:]
    assert mgr.num_held_blocks(req.request_id) == 6 + 2
    # The sliding group never held more than cdiv(8, 4) + 1 blocks after the prompt.
    assert mgr.num_free_blocks == 64 - 8
    mgr.free(req)
    mgr.check_invariants()
    assert mgr.block_pool.is_whole


def test_interleaved_table_is_append_only_for_the_scheduler() -> None:
    """The scheduler sends each step only the tail of the flat table; freed entries keep
    their place, so the runner's copy stays aligned."""
    mgr = hybrid(window=4)
    req = make_req(list(range(5)), max_tokens=100)
    admit(mgr, req)
    sent = mgr.get_block_ids(req.request_id)
    for t in range(20):
        req.append_output_token_ids([t])
        step(mgr, req, 1)
        now = mgr.get_block_ids(req.request_id)
        assert len(now) >= len(sent) and len(now) % 2 == 0
        # Entries already sent either stay or became the null block.
        assert all(a in (b, NULL_BLOCK_ID) for a, b in zip(now, sent, strict=False))
        sent = sent + now[len(sent) :]
    mgr.free(req)
    assert mgr.block_pool.is_whole


def test_prefix_hit_needs_every_group_and_skips_sliding_blocks_left_of_the_window() -> None:
    mgr = hybrid(window=4)
    prompt = list(range(20))
    a = make_req([*prompt, 99])
    assert admit(mgr, a) == 0
    b = make_req([*prompt, 98])
    # 20 shared tokens = 5 full blocks, each cached in both groups.
    assert admit(mgr, b) == 20
    # At the hit point (20 tokens) the sliding group needs keys > 16 only: blocks 0..3 of
    # its table are null, block 4 is shared with `a`.
    mgr_tables_a_full = mgr.get_group_block_ids(a.request_id, 0)
    mgr_tables_a_sliding = mgr.get_group_block_ids(a.request_id, 1)
    sliding_b = mgr.get_group_block_ids(b.request_id, 1)
    assert sliding_b[:4] == [NULL_BLOCK_ID] * 4
    assert sliding_b[4] == mgr.get_group_block_ids(a.request_id, 1)[4]
    assert (
        mgr.get_group_block_ids(b.request_id, 0)[:5] == mgr.get_group_block_ids(a.request_id, 0)[:5]
    )
    mgr.check_invariants()
    mgr.free(a)
    mgr.free(b)
    mgr.check_invariants()
    # Everything is free and still cached. A sliding block left of the window at the hit
    # point is not needed: losing it keeps the hit.
    c = make_req([*prompt, 97])
    hits, num_hit = mgr.get_computed_blocks(c)
    assert num_hit == 20 and len(hits) == 10
    assert [b is NULL_BLOCK for b in hits[1::2]] == [True] * 4 + [False]
    pool = mgr.block_pool

    def evict(block_ids: list[int]) -> None:
        for block_id in block_ids:
            block = pool.blocks[block_id]
            pool.touch([block])
            pool.uncache_block(block)
            pool.free_blocks([block])

    a_full = mgr_tables_a_full
    a_sliding = mgr_tables_a_sliding
    evict([a_sliding[2]])
    assert mgr.get_computed_blocks(c)[1] == 20
    # The sliding block the window reads at 20 tokens (block 4) lost: at 16 tokens the
    # window reads blocks 3.. only.
    evict([a_sliding[4]])
    assert mgr.get_computed_blocks(c)[1] == 16
    # The full group loses block 3: at 12 the window needs block 2 (lost), at 8 block 1.
    evict([a_full[3]])
    hits, num_hit = mgr.get_computed_blocks(c)
    assert num_hit == 8 and [b.block_id for b in hits[::2]] == a_full[:2]
    assert hits[1] is NULL_BLOCK and hits[3].block_id == a_sliding[1]
    mgr.check_invariants()
    assert pool.is_whole


def test_preemption_and_short_pool() -> None:
    mgr = hybrid(window=4, num_blocks=6)
    a = make_req(list(range(9)), max_tokens=100)
    admit(mgr, a)  # 3 blocks per group
    assert mgr.num_free_blocks == 0
    b = make_req(list(range(50, 53)))
    hits, num_hit = mgr.get_computed_blocks(b)
    assert mgr.allocate_slots(b, 3, num_hit, hits) is None
    mgr.check_invariants()
    assert b.request_id not in mgr.req_to_blocks
    # a decodes: at 9 computed, the window (keys > 5) drops the sliding block 0, making
    # room for nothing new yet (token 9 fits block 2).
    a.append_output_token_ids([1])
    step(mgr, a, 1)
    assert mgr.num_free_blocks == 1
    # Preempt: everything goes back, cached blocks stay revivable.
    mgr.free(a)
    a.num_computed_tokens = 0
    mgr.check_invariants()
    assert mgr.block_pool.is_whole
    assert admit(mgr, a) == 8
    mgr.free(a)
    assert mgr.block_pool.is_whole


def test_free_drops_registrations_of_a_step_that_never_ran() -> None:
    mgr = hybrid(window=4)
    a = make_req(list(range(8)))
    assert mgr.allocate_slots(a, 8) is not None  # registers both full blocks in both groups
    assert len(mgr.block_pool.cached_block_hashes()) == 4
    mgr.free(a)  # preempted before the step ran: the KV was never written
    assert mgr.block_pool.cached_block_hashes() == []
    assert mgr.block_pool.is_whole


def test_scheduler_runs_a_hybrid_cache_to_completion() -> None:
    spec = KVCacheSpec.from_layer_windows(BS, [8, 8, None])  # groups: full{2}, sliding{0}, {1}
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4),
        CacheConfig(block_size=BS),
        num_blocks=48,
        max_model_len=64,
        kv_cache_spec=spec,
    )
    reqs = [make_req(list(range(i, i + 10)), max_tokens=30) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    tables: dict[str, list[int]] = {}
    peak = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        for new in so.scheduled_new_reqs:
            tables[new.req_id] = list(new.block_ids)
        for cached in so.scheduled_cached_reqs:
            tables[cached.req_id] += cached.new_block_ids
        kv = sched.kv_cache_manager
        for rid in so.num_scheduled_tokens:
            assert len(tables[rid]) == len(kv.get_block_ids(rid))
        peak = max(peak, kv.num_blocks - kv.num_free_blocks)
        ids = list(so.num_scheduled_tokens)
        sched.update_from_output(
            so,
            ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[7] for _ in ids], logprobs=[]),
        )
        kv.check_invariants()
    assert sched.kv_cache_manager.block_pool.is_whole
    # 40 tokens a request: 10 full blocks + at most 3 per sliding group; keeping every block
    # would need 3 * 30 = 90 and preempt.
    assert sched.num_preemptions == 0
    assert peak <= 3 * (10 + 2 * 3)
    # A reservation for a KV hand-off: a block per group, until it is cancelled.
    reserved_req = make_req([1, 2, 3])
    reserved = sched.reserve(reserved_req)
    assert reserved is not None and reserved[1] == 0
    assert len(reserved[0]) == sched.kv_cache_manager.num_groups
    assert sched.cancel_reservation(reserved_req.request_id)
    assert sched.kv_cache_manager.block_pool.is_whole


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_random_sequences_read_only_their_own_tokens(data: st.DataObject) -> None:
    """Simulate per-group KV writes and window reads: every key a query reads (its window in
    a sliding group, everything in the full group) is in a block the request holds, carrying
    that group's copy of that token; hits carry the right tokens; the pool ends whole."""
    bs = 2
    window = data.draw(st.integers(1, 5), label="window")
    spec = KVCacheSpec.from_layer_windows(bs, [window, None])
    mgr = build_kv_cache_manager(spec, 14)
    assert isinstance(mgr, HybridKVCacheManager)
    written: dict[int, list[tuple[int, int] | None]] = {i: [None] * bs for i in range(14)}
    live: list[Request] = []
    windows = [g.sliding_window for g in spec.groups]

    def run_chunk(req: Request, n: int) -> None:
        flat = mgr.get_blocks(req.request_id)
        c = req.num_computed_tokens
        for pos in range(c, c + n):
            for g in range(2):
                block = flat[(pos // bs) * 2 + g]
                assert block is not NULL_BLOCK and block.ref_cnt > 0
                written[block.block_id][pos % bs] = (g, req.all_token_ids[pos])
        for pos in range(c, c + n):
            for g in range(2):
                w = windows[g]
                lo = 0 if w is None else max(0, pos - w + 1)
                for k in range(lo, pos + 1):
                    block = flat[(k // bs) * 2 + g]
                    assert block is not NULL_BLOCK, (g, k, pos)
                    assert written[block.block_id][k % bs] == (g, req.all_token_ids[k])
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token_ids([data.draw(st.integers(0, 3), label="sampled")])

    for _ in range(data.draw(st.integers(1, 30), label="num_ops")):
        op = data.draw(st.sampled_from(["admit", "chunk", "chunk", "preempt", "free"]), label="op")
        if op == "admit":
            tokens = data.draw(st.sampled_from([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9]])) + data.draw(
                st.lists(st.integers(0, 3), max_size=6), label="tail"
            )
            req = Request(f"h{next(_ids)}", tokens, SamplingParams())
            hits, num_hit = mgr.get_computed_blocks(req)
            assert num_hit < req.num_tokens
            for i, blk in enumerate(hits):
                if blk is NULL_BLOCK:
                    continue
                j, g = divmod(i, 2)
                expect = [(g, t) for t in req.all_token_ids[j * bs : (j + 1) * bs]]
                assert written[blk.block_id] == expect
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
                    mgr.free(req)
                    live.remove(req)
                else:
                    run_chunk(req, n)
        mgr.check_invariants()
    for req in live:
        mgr.free(req)
    mgr.check_invariants()
    assert mgr.block_pool.is_whole


def test_only_token_hashes_are_published() -> None:
    """A prefix directory hears group 0's keys (the token hashes), never the other groups'."""
    mgr = hybrid(window=4)
    events: list[tuple[list[bytes], list[bytes]]] = []
    mgr.publish_cache_events(lambda added, evicted: events.append((added, evicted)))
    req = make_req(list(range(9)))
    admit(mgr, req)
    assert events == [(req.block_hashes[:2], [])]
    assert mgr.published_block_hashes() == req.block_hashes[:2]
    assert len(mgr.block_pool.cached_block_hashes()) == 4
    mgr.free(req)
    assert mgr.reset_prefix_cache()
    assert events[-1] == ([], req.block_hashes[:2])


def test_handoff_indices_name_each_groups_blocks_the_decode_side_reads() -> None:
    """A prompt chunked through a prefill manager (its sliding group freeing as it goes) and
    reserved on a decode manager that has part of it cached: the entries `handoff_indices`
    names are real blocks on both sides, the decode side's others are its hits or null, and
    the reservation enters the prefix index only at `cache_blocks`."""
    spec = KVCacheSpec.from_layer_windows(BS, [8, None])
    plain = KVCacheSpec.full(BS, 2)
    assert plain.handoff_indices(40, 8) == list(range(2, 10))
    # P = 40: the sliding group needs blocks from (40 - 8 + 1) // 4 = 8 on.
    assert spec.handoff_indices(40) == [*range(0, 16, 2), 16, 17, 18, 19]
    assert spec.handoff_indices(40, 36) == [18, 19]
    assert spec.handoff_indices(5) == [0, 1, 2, 3]

    prompt = list(range(40))
    prefill = hybrid(window=8)
    src = make_req(prompt, max_tokens=1)
    for chunk in (12, 12, 16):
        step(prefill, src, chunk)
    prefill.check_invariants()
    src_table = prefill.get_blocks(src.request_id)

    decode = hybrid(window=8)
    cached = make_req([*prompt[:16], 7, 7, 7, 7], max_tokens=1)
    admit(decode, cached)
    decode.free(cached)
    dst = make_req(prompt, max_tokens=5)
    hits, num_hit = decode.get_computed_blocks(dst)
    assert num_hit == 16
    assert decode.allocate_slots(dst, 0, 40, hits, delay_caching=True) is not None
    dst_table = decode.get_blocks(dst.request_id)
    indices = spec.handoff_indices(40, num_hit)
    assert indices == [8, 10, 12, 14, 16, 17, 18, 19]
    G = spec.num_groups
    for i in indices:
        assert src_table[i] is not NULL_BLOCK and dst_table[i] is not NULL_BLOCK, i
    # Not sent: the decode side's hits (full group, blocks 0..3) and null sliding entries.
    for i, block in enumerate(dst_table):
        if i not in indices:
            assert block is NULL_BLOCK or (i % G == 0 and i // G < 4), i
    # The landed KV registers at `cache_blocks` only.
    probe = make_req([*prompt, 1])
    assert decode.get_computed_blocks(probe)[1] == 16
    dst.num_computed_tokens = 40
    dst.append_output_token_ids([3])
    decode.cache_blocks(dst, 40)
    assert decode.get_computed_blocks(probe)[1] == 40
    for mgr, req in ((prefill, src), (decode, dst)):
        mgr.free(req)
        mgr.check_invariants()
        assert mgr.block_pool.is_whole
