"""What a request costs in a cache with a KV cache group per attention kind, counted once
(`KVCacheSpec.num_blocks_needed`) and used by every estimate: the blocks the hybrid manager
actually takes at each step (prefill chunks, decode growth, a KV hand-off's reservation),
the most a request ever holds, the engine scheduler's "can one request fit", and the service
scheduler's routing of a reservation to a decode worker."""

from __future__ import annotations

import itertools

import pytest

from tandem.config import CacheConfig, SchedulerConfig
from tandem.core.hybrid_kv_cache_manager import HybridKVCacheManager, build_kv_cache_manager
from tandem.core.kv_cache_spec import KVCacheSpec, cdiv
from tandem.core.outputs import ModelRunnerOutput
from tandem.core.scheduler import Scheduler
from tandem.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams
from tandem_protos.v1 import common_pb2, scheduler_pb2
from tandem_services.scheduler.routing import LoadBasedRouting, RoutingRequest, WorkerView
from tandem_services.scheduler.workers import worker_kv_cache_spec

BS = 4
_ids = itertools.count()
# Windows below, at, above and between multiples of the block; two sliding kinds at once.
LAYER_WINDOWS: list[list[int | None]] = [
    [3, None],
    [4, None],
    [5, None],
    [8, None],
    [9, None],
    [8, 6, None],
    [6, 6],  # sliding layers only
]


def make_req(num_tokens: int, max_tokens: int = 100) -> Request:
    return Request(f"b{next(_ids)}", list(range(num_tokens)), SamplingParams(max_tokens=max_tokens))


def run_request(
    mgr: HybridKVCacheManager, num_prompt: int, num_total: int, chunk: int
) -> list[tuple[int, int, int]]:
    """Compute a request of `num_prompt` prompt tokens in chunks of `chunk`, then decode it
    to `num_total` tokens; (computed, new, blocks held) after each allocation."""
    req = make_req(num_prompt)
    seen = []
    while req.num_computed_tokens < num_total:
        c = req.num_computed_tokens
        n = min(chunk, req.num_tokens - c)
        assert mgr.allocate_slots(req, n) is not None
        seen.append((c, n, mgr.num_held_blocks(req.request_id)))
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens and req.num_tokens < num_total:
            req.append_output_token_ids([7])
        mgr.check_invariants()
    mgr.free(req)
    assert mgr.block_pool.is_whole
    return seen


@pytest.mark.parametrize("windows", LAYER_WINDOWS, ids=str)
def test_estimate_equals_what_allocation_takes_at_every_step(windows: list[int | None]) -> None:
    spec = KVCacheSpec.from_layer_windows(BS, windows)
    mgr = build_kv_cache_manager(spec, 512, enable_caching=False)
    assert isinstance(mgr, HybridKVCacheManager)
    longest = 3 * BS + max(w or 0 for w in windows) + 2
    for chunk in (1, 3, 4, 7):
        for num_prompt in range(1, longest):
            num_total = num_prompt + BS + 2
            for c, n, held in run_request(mgr, num_prompt, num_total, chunk):
                assert held == spec.num_blocks_needed(c, n), (chunk, num_prompt, c, n)
                assert held <= spec.max_blocks_per_request(num_total, chunk)


@pytest.mark.parametrize("windows", LAYER_WINDOWS, ids=str)
def test_most_blocks_of_a_request_is_its_largest_step(windows: list[int | None]) -> None:
    """`max_blocks_per_request(T, n)` is the largest `num_blocks_needed` of any step of at
    most n tokens within T tokens: no more (capacity wasted) and no less (a request the
    scheduler admits would preempt itself)."""
    spec = KVCacheSpec.from_layer_windows(BS, windows)
    for num_tokens in range(1, 48):
        for n in (1, 2, 4, 5, 16, 64):
            largest = max(
                spec.num_blocks_needed(c, k)
                for k in range(1, n + 1)
                for c in range(num_tokens - k + 1)
            )
            assert spec.max_blocks_per_request(num_tokens, n) == largest, (num_tokens, n)
    # Decoding at Gemma 3's window (1024, blocks of 16): cdiv(1023, 16) + 1 = 65 per group.
    gemma = KVCacheSpec.from_layer_windows(16, [1024] * 5 + [None])
    assert gemma.max_blocks_per_request(8192) == 512 + 5 * 65
    # A prefill chunk of 2048 at the window's end: cdiv(1024 + 2048 - 2, 16) + 1 = 193.
    assert gemma.max_blocks_per_request(8192, 2048) == 512 + 5 * 193


