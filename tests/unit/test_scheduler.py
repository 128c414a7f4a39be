"""Scheduler: token budget, chunked prefill, preemption, prefix hits, policies, stop rules.

`Runner` plays the model runner without a model: it mirrors each request's block table from
the scheduler's messages only, writes every scheduled token id into its slot before any read
(as the attention backend writes a step's KV before attending), checks that each scheduled
request's whole context sits in its slots, and samples tokens chosen by the test.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import pytest

from tandem.config import CacheConfig, SchedulerConfig
from tandem.core.outputs import (
    EngineCoreOutput,
    Logprobs,
    ModelRunnerOutput,
    SchedulerOutput,
)
from tandem.core.scheduler import Scheduler, SchedulerStats
from tandem.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams

EOS = 2
_made: list[Scheduler] = []


@pytest.fixture(autouse=True)
def pools_are_whole_after_each_test() -> Iterator[None]:
    _made.clear()
    yield
    for sched in _made:
        assert not sched.has_unfinished_requests()
        sched.kv_cache_manager.check_invariants()
        assert sched.kv_cache_manager.block_pool.is_whole


def make_sched(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    max_num_seqs: int = 16,
    policy: str = "fcfs",
    chunked: bool = True,
    caching: bool = True,
    max_model_len: int | None = None,
    long_prefill: int = 0,
) -> Scheduler:
    if max_model_len is None:
        max_model_len = min(256, num_blocks * block_size)
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            policy=policy,  # type: ignore[arg-type]
            enable_chunked_prefill=chunked,
            long_prefill_token_threshold=long_prefill,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks,
        max_model_len,
    )
    _made.append(sched)
    return sched


def make_req(
    rid: str,
    prompt: list[int],
    *,
    eos: int | None = EOS,
    priority: int = 0,
    arrival: float = 0.0,
    **params: object,
) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(
        rid,
        prompt,
        SamplingParams(**params),  # type: ignore[arg-type]
        eos_token_id=eos,
        arrival_time=arrival,
        priority=priority,
    )


def prompt(n: int, start: int = 10) -> list[int]:
    return list(range(start, start + n))


class Runner:
    def __init__(self, sched: Scheduler, script: dict[str, list[int]] | None = None) -> None:
        self.sched = sched
        self.block_size = sched.kv_cache_manager.block_size
        self.tables: dict[str, list[int]] = {}
        self.slots: dict[int, int] = {}
        self.script = {k: list(v) for k, v in (script or {}).items()}
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finish: dict[str, EngineCoreOutput] = {}

    def _slot(self, req_id: str, pos: int) -> int:
        return self.tables[req_id][pos // self.block_size] * self.block_size + pos % self.block_size

    def next_token(self, req: Request) -> int:
        queue = self.script.get(req.request_id)
        return queue.pop(0) if queue else 1000 + req.num_output_tokens

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        sched = self.sched
        out = sched.schedule()
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.tables.pop(rid, None)
        starts: dict[str, int] = {}
        for nr in out.scheduled_new_reqs:
            assert nr.req_id not in self.tables
            self.tables[nr.req_id] = list(nr.block_ids)
            starts[nr.req_id] = nr.num_computed_tokens
            req = sched.requests[nr.req_id]
            assert nr.prompt_token_ids == req.prompt_token_ids
            assert nr.output_token_ids == req.output_token_ids
        for cr in out.scheduled_cached_reqs:
            self.tables[cr.req_id].extend(cr.new_block_ids)
            starts[cr.req_id] = cr.num_computed_tokens
        assert set(starts) == set(out.num_scheduled_tokens)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= sched.scheduler_config.max_num_batched_tokens
        # Write the step's tokens first, then check every read.
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            assert self.tables[rid] == sched.kv_cache_manager.get_block_ids(rid)
            assert starts[rid] + n == req.num_computed_tokens <= req.num_tokens
            assert req.num_computed_tokens <= sched.max_model_len
            for pos in range(starts[rid], starts[rid] + n):
                self.slots[self._slot(rid, pos)] = req.all_token_ids[pos]
        req_ids, sampled = [], []
        for rid in out.num_scheduled_tokens:
            req = sched.requests[rid]
            for pos in range(req.num_computed_tokens):
                assert self.slots.get(self._slot(rid, pos)) == req.all_token_ids[pos], (rid, pos)
            req_ids.append(rid)
            done = req.num_computed_tokens == req.num_tokens
            sampled.append([self.next_token(req)] if done else [])
        outputs = sched.update_from_output(out, ModelRunnerOutput(req_ids, sampled))
        for o in outputs:
            assert o.request_id not in self.finish
            self.tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                self.finish[o.request_id] = o
        sched.kv_cache_manager.check_invariants()
        return out, outputs

    def run(self, max_steps: int = 200) -> list[SchedulerOutput]:
        steps = []
        while self.sched.has_unfinished_requests():
            steps.append(self.step()[0])
            assert len(steps) <= max_steps, "no progress"
        return steps


def cached(out: SchedulerOutput) -> dict[str, list[int]]:
    return {c.req_id: c.new_block_ids for c in out.scheduled_cached_reqs}


def new(out: SchedulerOutput) -> dict[str, tuple[list[int], int]]:
    return {n.req_id: (n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_reqs}


# ---- token budget and chunked prefill ------------------------------------------------------


def test_chunked_prefill_splits_exactly_on_the_budget() -> None:
    sched = make_sched(budget=8)
    sched.add_request(make_req("a", prompt(20), max_tokens=3))
    run = Runner(sched)
    out, outs = run.step()
    assert out.num_scheduled_tokens == {"a": 8} and new(out) == {"a": ([0, 1], 0)} and outs == []
    out, outs = run.step()
    assert out.num_scheduled_tokens == {"a": 8} and cached(out) == {"a": [2, 3]} and outs == []
    assert out.scheduled_cached_reqs[0].num_computed_tokens == 8
    out, outs = run.step()
    assert out.num_scheduled_tokens == {"a": 4} and cached(out) == {"a": [4]}
    assert [o.new_token_ids for o in outs] == [[1000]]
    out, _ = run.step()  # position 20 opens block 5
    assert out.num_scheduled_tokens == {"a": 1} and cached(out) == {"a": [5]}
    out, outs = run.step()
    assert out.num_scheduled_tokens == {"a": 1} and cached(out) == {"a": []}
    assert outs[0].finish_reason == "length" and run.tokens["a"] == [1000, 1001, 1002]
    out = sched.schedule()
    assert out.is_empty and out.finished_req_ids == {"a"}


def test_mixed_step_runs_decodes_first_then_a_prefill_chunk() -> None:
    sched = make_sched(budget=8)
    sched.add_request(make_req("a", prompt(4), max_tokens=10))
    run = Runner(sched)
    run.step()
    sched.add_request(make_req("b", prompt(12, start=50), max_tokens=1))
    out, outs = run.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    assert list(cached(out)) == ["a"] and list(new(out)) == ["b"]
    assert [o.request_id for o in outs] == ["a"]  # b's partial chunk samples nothing
    out, outs = run.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 5}
    assert {o.request_id: o.finish_reason for o in outs} == {"a": None, "b": "length"}
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert sched.schedule().finished_req_ids == {"a", "b"}


def test_waiting_requests_share_the_rest_of_the_budget_in_order() -> None:
    sched = make_sched(budget=10)
    for rid in "abc":
        sched.add_request(make_req(rid, prompt(6, start=ord(rid) * 10), max_tokens=2))
    run = Runner(sched)
    out, _ = run.step()
    assert out.num_scheduled_tokens == {"a": 6, "b": 4}
    out, _ = run.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 2, "c": 6}
    run.run()
    assert run.tokens == {"a": [1000, 1001], "b": [1000, 1001], "c": [1000, 1001]}


def test_a_long_prompt_takes_at_most_its_threshold_of_a_step() -> None:
    """With long_prefill_token_threshold, a long prompt admitted first leaves the rest of each
    step's budget to the short requests behind it; without it, it takes the whole step."""
    for threshold, first_step in ((0, {"long": 32}), (8, {"long": 8, "s1": 4, "s2": 4})):
        sched = make_sched(budget=32, long_prefill=threshold, num_blocks=128)
        sched.add_request(make_req("long", prompt(100), max_tokens=2))
        sched.add_request(make_req("s1", prompt(4, start=300), max_tokens=2))
        sched.add_request(make_req("s2", prompt(4, start=400), max_tokens=2))
        run = Runner(sched)
        out, _ = run.step()
        assert out.num_scheduled_tokens == first_step
        steps = [out, *run.run()]
        assert all(s.num_scheduled_tokens.get("long", 0) <= (threshold or 32) for s in steps)
        assert sum(s.num_scheduled_tokens.get("long", 0) for s in steps) == 101
        assert run.tokens["s1"] == run.tokens["s2"] == [1000, 1001]
    if threshold:
        # The short ones decode next to the long prompt's capped chunks.
        assert steps[1].num_scheduled_tokens == {"long": 8, "s1": 1, "s2": 1}


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits() -> None:
    sched = make_sched(budget=10, chunked=False, caching=False)
    sched.add_request(make_req("a", prompt(6), max_tokens=2))
    sched.add_request(make_req("b", prompt(6, start=40), max_tokens=2))
    sched.add_request(make_req("c", prompt(2, start=80), max_tokens=2))
    run = Runner(sched)
    out, _ = run.step()
    assert out.num_scheduled_tokens == {"a": 6}  # b waits; c keeps its place behind b
    out, _ = run.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 6, "c": 2}
    run.run()


