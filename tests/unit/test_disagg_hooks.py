"""Scheduler hooks for disaggregated prefill/decode: held prefills and reservations."""

from __future__ import annotations

from tandem.config import CacheConfig, SchedulerConfig
from tandem.core.outputs import ModelRunnerOutput
from tandem.core.scheduler import Scheduler
from tandem.request import Request
from tandem.sampling_params import SamplingParams


def make_scheduler(num_blocks: int = 16, max_model_len: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        CacheConfig(block_size=4),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
    )


def run_step(sched: Scheduler, token: int):
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    runner = ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[token] for _ in ids])
    return out, sched.update_from_output(out, runner)


def test_hold_kv_keeps_blocks_until_released() -> None:
    sched = make_scheduler()
    req = Request("p", list(range(10)), SamplingParams(max_tokens=1))
    req.hold_kv = True
    sched.add_request(req)
    _, outputs = run_step(sched, 7)
    assert outputs[0].finish_reason == "length" and outputs[0].new_token_ids == [7]
    # 10 prompt tokens + the sampled one's slot: 3 blocks of 4 stay allocated.
    assert sched.kv_cache_manager.get_block_ids("p") == [0, 1, 2]
    assert sched.kv_cache_manager.num_free_blocks == 13
    assert "p" in sched.held and not sched.has_unfinished_requests()
    assert sched.release_held("p")
    assert not sched.release_held("p")
    assert sched.kv_cache_manager.block_pool.is_whole


def test_reserve_then_add_prefilled_decodes_from_the_prompt_end() -> None:
    sched = make_scheduler()
    req = Request("d", list(range(100, 110)), SamplingParams(max_tokens=3))
    reserved = sched.reserve(req)
    assert reserved is not None
    block_ids, num_cached = reserved
    assert block_ids == [0, 1, 2] and num_cached == 0
    # Reserved blocks are not in the prefix index before their KV lands.
    assert not sched.kv_cache_manager.block_pool.cached_block_hash_to_block
    assert sched.add_prefilled("d", 42) is None
    assert len(sched.kv_cache_manager.block_pool.cached_block_hash_to_block) == 2
    out, outputs = run_step(sched, 43)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["d"]
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 10 and new.output_token_ids == [42]
    assert out.num_scheduled_tokens == {"d": 1}
    assert outputs[0].new_token_ids == [43]
    _, outputs = run_step(sched, 44)
    assert outputs[0].finish_reason == "length"
    assert sched.kv_cache_manager.block_pool.is_whole


def test_reservation_reuses_local_prefix_and_cancels_cleanly() -> None:
    sched = make_scheduler()
    first = Request("a", list(range(12)), SamplingParams(max_tokens=1))
    sched.add_request(first)
    run_step(sched, 1)
    second = Request("b", [*range(12), 50, 51], SamplingParams(max_tokens=2))
    block_ids, num_cached = sched.reserve(second)
    assert num_cached == 12 and len(block_ids) == 4
    assert sched.cancel_reservation("b")
    assert sched.kv_cache_manager.block_pool.is_whole


def test_reserve_returns_none_when_short_and_first_token_can_finish() -> None:
    sched = make_scheduler(num_blocks=4, max_model_len=16)
    holder = Request("h", list(range(9)), SamplingParams(max_tokens=1))
    holder.hold_kv = True
    sched.add_request(holder)
    run_step(sched, 1)
    big = Request("big", list(range(20, 30)), SamplingParams(max_tokens=2))
    assert sched.reserve(big) is None
    sched.release_held("h")
    assert sched.kv_cache_manager.block_pool.is_whole
    eos = Request("e", [1, 2, 3], SamplingParams(max_tokens=5), eos_token_id=9)
    assert sched.reserve(eos) is not None
    out = sched.add_prefilled("e", 9)
    assert out is not None and out.finish_reason == "stop"
    assert sched.kv_cache_manager.block_pool.is_whole
