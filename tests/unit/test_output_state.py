"""The per-choice output state machine (tandem.engine.output_state), on its own and driven
through both of its callers: the offline `OutputProcessor` and the frontend's
`RequestTracker` (a real actor on an event loop, fed real worker protobufs)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest

from tandem.core.outputs import EngineCoreOutput
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.output_state import TRANSITIONS, ChoiceOutput, ChoiceState
from tandem.sampling_params import SamplingParams
from tandem_protos.v1 import worker_pb2
from tandem_services.common.convert import FINISH_TO_PROTO
from tandem_services.frontend.tracker import Outputs, Register, RequestTracker
from tandem_services.frontend.types import StepEvent

PIECES = ["a", "b", "c", "d", "e", " ", "x", "y", "<eos>"]
A, B, C, D, E, SP, X, Y, EOS = range(len(PIECES))


class PieceTokenizer:
    """Token i decodes to PIECES[i]: token boundaries exactly where a test wants them."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(PIECES[i] for i in ids if not (skip_special_tokens and i == EOS))


# A step: (new token ids, engine finish reason or None, engine stop reason).
Step = tuple[list[int], str | None, int | str | None]


@dataclass
class Result:
    deltas: list[str] | None  # streamed text per step (the tracker); None offline
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    aborted: list[str]


def run_offline(params: SamplingParams, steps: Sequence[Step]) -> Result:
    proc = OutputProcessor(PieceTokenizer())
    [(rid, _)] = proc.add_request("r", None, [X, Y], params)
    aborted: list[str] = []
    finished = []
    for ids, finish, stop in steps:
        out, abort = proc.process_outputs([EngineCoreOutput(rid, ids, None, finish, stop)])
        finished += out
        aborted += abort
    assert len(finished) == 1 and proc.num_unfinished == 0
    [choice] = finished[0].outputs
    return Result(None, choice.text, choice.finish_reason, choice.stop_reason, aborted)


def run_tracker(params: SamplingParams, steps: Sequence[Step]) -> Result:
    async def main() -> Result:
        aborted: list[str] = []
        tracker = RequestTracker(PieceTokenizer(), aborted.extend)
        tracker.start()
        try:
            queue = await tracker.ask(Register("r", [X, Y], [("r", params)]))
            index = 0
            events: list[StepEvent] = []
            for ids, finish, stop in steps:
                out = worker_pb2.RequestOutput(
                    request_id="r",
                    output_index=index,
                    new_token_ids=ids,
                    finish_reason=FINISH_TO_PROTO[finish],
                )
                if isinstance(stop, int):
                    out.stop_token_id = stop
                index += len(ids)
                tracker.tell(Outputs(worker_pb2.StepOutputs(outputs=[out])))
                events.append(await asyncio.wait_for(queue.get(), 5))
                if events[-1].finished:
                    break
        finally:
            await tracker.stop()
        assert events[-1].finished and events[-1].usage is not None
        assert all(len(e.deltas) == 1 for e in events)  # one delta per choice per step
        deltas = [e.deltas[0].text for e in events]
        last = events[-1].deltas[0]
        assert events[-1].usage.completion_tokens == sum(len(s[0]) for s in steps[: len(events)])
        return Result(deltas, "".join(deltas), last.finish_reason, last.stop_reason, aborted)

    return asyncio.run(main())


Runner = Callable[[SamplingParams, Sequence[Step]], Result]
RUNNERS: dict[str, Runner] = {"offline": run_offline, "tracker": run_tracker}


@pytest.fixture(params=sorted(RUNNERS))
def run(request: pytest.FixtureRequest) -> Runner:
    return RUNNERS[request.param]