def test_max_num_seqs_caps_the_running_set() -> None:
    sched = make_sched(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_req(rid, prompt(4, start=ord(rid) * 10), max_tokens=2))
    run = Runner(sched)
    out, _ = run.step()
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    out, outs = run.step()
    assert list(out.num_scheduled_tokens) == ["a", "b"] and all(o.finished for o in outs)
    out, _ = run.step()
    assert list(out.num_scheduled_tokens) == ["c"] and out.finished_req_ids == {"a", "b"}
    run.run()


@pytest.mark.parametrize(
    ("policy", "expected"), [("fcfs", ["a", "b", "c"]), ("priority", ["b", "c", "a"])]
)
def test_admission_order_fcfs_vs_priority(policy: str, expected: list[str]) -> None:
    sched = make_sched(max_num_seqs=1, policy=policy)
    for rid, prio, t in (("a", 2, 0.0), ("b", 0, 1.0), ("c", 1, 2.0)):
        sched.add_request(make_req(rid, prompt(3, start=10 * prio), priority=prio, arrival=t))
    run = Runner(sched)
    order = [n.req_id for out in run.run() for n in out.scheduled_new_reqs]
    assert order == expected


# ---- preemption ----------------------------------------------------------------------------


def test_preemption_recomputes_the_last_admitted_and_all_complete() -> None:
    sched = make_sched(num_blocks=4, block_size=4)
    sched.add_request(make_req("a", prompt(6), ignore_eos=True))
    sched.add_request(make_req("b", prompt(6, start=40), ignore_eos=True))
    run = Runner(sched)
    out, _ = run.step()
    assert new(out) == {"a": ([0, 1], 0), "b": ([2, 3], 0)}
    run.step()
    run.step()  # both have 8 tokens computed: every block is full
    out, _ = run.step()  # a's position 8 needs a block: b (last admitted) is preempted
    b = sched.requests["b"]
    assert out.preempted_req_ids == {"b"} and out.num_scheduled_tokens == {"a": 1}
    assert cached(out) == {"a": [3]}  # b freed tail first: its last block goes first
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and b.output_token_ids == [1000, 1001, 1002]
    steps = run.run()
    resumed = [n for s in steps for n in s.scheduled_new_reqs if n.req_id == "b"]
    assert len(resumed) == 1 and resumed[0].output_token_ids == [1000, 1001, 1002]
    assert run.tokens == {"a": list(range(1000, 1008)), "b": list(range(1000, 1008))}
    assert sched.stats().num_preemptions == 1