def test_engine_scheduler_fits_a_request_of_max_model_len_exactly() -> None:
    """The pool check at start-up: a pool of exactly the estimate runs a request of
    max_model_len to completion without preemption; one block fewer is refused at once."""
    spec = KVCacheSpec.from_layer_windows(BS, [5, 5, None])
    max_model_len, budget = 40, 8
    need = spec.max_blocks_per_request(max_model_len, budget)
    assert need == 10 + 2 * (cdiv(5 + 8 - 2, BS) + 1)

    def scheduler(num_blocks: int) -> Scheduler:
        return Scheduler(
            SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=2),
            CacheConfig(block_size=BS),
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            kv_cache_spec=spec,
        )

    with pytest.raises(ValueError, match="cannot hold one request of max_model_len 40"):
        scheduler(need - 1)
    sched = scheduler(need)
    kv = sched.kv_cache_manager
    # Prompts ending at each offset in a block: the chunk starts differ.
    for num_prompt in (17, 18, 19, 20, 21):
        req = make_req(num_prompt, max_tokens=max_model_len)
        sched.add_request(req)
        peak = 0
        while sched.has_unfinished_requests():
            so = sched.schedule()
            peak = max(peak, kv.num_blocks - kv.num_free_blocks)
            ids = list(so.num_scheduled_tokens)
            done = [sched.requests[r] for r in ids]
            sampled = [[7] if r.num_computed_tokens >= r.num_tokens else [] for r in done]
            sched.update_from_output(
                so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, logprobs=[])
            )
            kv.check_invariants()
        assert len(req.all_token_ids) == max_model_len
        assert peak <= need
        assert kv.block_pool.is_whole
    assert sched.num_preemptions == 0


@pytest.mark.parametrize("windows", [[8, None], [5, 5, None]], ids=str)
def test_reservation_takes_the_estimate_and_its_first_token_the_routing_estimate(
    windows: list[int | None],
) -> None:
    """A KV hand-off's reservation on the decode side takes `num_blocks_needed(P, 0)`; its
    first decode step `num_blocks_needed(P, 1)`, which the service scheduler routes on. A
    pool one block short refuses the reservation and is left as it was."""
    spec = KVCacheSpec.from_layer_windows(BS, windows)
    for num_prompt in range(1, 30):
        reserve = spec.num_blocks_needed(num_prompt, 0)
        routed = RoutingRequest("r", list(range(num_prompt)), 0).blocks_needed(spec)
        assert routed == spec.num_blocks_needed(num_prompt, 1)
        for num_blocks in (reserve - 1, routed):
            sched = Scheduler(
                SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=2),
                CacheConfig(block_size=BS, enable_prefix_caching=False),
                num_blocks=num_blocks,
                max_model_len=0,
                kv_cache_spec=spec,
            )
            kv = sched.kv_cache_manager
            req = make_req(num_prompt, max_tokens=5)
            if num_blocks < reserve:
                assert sched.reserve(req) is None
                assert kv.num_free_blocks == num_blocks and kv.block_pool.is_whole
                continue
            reserved = sched.reserve(req)
            assert reserved is not None
            assert kv.num_held_blocks(req.request_id) == reserve
            assert kv.num_free_blocks == routed - reserve
            assert sched.add_prefilled(req.request_id, 7) is None
            so = sched.schedule()
            assert so.num_scheduled_tokens == {req.request_id: 1} and not so.preempted_req_ids
            assert kv.num_held_blocks(req.request_id) == routed
            sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
            kv.check_invariants()
            assert kv.block_pool.is_whole


