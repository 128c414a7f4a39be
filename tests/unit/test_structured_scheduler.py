"""The scheduler with structured-output requests (no torch, no xgrammar: a scripted
`GrammarState`): a request whose grammar compiles is passed over without holding up the
others and keeps its place; a failed grammar ends its request with finish reason "error";
a terminated grammar stops its request; the grammar follows the output tokens and is reset
on preemption; the step lists its structured rows that sample. Pools whole after each."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from tandem.config import CacheConfig, SchedulerConfig
from tandem.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from tandem.core.scheduler import Scheduler
from tandem.core.structured import GrammarStatus
from tandem.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams, StructuredOutputsParams

EOS = 2
_prompt_starts = itertools.count()
_made: list[Scheduler] = []


@pytest.fixture(autouse=True)
def pools_are_whole_after_each_test() -> Iterator[None]:
    _made.clear()
    yield
    for sched in _made:
        assert not sched.has_unfinished_requests()
        sched.kv_cache_manager.check_invariants()
        assert sched.kv_cache_manager.block_pool.is_whole


class ScriptedGrammar:
    """A grammar whose status the test sets; it records what the scheduler asked of it and
    terminates after `accept` tokens."""

    def __init__(self, request: Request, status: GrammarStatus, accept: int = 1000) -> None:
        self.status = status
        self.tokens = request.output_token_ids
        self.accept = accept
        self.synced = 0
        self.resets = 0

    @property
    def error(self) -> str | None:
        return (
            "structured_outputs.json: invalid JSON schema: scripted" if self.status == 2 else None
        )

    def poll(self) -> GrammarStatus:
        return self.status

    def sync(self) -> bool:
        self.synced = len(self.tokens)
        return True

    def is_terminated(self) -> bool:
        return self.synced >= self.accept

    def reset(self) -> None:
        self.resets += 1


def make_sched(num_blocks: int = 64, budget: int = 64) -> Scheduler:
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16),
        CacheConfig(block_size=4, enable_prefix_caching=True),
        num_blocks,
        min(256, num_blocks * 4),
    )
    _made.append(sched)
    return sched


def make_request(
    rid: str, n: int, status: GrammarStatus | None, max_tokens: int = 8, accept: int = 1000
) -> tuple[Request, ScriptedGrammar | None]:
    spec = StructuredOutputsParams(regex="a+") if status is not None else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=spec)
    start = 10 + 100 * next(_prompt_starts)  # distinct prompts: no prefix-cache hits
    request = Request(rid, list(range(start, start + n)), params, eos_token_id=EOS)
    grammar = None
    if status is not None:
        grammar = ScriptedGrammar(request, status, accept)
        request.grammar = grammar
    return request, grammar


def run_step(sched: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    so = sched.schedule()
    ids = [r.req_id for r in so.scheduled_new_reqs] + [r.req_id for r in so.scheduled_cached_reqs]
    sampled = []
    for rid in ids:
        req = sched.requests[rid]
        sampled.append([token] if req.num_computed_tokens >= req.num_tokens else [])
    outs = sched.update_from_output(so, ModelRunnerOutput(ids, sampled))
    return so, outs + sched.take_error_outputs()


def test_a_compiling_request_is_passed_over_and_keeps_its_place() -> None:
    sched = make_sched()
    slow, grammar = make_request("slow", 5, GrammarStatus.COMPILING)
    plain, _ = make_request("plain", 5, None)
    later, _ = make_request("later", 5, None)
    for r in (slow, plain, later):
        sched.add_request(r)
    so, _ = run_step(sched)
    assert set(so.num_scheduled_tokens) == {"plain", "later"}
    assert so.structured_req_ids == []
    assert [r.request_id for r in sched.waiting] == ["slow"]
    assert grammar is not None
    grammar.status = GrammarStatus.READY
    so, _ = run_step(sched)
    assert "slow" in so.num_scheduled_tokens and so.structured_req_ids == ["slow"]
    assert grammar.synced == 1  # followed the token appended
    while sched.has_unfinished_requests():
        so, _ = run_step(sched)
        assert so.structured_req_ids == (["slow"] if "slow" in so.num_scheduled_tokens else [])


def test_the_order_of_waiting_requests_survives_passing_over() -> None:
    sched = make_sched(budget=5)  # one prompt per step
    a, ga = make_request("a", 5, GrammarStatus.COMPILING)
    b, gb = make_request("b", 5, GrammarStatus.COMPILING)
    c, _ = make_request("c", 5, None)
    for r in (a, b, c):
        sched.add_request(r)
    so, _ = run_step(sched)
    assert list(so.num_scheduled_tokens) == ["c"]
    assert [r.request_id for r in sched.waiting] == ["a", "b"]
    assert ga is not None and gb is not None
    ga.status = gb.status = GrammarStatus.READY
    so, _ = run_step(sched)
    assert "a" in so.num_scheduled_tokens and "b" not in so.num_scheduled_tokens
    while sched.has_unfinished_requests():
        run_step(sched)


def test_a_failed_grammar_ends_its_request_with_an_error() -> None:
    sched = make_sched()
    bad, _ = make_request("bad", 5, GrammarStatus.FAILED)
    good, _ = make_request("good", 5, None, max_tokens=2)
    sched.add_request(bad)
    sched.add_request(good)
    so, outs = run_step(sched)
    errors = [o for o in outs if o.finish_reason == "error"]
    assert [o.request_id for o in errors] == ["bad"]
    assert "invalid JSON schema" in str(errors[0].stop_reason)
    assert "bad" not in sched.requests and "bad" in so.finished_req_ids
    assert bad.status == RequestStatus.FINISHED_ERROR
    assert set(so.num_scheduled_tokens) == {"good"}
    while sched.has_unfinished_requests():
        run_step(sched)


def test_a_failed_grammar_of_a_kv_holding_request_holds_nothing() -> None:
    sched = make_sched()
    bad, _ = make_request("bad", 5, GrammarStatus.FAILED)
    bad.hold_kv = True
    sched.add_request(bad)
    _, outs = run_step(sched)
    assert [o.finish_reason for o in outs] == ["error"] and not sched.held


def test_a_terminated_grammar_stops_the_request() -> None:
    sched = make_sched()
    req, _ = make_request("r", 5, GrammarStatus.READY, max_tokens=20, accept=3)
    sched.add_request(req)
    finish = None
    while sched.has_unfinished_requests():
        _, outs = run_step(sched)
        for o in outs:
            finish = o.finish_reason or finish
    assert req.output_token_ids == [7, 7, 7] and finish == "stop"


def test_preemption_resets_the_grammar() -> None:
    sched = make_sched(num_blocks=5, budget=64)  # 20 slots: two requests of 5 + 8 collide
    r1, g1 = make_request("r1", 5, GrammarStatus.READY, max_tokens=8)
    r2, g2 = make_request("r2", 5, GrammarStatus.READY, max_tokens=8)
    sched.add_request(r1)
    sched.add_request(r2)
    while sched.has_unfinished_requests():
        run_step(sched)
    assert sched.num_preemptions > 0
    assert g1 is not None and g2 is not None
    assert g1.resets + g2.resets == sched.num_preemptions
    assert len(r1.output_token_ids) == 8 and len(r2.output_token_ids) == 8


def test_an_error_output_crosses_the_engine_process_boundary() -> None:
    from tandem.engine import serial

    out = EngineCoreOutput("bad", [], finish_reason="error", stop_reason="structured_outputs.x")
    (back,), _ = serial.decode_step(serial.encode_step([out], serial.Piggyback()))
    assert (back.request_id, back.finish_reason, back.stop_reason) == (
        "bad",
        "error",
        "structured_outputs.x",
    )