def test_priority_preempts_a_request_already_scheduled_this_step() -> None:
    sched = make_sched(num_blocks=4, block_size=4, policy="priority")
    sched.add_request(make_req("a", prompt(7), priority=5, arrival=0.0, max_tokens=4))
    run = Runner(sched)
    run.step()  # a: blocks 0 1
    sched.add_request(make_req("b", prompt(4, start=60), priority=0, arrival=1.0, max_tokens=3))
    out, _ = run.step()
    assert new(out) == {"b": ([2], 0)} and out.num_scheduled_tokens == {"a": 1, "b": 4}
    # a's position 8 takes block 3; b's position 4 then finds none: a (worst priority) is
    # preempted although scheduled earlier in this step, and its tokens go back to b.
    out, _ = run.step()
    assert out.preempted_req_ids == {"a"} and out.num_scheduled_tokens == {"b": 1}
    assert cached(out) == {"b": [3]} and out.total_num_scheduled_tokens == 1
    out, outs = run.step()  # a waits: its 2 hit blocks + 1 new need 3 blocks, 2 are free
    assert out.num_scheduled_tokens == {"b": 1} and outs[0].finish_reason == "length"
    out, _ = run.step()  # a resumes from its own cached blocks
    assert new(out) == {"a": ([0, 1, 3], 8)}  # b's blocks were freed tail first: 3, then 2
    assert out.num_scheduled_tokens == {"a": 1}
    run.run()
    assert run.tokens["a"] == list(range(1000, 1004))