def test_worker_registration_carries_the_groups_the_scheduler_counts_with() -> None:
    spec = KVCacheSpec.from_layer_windows(BS, [8] * 5 + [None])
    info = scheduler_pb2.RegisterWorkerRequest(
        block_size=BS, kv_cache_group_windows=[w or 0 for w in spec.group_windows]
    )
    seen = worker_kv_cache_spec(info)
    assert seen.group_windows == spec.group_windows
    for c, n in itertools.product(range(40), (0, 1, 5)):
        assert seen.num_blocks_needed(c, n) == spec.num_blocks_needed(c, n)
    # A worker that names no groups has the plain cache.
    plain = worker_kv_cache_spec(scheduler_pb2.RegisterWorkerRequest(block_size=16))
    assert plain.is_plain and plain.num_blocks_needed(40, 1) == 3


def test_a_burst_of_reservations_each_lands_first_time() -> None:
    """The service scheduler routes a burst of hand-offs between two decode workers' load
    reports, counting what it reserved there since. Counting one group's blocks (the old
    estimate, cdiv(P + 1, block_size)) sends the third to a worker whose pool is short:
    refused ("pool short"), requeued and retried. Counting every group, it goes to the worker
    where it fits and is reserved first time; a fourth fits nowhere and stays queued."""
    spec = KVCacheSpec.from_layer_windows(BS, [8, None])
    prompt = 21  # 6 blocks in the full group, 3 in the sliding one (keys from 21 - 8 + 1)
    assert spec.num_blocks_needed(prompt, 1) == 9

    def decode_pool(num_blocks: int) -> Scheduler:
        return Scheduler(
            SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),
            CacheConfig(block_size=BS),
            num_blocks=num_blocks,
            max_model_len=0,
            kv_cache_spec=spec,
        )

    def burst(view_spec: KVCacheSpec) -> list[tuple[str, bool] | None]:
        pools = {"a": decode_pool(24), "b": decode_pool(11)}
        reported = {wid: pool.kv_cache_manager.num_free_blocks for wid, pool in pools.items()}
        reserved_since = dict.fromkeys(pools, 0)
        inflight = dict.fromkeys(pools, 0)
        policy = LoadBasedRouting(max_inflight_per_worker=8, max_inflight_prefills=8)
        outcome: list[tuple[str, bool] | None] = []
        reqs = []
        for _ in range(4):
            routing_req = RoutingRequest("r", list(range(prompt)), 0)
            views = [
                WorkerView("p", common_pb2.WORKER_ROLE_PREFILL, 0, 0, 100, 100, 0, BS, 1 << 20)
            ]
            views += [
                WorkerView(
                    wid,
                    common_pb2.WORKER_ROLE_DECODE,
                    0,
                    0,
                    max(reported[wid] - reserved_since[wid], 0),
                    pools[wid].kv_cache_manager.num_blocks,
                    inflight[wid],
                    BS,
                    1 << 20,
                    kv_cache_spec=view_spec,
                )
                for wid in pools
            ]
            route = policy.route(routing_req, views)
            if route is None:
                outcome.append(None)
                continue
            wid = route.decode_worker_id
            assert wid is not None
            reserved_since[wid] += routing_req.blocks_needed(view_spec)
            inflight[wid] += 1
            req = make_req(prompt)
            ok = pools[wid].reserve(req) is not None
            outcome.append((wid, ok))
            if ok:
                reqs.append((pools[wid], req))
        for pool, req in reqs:
            assert pool.cancel_reservation(req.request_id)
        for pool in pools.values():
            pool.kv_cache_manager.check_invariants()
            assert pool.kv_cache_manager.block_pool.is_whole
        return outcome

    one_group = burst(KVCacheSpec.full(BS, 1))  # what the scheduler assumed of every worker
    assert one_group[:3] == [("a", True), ("a", True), ("a", False)]
    every_group = burst(spec)
    assert every_group == [("a", True), ("a", True), ("b", True), None]
