"""Async scheduling: step N+1 is planned and launched before step N's tokens are applied.

Scheduler level: placeholders count tokens in flight, planning stops at a length a request is
sure to stop at, a request preempted while its token is in flight still gets that token, and
the extra step of a request that stopped is dropped. Engine level (tiny random Llama on the
CPU, async forced on): the same tokens as the synchronous engine for greedy, seeded, penalised,
min_tokens, logprobs and n > 1 requests under forced preemption; stop tokens stop at the same
place; an abort while a step is in flight leaves the pool whole.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.config import CacheConfig, SchedulerConfig
from tandem.core.outputs import ModelRunnerOutput, SchedulerOutput
from tandem.core.scheduler import Scheduler
from tandem.request import EngineCoreRequest, Request, RequestStatus


def make_sched(num_blocks: int = 16, block_size: int = 4, budget: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8),
        CacheConfig(block_size=block_size),
        num_blocks,
        num_blocks * block_size,
    )


def req(rid: str, n: int, max_tokens: int = 8) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first = 10 + 100 * (ord(rid[0]) - ord("a"))  # distinct prompts: no prefix hits
    return Request(rid, list(range(first, first + n)), params)


def sampled_for(out: SchedulerOutput, tokens: dict[str, int]) -> ModelRunnerOutput:
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(ids, [[tokens[r]] if r in tokens else [] for r in ids])


def test_two_steps_planned_before_the_first_lands() -> None:
    sched = make_sched()
    sched.add_request(req("a", 6, max_tokens=3))
    s1 = sched.schedule()  # prefill, samples token 0
    a = sched.requests["a"]
    assert s1.num_scheduled_tokens == {"a": 6} and a.num_output_placeholders == 1
    s2 = sched.schedule()  # decodes the token s1 samples, before it is known
    assert s2.num_scheduled_tokens == {"a": 1}
    assert a.num_output_placeholders == 2 and a.num_computed_tokens == 7
    # Output 0 and 1 in flight, max_tokens 3: one more step may be planned, then none.
    sched.update_from_output(s1, sampled_for(s1, {"a": 100}))
    assert a.output_token_ids == [100] and a.num_output_placeholders == 1
    s3 = sched.schedule()
    assert s3.num_scheduled_tokens == {"a": 1} and a.num_output_placeholders == 2
    assert sched.schedule().is_empty  # 1 output + 2 in flight = max_tokens: wait
    out2 = sched.update_from_output(s2, sampled_for(s2, {"a": 101}))
    assert out2[0].new_token_ids == [101] and not out2[0].finished
    out3 = sched.update_from_output(s3, sampled_for(s3, {"a": 102}))
    assert out3[0].finish_reason == "length" and a.output_token_ids == [100, 101, 102]
    assert sched.kv_cache_manager.block_pool.is_whole


def test_extra_step_of_a_stopped_request_is_dropped() -> None:
    sched = make_sched()
    r = req("a", 4, max_tokens=8)
    r.sampling_params.stop_token_ids.append(555)
    sched.add_request(r)
    s1 = sched.schedule()
    s2 = sched.schedule()
    outs = sched.update_from_output(s1, sampled_for(s1, {"a": 555}))
    assert outs[0].finish_reason == "stop" and outs[0].new_token_ids == [555]
    assert sched.kv_cache_manager.block_pool.is_whole  # freed while s2 is "in flight"
    assert sched.update_from_output(s2, sampled_for(s2, {"a": 7})) == []
    assert "a" in sched.schedule().finished_req_ids or not sched.has_unfinished_requests()


def test_request_preempted_with_a_token_in_flight_keeps_it() -> None:
    # 5 blocks of 4 tokens: the prompts (8 tokens each) take 4; one decode block is left.
    sched = make_sched(num_blocks=5, block_size=4)
    sched.add_request(req("a", 8, max_tokens=8))
    sched.add_request(req("b", 8, max_tokens=8))
    s1 = sched.schedule()  # both prefill (4 blocks), both sample
    assert set(s1.num_scheduled_tokens) == {"a", "b"}
    s2 = sched.schedule()  # each needs a 3rd block, only 1 is free: b is preempted
    assert s2.preempted_req_ids == {"b"}
    b = sched.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 1
    outs = sched.update_from_output(s1, sampled_for(s1, {"a": 40, "b": 41}))
    assert {o.request_id: o.new_token_ids for o in outs} == {"a": [40], "b": [41]}
    assert b.output_token_ids == [41] and b.num_output_placeholders == 0
    sched.update_from_output(s2, sampled_for(s2, {"a": 42}))
    sched.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.block_pool.is_whole


# ---- engine level ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_path) -> Path:
    return tiny_model_path("llama")


def mixed_workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 60))] for _ in range(12)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 40), ignore_eos=i % 2 == 0)
        for i in range(6)
    ]
    params += [SamplingParams(temperature=0.8, seed=i, max_tokens=30, top_k=20) for i in range(3)]
    params.append(
        SamplingParams(
            temperature=0.7, seed=7, max_tokens=25, repetition_penalty=1.3, presence_penalty=0.5
        )
    )
    params.append(SamplingParams(temperature=0.0, max_tokens=25, min_tokens=10, logprobs=2))
    params.append(SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=20))
    return prompts, params


def make_llm(path: Path, mode: str, **kwargs: object) -> LLM:
    defaults: dict[str, object] = dict(
        device="cpu",
        dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_gpu_blocks=24,
        max_model_len=200,
    )
    defaults.update(kwargs)
    return LLM(model=str(path), async_scheduling=mode, **defaults)


def assert_pool_whole(llm: LLM) -> None:
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.is_whole
    assert not llm.engine.has_unfinished_requests()


def test_async_engine_gives_the_sync_engines_tokens(tiny_llama: Path) -> None:
    results = {}
    for mode in ("off", "on", "late"):
        llm = make_llm(tiny_llama, mode)
        assert llm.engine.async_scheduling == (mode != "off")
        assert (llm.engine.step_clock is not None) == (mode == "late")
        prompts, params = mixed_workload(llm.engine.vocab_size)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.stats().num_preemptions > 0, "the small pool was meant to preempt"
        assert_pool_whole(llm)
        results[mode] = outs
    for late, on in zip(results["late"], results["on"], strict=True):
        assert [(c.token_ids, c.finish_reason) for c in late.outputs] == [
            (c.token_ids, c.finish_reason) for c in on.outputs
        ]
    for on, off in zip(results["on"], results["off"], strict=True):
        assert [(c.token_ids, c.finish_reason) for c in on.outputs] == [
            (c.token_ids, c.finish_reason) for c in off.outputs
        ]
        for c_on, c_off in zip(on.outputs, off.outputs, strict=True):
            if c_off.logprobs is None:
                assert c_on.logprobs is None
                continue
            # Same tokens and ranks; values within float noise of a different batch shape.
            for lp_on, lp_off in zip(c_on.logprobs, c_off.logprobs, strict=True):
                assert lp_on.keys() == lp_off.keys()
                for tok, lp in lp_off.items():
                    assert lp_on[tok].rank == lp.rank
                    assert abs(lp_on[tok].logprob - lp.logprob) < 1e-4


def test_async_stop_token_stops_at_the_same_place(tiny_llama: Path) -> None:
    prompt = list(range(5, 30))
    base = make_llm(tiny_llama, "off").generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0]
    stop_at = base.outputs[0].token_ids[6]
    expected = base.outputs[0].token_ids[: base.outputs[0].token_ids.index(stop_at) + 1]
    llm = make_llm(tiny_llama, "on")
    params = SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at]
    )
    out = llm.generate([prompt, prompt[:10]], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected and out.outputs[0].finish_reason == "stop"
    assert_pool_whole(llm)


def test_abort_while_a_step_is_in_flight(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama, "on")
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i in range(3):
        engine.add_request(
            EngineCoreRequest(
                request_id=f"r{i}", prompt_token_ids=[7 + i] * 20, sampling_params=params
            )
        )
    seen: dict[str, list[int]] = {}
    assert engine.step() == []  # launched, nothing applied yet
    for o in engine.step():
        seen.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert engine._pending is not None
    engine.abort_requests(["r1"])
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert len(seen["r0"]) == 50 and len(seen["r2"]) == 50
    assert len(seen.get("r1", [])) <= 1  # at most the token of the step applied before the abort
    assert engine.step() == [] and engine.last_step_idle
    assert_pool_whole(llm)


def test_async_scheduling_flag_reaches_the_engine_config() -> None:
    import argparse

    from tandem.config import ConfigError, SchedulerConfig, add_engine_args, engine_kwargs_from
    from tandem.engine_args import EngineArgs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for flag, expected in ((None, "auto"), ("off", "off"), ("on", "on"), ("late", "late")):
        argv = [] if flag is None else ["--async-scheduling", flag]
        ns = parser.parse_args(argv)
        config = EngineArgs(**engine_kwargs_from(ns)).create_engine_config()  # type: ignore[arg-type]
        assert config.scheduler.async_scheduling == expected
    with pytest.raises(SystemExit):
        parser.parse_args(["--async-scheduling", "sometimes"])
    with pytest.raises(ConfigError, match="async_scheduling"):
        SchedulerConfig(async_scheduling="sometimes")  # type: ignore[arg-type]


def test_runner_forgets_requests_finished_before_an_empty_step(tiny_llama: Path) -> None:
    """A request that stops while every other one waits on its in-flight token meets a step
    that schedules nothing: the runner must still drop its state."""
    llm = make_llm(tiny_llama, "on")
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (5, 6)]
    llm.generate([[5, 6, 7], [8, 9, 10]], params, use_tqdm=False)
    llm.generate([[11, 12, 13]], params[0], use_tqdm=False)
    batch = llm.engine.model_runner.input_batch
    # Only the last batch's request may still be held (its finish reaches the runner with
    # the next step); none of the first batch's.
    assert set(batch.requests) <= {"2"}
    assert len(batch.free_rows) + len(batch.requests) == batch.block_table_rows.shape[0]
    assert_pool_whole(llm)


def test_concurrent_batches_hold_disjoint_requests() -> None:
    """Pipeline parallel (`max_concurrent_batches` 2): a step takes only requests whose token
    is not in flight and at most half the running ones, so consecutive steps alternate between
    two disjoint halves; each request's tokens still come out in order."""
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        CacheConfig(block_size=4),
        32,
        128,
        max_concurrent_batches=2,
    )
    for rid in "abcd":
        sched.add_request(req(rid, 4, max_tokens=4))
    s1 = sched.schedule()  # all four prefills (none was running)
    assert set(s1.num_scheduled_tokens) == set("abcd")
    assert sched.schedule().is_empty  # every token in flight: nothing to plan
    sched.update_from_output(s1, sampled_for(s1, dict.fromkeys("abcd", 1)))
    s2 = sched.schedule()
    s3 = sched.schedule()
    first, second = set(s2.num_scheduled_tokens), set(s3.num_scheduled_tokens)
    assert len(first) == 2 and len(second) == 2 and first.isdisjoint(second)
    assert sched.schedule().is_empty
    sched.update_from_output(s2, sampled_for(s2, dict.fromkeys(first, 2)))
    s4 = sched.schedule()  # the first half again, while the second is in flight
    assert set(s4.num_scheduled_tokens) == first
    sched.update_from_output(s3, sampled_for(s3, dict.fromkeys(second, 2)))
    sched.update_from_output(s4, sampled_for(s4, dict.fromkeys(first, 3)))
    assert all(sched.requests[r].output_token_ids == [1, 2, 3] for r in first)
    assert all(sched.requests[r].output_token_ids == [1, 2] for r in second)
    # One step in flight at a time (the default) plans every running request again.
    plain = make_sched()
    for rid in "ab":
        plain.add_request(req(rid, 4))
    p1 = plain.schedule()
    assert set(plain.schedule().num_scheduled_tokens) == set(p1.num_scheduled_tokens)


def test_concurrent_batches_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_concurrent_batches"):
        Scheduler(SchedulerConfig(), CacheConfig(), 16, 64, max_concurrent_batches=0)