# ---- prefix caching ------------------------------------------------------------------------


def test_prefix_hit_starts_computing_at_the_hit_never_the_whole_prompt() -> None:
    sched = make_sched(block_size=4)
    sched.add_request(make_req("a", prompt(10), max_tokens=1))
    run = Runner(sched)
    run.run()
    sched.add_request(make_req("b", [*prompt(8), 90, 91, 92], max_tokens=1))
    out, outs = run.step()
    assert new(out) == {"b": ([0, 1, 3], 8)} and out.num_scheduled_tokens == {"b": 3}
    assert outs[0].num_cached_tokens == 8 and sched.requests.get("b") is None
    # A prompt made of exactly two cached blocks: one block hits, its last 4 tokens run.
    sched.add_request(make_req("c", prompt(8), max_tokens=1))
    out, outs = run.step()
    assert new(out)["c"][1] == 4 and out.num_scheduled_tokens == {"c": 4}
    assert outs[0].num_cached_tokens == 4
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10 + 11 + 8, 12)


def test_requests_sharing_a_prefix_in_the_same_step_hit_each_other() -> None:
    sched = make_sched(block_size=4)
    shared = prompt(12)
    for i, rid in enumerate("abc"):
        sched.add_request(make_req(rid, [*shared, 70 + i, 80 + i], max_tokens=2))
    run = Runner(sched)
    out, outs = run.step()  # the runner checks b and c read a's KV written this same step
    assert new(out) == {
        "a": ([0, 1, 2, 3], 0),
        "b": ([0, 1, 2, 4], 12),
        "c": ([0, 1, 2, 5], 12),
    }
    assert out.num_scheduled_tokens == {"a": 14, "b": 2, "c": 2}
    assert [o.num_cached_tokens for o in outs] == [0, 12, 12]
    assert [sched.kv_cache_manager.block_pool.blocks[i].ref_cnt for i in range(4)] == [3, 3, 3, 1]
    run.run()


def test_caching_disabled_never_hits() -> None:
    sched = make_sched(caching=False)
    sched.add_request(make_req("a", prompt(10), max_tokens=1))
    sched.add_request(make_req("b", prompt(10), max_tokens=1))
    out, _ = Runner(sched).step()
    assert new(out) == {"a": ([0, 1, 2], 0), "b": ([3, 4, 5], 0)}
    assert sched.stats().prefix_cache_queries == 0


# ---- stop rules ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "script", "tokens", "reason", "stop_reason"),
    [
        ({}, [5, EOS, 7], [5, EOS], "stop", None),
        ({"ignore_eos": True, "max_tokens": 3}, [5, EOS, 7, 8], [5, EOS, 7], "length", None),
        ({"stop_token_ids": [7]}, [5, 7, 8], [5, 7], "stop", 7),
        ({"min_tokens": 2}, [EOS, EOS, 9], [EOS, EOS], "stop", None),
        ({"min_tokens": 2, "stop_token_ids": [7]}, [7, 9, 7], [7, 9, 7], "stop", 7),
        ({"max_tokens": 2}, [5, 6, 7], [5, 6], "length", None),
        ({"max_tokens": 1}, [EOS], [EOS], "stop", None),  # stop wins over length
    ],
)
def test_stop_rules(
    params: dict[str, object],
    script: list[int],
    tokens: list[int],
    reason: str,
    stop_reason: int | None,
) -> None:
    sched = make_sched()
    sched.add_request(make_req("r", prompt(3), **params))
    run = Runner(sched, {"r": script})
    run.run()
    assert run.tokens["r"] == tokens
    assert run.finish["r"].finish_reason == reason
    assert run.finish["r"].stop_reason == stop_reason


