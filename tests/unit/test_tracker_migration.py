"""The frontend tracker's migration (issue 15), driven as a real actor with real worker protos:
a choice whose worker is lost continues as a new engine request (prompt + the tokens the client
has, max_tokens / min_tokens reduced); the client's stream goes on with no token repeated or
missing; whatever the lost attempt still delivers is dropped; the limit holds. A scheduler's
dispatch attempt (`r~d1`) feeds its choice, older attempts' late outputs are dropped."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from tandem.core.outputs import Logprobs
from tandem.engine.output_state import child_params
from tandem.sampling_params import SamplingParams
from tandem_protos.v1 import common_pb2, worker_pb2
from tandem_services.common.convert import logprobs_to_proto, sampling_params_to_proto
from tandem_services.common.request_ids import dispatch_request_id, split_dispatch_request_id
from tandem_services.frontend.tracker import (
    Failed,
    Migration,
    Outputs,
    Register,
    RequestTracker,
    migration_request_id,
)
from tandem_services.frontend.types import FrontendError, StepEvent

PIECES = ["a", "b", "c", "d", "e", "f", "g", "h"]
LOST = FrontendError(grpc.StatusCode.UNAVAILABLE, "worker decode-0 was lost")


class PieceTokenizer:
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(PIECES[i] for i in ids)


def _out(
    rid: str, index: int, ids: list[int], finish: int = 0, prompt: Sequence[Logprobs] = ()
) -> Outputs:
    out = worker_pb2.RequestOutput(
        request_id=rid, output_index=index, new_token_ids=ids, finish_reason=finish
    )
    out.prompt_logprobs.extend(map(logprobs_to_proto, prompt))
    return Outputs(worker_pb2.StepOutputs(outputs=[out]))


async def _drain(queue: asyncio.Queue[StepEvent], n: int) -> list[StepEvent]:
    return [await asyncio.wait_for(queue.get(), 5) for _ in range(n)]


def _setup(
    limit: int, params: SamplingParams
) -> tuple[RequestTracker, list[Migration], list[str], common_pb2.EngineRequest]:
    migrations: list[Migration] = []
    aborted: list[str] = []
    tracker = RequestTracker(PieceTokenizer(), aborted.extend, migrations.append, limit)
    request = common_pb2.EngineRequest(
        request_id="r",
        prompt_token_ids=[7, 7],
        sampling_params=sampling_params_to_proto(params),
        priority=3,
    )
    return tracker, migrations, aborted, request


def test_a_lost_worker_migrates_and_the_stream_goes_on() -> None:
    async def main() -> None:
        params = SamplingParams(max_tokens=6, min_tokens=4, temperature=0)
        tracker, migrations, _, request = _setup(2, params)
        tracker.start()
        try:
            queue = await tracker.ask(Register("r", [7, 7], [("r", params)], (request,)))
            tracker.tell(_out("r", 0, [0]))  # from the prefill worker
            tracker.tell(_out("r", 1, [1, 2]))  # from the decode worker, then it dies
            tracker.tell(Failed(["r"], LOST))
            events = await _drain(queue, 2)
            await asyncio.sleep(0.05)
            assert len(migrations) == 1
            m = migrations[0]
            assert m.old_request_id == "r" and m.num_streamed_tokens == 3
            assert m.request.request_id == migration_request_id("r", 1)
            assert list(m.request.prompt_token_ids) == [7, 7, 0, 1, 2]
            assert m.request.sampling_params.max_tokens == 3
            assert m.request.sampling_params.min_tokens == 1
            assert m.request.priority == 3
            # The lost attempt's late output and failure match nothing now.
            tracker.tell(_out("r", 3, [7]))
            tracker.tell(Failed(["r"], LOST))
            # The continuation's outputs count from 0 again; a duplicate is dropped.
            new = m.request.request_id
            tracker.tell(_out(new, 0, [3]))
            tracker.tell(_out(new, 0, [3]))
            tracker.tell(_out(new, 1, [4, 5], common_pb2.FINISH_REASON_LENGTH))
            events += await _drain(queue, 2)
            assert queue.empty()
            text = "".join(d.text for e in events for d in e.deltas)
            assert text == "abcdef"
            assert events[-1].finished and events[-1].usage is not None
            assert events[-1].usage.completion_tokens == 6
            assert events[-1].usage.prompt_tokens == 2
            assert tracker.num_migrations == 1
        finally:
            await tracker.stop()

    asyncio.run(main())


def test_the_migration_limit_then_a_clear_error() -> None:
    async def main() -> None:
        params = SamplingParams(max_tokens=8, temperature=0)
        tracker, migrations, aborted, request = _setup(1, params)
        tracker.start()
        try:
            queue = await tracker.ask(Register("r", [7], [("r", params)], (request,)))
            tracker.tell(_out("r", 0, [0]))
            tracker.tell(Failed(["r"], LOST))
            await _drain(queue, 1)
            await asyncio.sleep(0.05)
            [m] = migrations
            new = m.request.request_id
            tracker.tell(_out(new, 0, [1]))
            tracker.tell(Failed([new], LOST))  # lost again: the limit (1) is reached
            events = await _drain(queue, 2)
            assert events[-1].error is not None
            assert events[-1].error.code == grpc.StatusCode.UNAVAILABLE
            assert "after 1 migrations" in events[-1].error.message
            assert len(migrations) == 1 and aborted == [new]
        finally:
            await tracker.stop()

    asyncio.run(main())


def test_a_refused_submit_is_not_migrated() -> None:
    async def main() -> None:
        params = SamplingParams(max_tokens=8, temperature=0)
        tracker, migrations, _, request = _setup(3, params)
        tracker.start()
        try:
            queue = await tracker.ask(Register("r", [7], [("r", params)], (request,)))
            refused = FrontendError(grpc.StatusCode.UNAVAILABLE, "no worker within 60s")
            tracker.tell(Failed(["r"], refused, migratable=False))
            [event] = await _drain(queue, 1)
            assert event.error is refused and not migrations
        finally:
            await tracker.stop()

    asyncio.run(main())


def test_without_a_limit_a_lost_worker_fails_the_request() -> None:
    async def main() -> None:
        params = SamplingParams(max_tokens=8, temperature=0)
        tracker, migrations, _, request = _setup(0, params)
        tracker.start()
        try:
            queue = await tracker.ask(Register("r", [7], [("r", params)], (request,)))
            tracker.tell(_out("r", 0, [0]))
            tracker.tell(Failed(["r"], LOST))
            events = await _drain(queue, 2)
            assert events[-1].error is LOST and not migrations
        finally:
            await tracker.stop()

    asyncio.run(main())


def test_dispatch_attempt_ids() -> None:
    assert dispatch_request_id("r", 0) == "r"
    assert dispatch_request_id("r", 2) == "r~d2"
    assert split_dispatch_request_id("r~d2") == ("r", 2)
    assert split_dispatch_request_id("r~m1~d1") == ("r~m1", 1)
    for plain in ("r", "r~d", "r~d0", "r~d01", "~d1", "r~dx", "r~m1"):
        assert split_dispatch_request_id(plain) is None, plain


def test_a_dispatch_attempt_feeds_its_choice_and_older_attempts_are_dropped() -> None:
    """The scheduler dispatched `r` again as `r~d1` (the first attempt may still deliver):
    `r~d1`'s outputs are the choice's; once they come, `r`'s late ones are dropped; a migration
    of the choice then takes attempts of its own id (`r~m1~d1`)."""

    async def main() -> None:
        params = SamplingParams(max_tokens=6, temperature=0)
        tracker, migrations, _, request = _setup(2, params)
        tracker.start()
        try:
            queue = await tracker.ask(Register("r", [7, 7], [("r", params)], (request,)))
            tracker.tell(_out("r", 0, [0]))  # the first attempt's first token came out
            tracker.tell(_out("r~d1", 0, [0]))  # the retry's: a duplicate index, dropped
            tracker.tell(_out("r~d1", 1, [1]))
            tracker.tell(_out("r", 1, [5]))  # the first attempt, late: dropped
            tracker.tell(_out("r", 2, [5]))
            tracker.tell(_out("r~d2x", 2, [5]))  # no attempt id: dropped
            events = await _drain(queue, 2)
            assert "".join(d.text for e in events for d in e.deltas) == "ab"
            # A worker of attempt r~d1 is lost: the choice migrates with what the client has.
            tracker.tell(Failed(["r"], LOST))
            await asyncio.sleep(0.05)
            [m] = migrations
            new = m.request.request_id
            assert new == migration_request_id("r", 1)
            assert list(m.request.prompt_token_ids) == [7, 7, 0, 1]
            tracker.tell(_out(f"{new}~d1", 0, [2]))  # the migration dispatched again
            tracker.tell(_out("r~d1", 2, [5]))  # the lost attempt: dropped
            tracker.tell(_out(f"{new}~d1", 1, [3, 4, 5], common_pb2.FINISH_REASON_LENGTH))
            events += await _drain(queue, 2)
            assert queue.empty()
            assert "".join(d.text for e in events for d in e.deltas) == "abcdef"
            assert events[-1].finished and events[-1].usage is not None
            assert events[-1].usage.completion_tokens == 6
        finally:
            await tracker.stop()

    asyncio.run(main())


def test_an_output_ahead_of_its_turn_joins_the_one_it_waited_for() -> None:
    """The decode worker's tokens can reach the tracker before the prefill worker's first
    one: held in `pending`, they are applied right after it, in the same event, as one delta
    for the choice (two entries of one choice in a chunk lost the first's text for a client
    reading `choices[0]`)."""

    async def main() -> None:
        params = SamplingParams(max_tokens=4, temperature=0)
        tracker, _, _, request = _setup(0, params)
        tracker.start()
        try:
            queue = await tracker.ask(Register("r", [7, 7], [("r", params)], (request,)))
            tracker.tell(_out("r", 1, [1, 2]))  # ahead: waits for index 0
            tracker.tell(_out("r", 0, [0]))
            (event,) = await _drain(queue, 1)
            assert [(d.index, d.text, d.token_ids) for d in event.deltas] == [(0, "abc", [0, 1, 2])]
            tracker.tell(_out("r", 3, [3], common_pb2.FINISH_REASON_LENGTH))
            (last,) = await _drain(queue, 1)
            assert [(d.text, d.finish_reason is not None) for d in last.deltas] == [("d", True)]
        finally:
            await tracker.stop()

    asyncio.run(main())


def test_prompt_logprobs_reach_every_choice_first_delta_and_are_not_asked_again() -> None:
    """n = 2 with prompt logprobs: the first choice alone computes them; the second choice's
    outputs wait until they come, then each choice's first delta carries them (and no later
    delta). A migration after the first token does not ask for them again; one before it
    does (the continuation's first output brings them)."""

    async def main() -> None:
        params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1)
        tracker, migrations, _, _ = _setup(2, params)
        lps = [Logprobs([7, 3], [-0.5, -0.25], 2)]
        children = [("r#0", child_params(params, 0)), ("r#1", child_params(params, 1))]
        requests = tuple(
            common_pb2.EngineRequest(
                request_id=rid, prompt_token_ids=[7, 7], sampling_params=sampling_params_to_proto(p)
            )
            for rid, p in children
        )
        assert requests[0].sampling_params.HasField("prompt_logprobs")
        assert not requests[1].sampling_params.HasField("prompt_logprobs")
        tracker.start()
        try:
            queue = await tracker.ask(Register("r", [7, 7], children, requests))
            tracker.tell(_out("r#1", 0, [4]))  # the second choice first: held
            tracker.tell(_out("r#1", 1, [5]))
            await asyncio.sleep(0.05)
            assert queue.empty()
            tracker.tell(_out("r#0", 0, [0], prompt=lps))
            [event] = await _drain(queue, 1)
            by_index = {d.index: d for d in event.deltas}
            assert by_index[0].prompt_logprobs == lps and by_index[1].prompt_logprobs == lps
            assert by_index[1].token_ids == [4, 5] and by_index[0].token_ids == [0]
            tracker.tell(_out("r#1", 2, [6]))
            [event] = await _drain(queue, 1)
            assert [d.prompt_logprobs for d in event.deltas] == [None]
            # The first choice's worker is lost after its first token: the continuation
            # does not compute the prompt's logprobs again.
            tracker.tell(Failed(["r#0"], LOST))
            await asyncio.sleep(0.05)
            [m] = migrations
            assert not m.request.sampling_params.HasField("prompt_logprobs")
        finally:
            await tracker.stop()

    async def before_first_token() -> None:
        params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0)
        tracker, migrations, _, request = _setup(2, params)
        tracker.start()
        try:
            queue = await tracker.ask(Register("r", [7, 7], [("r", params)], (request,)))
            tracker.tell(Failed(["r"], LOST))
            await asyncio.sleep(0.05)
            [m] = migrations
            assert m.request.sampling_params.HasField("prompt_logprobs")
            lps = [Logprobs([7], [-0.75], 3)]
            tracker.tell(_out(m.request.request_id, 0, [1], prompt=lps))
            [event] = await _drain(queue, 1)
            assert event.deltas[0].prompt_logprobs == lps
        finally:
            await tracker.stop()

    asyncio.run(main())
    asyncio.run(before_first_token())