def test_stop_string_across_a_step_boundary(run: Runner) -> None:
    params = SamplingParams(max_tokens=10, stop=["cd"])
    r = run(params, [([A, B, C], None, None), ([D, E], None, None)])
    assert (r.text, r.finish_reason, r.stop_reason, r.aborted) == ("ab", "stop", "cd", ["r"])
    if r.deltas is not None:
        # "c" could start "cd": held back at the first step, dropped once the stop matched.
        assert r.deltas == ["ab", ""]


def test_stop_string_kept_with_include_stop_str(run: Runner) -> None:
    params = SamplingParams(max_tokens=10, stop=["cd"], include_stop_str_in_output=True)
    r = run(params, [([A, B, C], None, None), ([D, E], None, None)])
    assert (r.text, r.finish_reason, r.stop_reason) == ("abcd", "stop", "cd")
    if r.deltas is not None:
        assert r.deltas == ["ab", "cd"]


def test_hold_back_released_at_finish(run: Runner) -> None:
    params = SamplingParams(max_tokens=4, stop=["dex"])
    r = run(params, [([A, B, C], None, None), ([D], "length", None)])
    assert (r.text, r.finish_reason, r.stop_reason, r.aborted) == ("abcd", "length", None, [])
    if r.deltas is not None:
        assert r.deltas == ["a", "bcd"]  # two characters held while "dex" could still start


def test_finish_by_length_vs_stop_token_vs_stop_string(run: Runner) -> None:
    params = SamplingParams(max_tokens=3, stop=["zz"])
    by_length = run(params, [([A, B], None, None), ([C], "length", None)])
    assert (by_length.text, by_length.finish_reason, by_length.stop_reason) == (
        "abc",
        "length",
        None,
    )
    by_token = run(params, [([A, B], None, None), ([EOS], "stop", EOS)])
    assert (by_token.text, by_token.finish_reason, by_token.stop_reason) == ("ab", "stop", EOS)
    assert by_token.aborted == []
    # The engine finished the step in which a stop string matched: the string is the reason,
    # and nothing is left to abort.
    params = SamplingParams(max_tokens=3, stop=["bc"])
    both = run(params, [([A, B], None, None), ([C], "length", None)])
    assert (both.text, both.finish_reason, both.stop_reason, both.aborted) == (
        "a",
        "stop",
        "bc",
        [],
    )


def test_transitions_are_one_table_and_end_states_are_final() -> None:
    assert TRANSITIONS[ChoiceState.RUNNING] == {
        ChoiceState.STOPPED_BY_STRING,
        ChoiceState.FINISHED_BY_ENGINE,
    }
    assert all(not TRANSITIONS[s] for s in ChoiceState if s.finished)
    out = ChoiceOutput(PieceTokenizer(), [X], SamplingParams(max_tokens=9, stop=["b"]))
    assert out.state is ChoiceState.RUNNING and not out.finished
    assert out.update([A]) is False
    assert out.take_text() == "a"
    assert out.update([B, C]) is True  # stopped while the engine runs it: abort there
    assert out.state is ChoiceState.STOPPED_BY_STRING and out.num_tokens == 3
    # A step already in flight is ignored: no text, no tokens, no second abort.
    assert out.update([D], "length") is False
    assert (out.text, out.num_tokens, out.finish_reason, out.stop_reason) == ("a", 3, "stop", "b")
    assert out.take_text() == ""

    done = ChoiceOutput(PieceTokenizer(), [X], SamplingParams(max_tokens=1))
    assert done.update([A], "length") is False
    assert done.state is ChoiceState.FINISHED_BY_ENGINE
    with pytest.raises(RuntimeError, match="cannot go"):
        done._move(ChoiceState.STOPPED_BY_STRING, "stop", "x")


def test_without_a_tokenizer_token_ids_only() -> None:
    out = ChoiceOutput(None, [1, 2], SamplingParams(max_tokens=2))
    assert out.update([5]) is False and out.take_text() == ""
    assert out.update([6], "length") is False
    assert (out.state, out.text, out.num_tokens) == (ChoiceState.FINISHED_BY_ENGINE, "", 2)