def test_max_model_len_caps_the_request() -> None:
    sched = make_sched(max_model_len=8)
    sched.add_request(make_req("r", prompt(6), eos=None, max_tokens=None))
    sched.add_request(make_req("full", prompt(8, start=50), eos=None, max_tokens=None))
    run = Runner(sched)
    run.run()
    assert run.tokens == {"r": [1000, 1001], "full": [1000]}
    assert {o.finish_reason for o in run.finish.values()} == {"length"}
    with pytest.raises(ValueError):
        sched.add_request(make_req("long", prompt(9)))


def test_several_tokens_in_one_step_stop_at_the_first_stop() -> None:
    sched = make_sched()
    sched.add_request(make_req("r", prompt(3), max_tokens=10))
    out = sched.schedule()
    lp = Logprobs(token_ids=[5], logprobs=[-0.5], sampled_rank=1)
    outs = sched.update_from_output(out, ModelRunnerOutput(["r"], [[5, EOS, 7]], [[lp, lp, lp]]))
    assert len(outs) == 1
    assert outs[0].new_token_ids == [5, EOS] and outs[0].finish_reason == "stop"
    assert outs[0].new_logprobs == [lp, lp]
    assert sched.get_num_unfinished_requests() == 0


def test_a_partial_chunk_samples_nothing() -> None:
    sched = make_sched(budget=4)
    sched.add_request(make_req("r", prompt(6)))
    out = sched.schedule()
    assert sched.update_from_output(out, ModelRunnerOutput(["r"], [[9]])) == []
    req = sched.requests["r"]
    assert req.output_token_ids == [] and req.num_computed_tokens == 4
    sched.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)


# ---- aborts, bookkeeping -------------------------------------------------------------------


def test_abort_frees_blocks_of_running_and_waiting_requests() -> None:
    sched = make_sched(max_num_seqs=1)
    sched.add_request(make_req("a", prompt(9)))
    sched.add_request(make_req("b", prompt(9, start=40)))
    run = Runner(sched)
    out, _ = run.step()
    assert list(out.num_scheduled_tokens) == ["a"] and sched.kv_cache_manager.num_free_blocks < 64
    req_a = sched.requests["a"]
    sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert req_a.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests() and sched.kv_cache_manager.block_pool.is_whole
    out = sched.schedule()
    assert out.is_empty and out.finished_req_ids == {"a", "b"}
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # twice: ignored
    with pytest.raises(ValueError):
        sched.finish_requests("a", RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_drops_the_sampled_token() -> None:
    sched = make_sched()
    sched.add_request(make_req("a", prompt(4)))
    sched.add_request(make_req("b", prompt(4, start=40)))
    out = sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    outs = sched.update_from_output(out, ModelRunnerOutput(["a", "b"], [[5], [6]]))
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("b", [6])]
    assert sched.schedule().finished_req_ids == {"a"}
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)


def test_pool_must_hold_one_request_of_max_model_len() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        make_sched(num_blocks=4, block_size=4, max_model_len=17)
    make_sched(num_blocks=4, block_size=4, max_model_len=0)  # unbounded: no check


def test_add_request_validation_and_stats() -> None:
    sched = make_sched(num_blocks=10)
    sched.add_request(make_req("a", prompt(5)))
    with pytest.raises(ValueError):
        sched.add_request(make_req("a", prompt(5)))
    with pytest.raises(ValueError):
        sched.add_request(make_req("empty", []))
    sched.add_request(make_req("b", prompt(5, start=40)))
    assert sched.stats() == SchedulerStats(
        num_running=0,
        num_waiting=2,
        num_free_blocks=10,
        num_blocks=10,
        kv_cache_usage=0.0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
    )
    Runner(sched).step()
    s = sched.stats()
    assert (s.num_running, s.num_waiting, s.num_free_blocks) == (2, 0, 6)
    assert s.kv_cache_usage == pytest.approx(0.4)
    assert sched.get_num_unfinished_requests() == 2
    sched.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
