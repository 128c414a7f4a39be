"""`RequestTracker`: the one owner of every in-flight request's client-side state.

Worker output streams, scheduler events and request handlers all talk to it by message. Per
request it keeps one `ChoiceOutput` per choice (the per-choice state machine shared with the
offline API, tandem.engine.output_state: incremental detokenization, stop strings, finish
reasons), orders outputs by `output_index` (the first token comes from the prefill worker,
the rest from the decode worker, on two streams), and puts one `StepEvent` per incoming step
on the request's queue, which its handler drains. A request the engine ends as the request's
own fault (`invalid_request`: a structured-output spec that does not compile) fails with
INVALID_ARGUMENT (HTTP 400), other failures with UNAVAILABLE.

Migration. A choice whose worker was lost (the scheduler's failure event, or a worker's error
output: UNAVAILABLE) goes on elsewhere, up to `migration_limit` times: it is submitted again as
a new engine request whose prompt is the original prompt plus every token the client has been
sent, with `max_tokens` / `min_tokens` reduced by their number. Only the frontend knows exactly
which tokens reached the client, so it is the frontend that builds the continuation:

    engine id   cmpl-7 ──(worker lost after 5 tokens)──▶ cmpl-7~m1   (prompt + those 5 tokens)
    output_index 0 1 2 3 4                               0 1 2 ...  + index_offset 5 = 5 6 7 ...

Each attempt has its own engine id, so whatever the lost attempt still delivers (a late output,
an error, a failure event) matches no choice and is dropped; the `ChoiceOutput` (detokenizer,
stop strings, token counts) carries on across attempts, so no token is repeated or missing.

Dispatch attempts. The scheduler may dispatch one engine request again before it runs (its
first dispatch failed or its worker was lost before it started; scheduler/dispatcher.py), under
`cmpl-7~d1`, `cmpl-7~d2`, ... (common/request_ids.py): the same prompt and output indices.
Outputs of such an id belong to the choice of `cmpl-7` (or of `cmpl-7~m1`); once one of a
newer attempt has come, those of older attempts are dropped (the scheduler aborted them, but
what they sent before may still be on its way). A token an older attempt sent first is kept
(the newer attempt's at that index is then a duplicate): greedy and seeded sampling draw the
same one.
Greedy output is that of an uninterrupted run. A seeded request's generator starts again from
its seed at the migration point (the tokens after it differ from an uninterrupted run's), and
presence / frequency penalties count the tokens before it as prompt, not output.

Prompt logprobs. The first choice's engine request alone computes them (child_params) and its
first output (`output_index` 0, from the prefill worker where disaggregated) brings them. Every
choice's first delta carries them (`ChoiceDelta.prompt_logprobs`: an echoed prompt heads each
choice's logprobs), so the other choices' outputs are held until then. A continuation after the
first token does not ask for them again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from tandem.core.outputs import Logprobs
from tandem.engine.output_state import ChoiceOutput
from tandem.sampling_params import SamplingParams
from tandem_protos.v1 import common_pb2, worker_pb2
from tandem_services.common.actor import Actor, Ask
from tandem_services.common.convert import FINISH_FROM_PROTO, logprobs_from_proto
from tandem_services.common.request_ids import migration_request_id, split_dispatch_request_id
from tandem_services.frontend.types import ChoiceDelta, FrontendError, StepEvent, Usage

logger = logging.getLogger(__name__)

__all__ = [
    "Cancel",
    "Count",
    "FailAll",
    "Failed",
    "Migration",
    "Outputs",
    "Register",
    "RequestTracker",
    "migration_request_id",
]


@dataclass
class _Choice:
    # The engine request id of the current attempt (the first one's, or a migration's).
    request_id: str
    index: int
    params: SamplingParams
    output: ChoiceOutput
    # The first attempt's engine request (a migration is built from it).
    base: common_pb2.EngineRequest | None = None
    # Every token applied so far (a migration's prompt ends with them).
    token_ids: list[int] = field(default_factory=list)
    next_index: int = 0
    # Outputs that arrived ahead of `next_index` (keyed by index in the whole output).
    pending: dict[int, worker_pb2.RequestOutput] = field(default_factory=dict)
    migrations: int = 0
    # The current attempt's output index 0 is this index in the whole output.
    index_offset: int = 0
    # The newest dispatch attempt of `request_id` outputs came from (request_ids.py).
    dispatch_attempt: int = 0


@dataclass
class _Request:
    request_id: str
    num_prompt_tokens: int
    choices: list[_Choice]
    queue: asyncio.Queue[StepEvent]
    num_cached_tokens: int = 0
    # With prompt logprobs asked for, the first choice alone computes them (child_params) and
    # its first output brings them; every choice's first delta carries them, so the other
    # choices' outputs wait in `held` until then (None: nothing waits).
    prompt_logprobs: list[Logprobs] | None = None
    held: list[worker_pb2.RequestOutput] | None = None

    @property
    def finished(self) -> bool:
        return all(c.output.finished for c in self.choices)


# ----------------------------------------------------------------------------- messages


@dataclass
class Register(Ask["asyncio.Queue[StepEvent]"]):
    request_id: str
    prompt_token_ids: list[int]
    # (engine request id, params) per choice, in choice order.
    choices: list[tuple[str, SamplingParams]]
    # Each choice's engine request as submitted (needed to migrate it); () : not migratable.
    requests: tuple[common_pb2.EngineRequest, ...] = ()


@dataclass
class Outputs:
    step: worker_pb2.StepOutputs


@dataclass
class Failed:
    """Engine requests that ended with an error (worker lost, submit refused)."""

    engine_request_ids: list[str]
    error: FrontendError
    # False: the error is final (a refused submit); True: a lost worker may be migrated from.
    migratable: bool = True


@dataclass
class Cancel:
    """The client went away (or the submit failed): forget the request, abort what runs."""

    request_id: str


@dataclass
class Count(Ask[int]):
    pass


@dataclass
class Migration:
    """A choice to continue elsewhere: abort `old_request_id` (wherever it may still be) and
    submit `request` (the continuation); a failed submit comes back as `Failed`."""

    old_request_id: str
    request: common_pb2.EngineRequest
    num_streamed_tokens: int


@dataclass
class FailAll(Ask[int]):
    """End every request in flight with `error` (shutdown after the grace period); answers
    how many there were. Their handlers answer the client (HTTP 503, an error event)."""

    error: FrontendError


TrackerMessage = Register | Outputs | Failed | Cancel | Count | FailAll


class RequestTracker(Actor[TrackerMessage]):
    """`migrate` (with `migration_limit` > 0) continues a choice whose worker was lost; without
    it such a choice fails with the worker's error."""

    def __init__(
        self,
        tokenizer: Any,
        abort: Callable[[list[str]], None],
        migrate: Callable[[Migration], None] | None = None,
        migration_limit: int = 0,
    ) -> None:
        super().__init__("request-tracker")
        if migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {migration_limit}")
        self.tokenizer = tokenizer
        self._abort = abort
        self._migrate = migrate
        self.migration_limit = migration_limit
        self.num_migrations = 0
        self.requests: dict[str, _Request] = {}
        self.by_engine_id: dict[str, tuple[_Request, _Choice]] = {}

    def handle(self, msg: TrackerMessage) -> None:
        match msg:
            case Outputs():
                self._on_outputs(msg.step)
            case Register():
                msg.answer(self._register(msg))
            case Failed():
                self._on_failed(msg)
            case Cancel():
                running = self._drop(msg.request_id)
                if running:
                    self._abort(running)
            case Count():
                msg.answer(len(self.requests))
            case FailAll():
                reqs = list(self.requests.values())
                for req in reqs:
                    self._fail(req, msg.error)
                msg.answer(len(reqs))

    def _register(self, msg: Register) -> asyncio.Queue[StepEvent]:
        if msg.request_id in self.requests:
            raise FrontendError(
                grpc.StatusCode.ALREADY_EXISTS, f"request id {msg.request_id!r} is in flight"
            )
        choices = []
        for i, (engine_id, params) in enumerate(msg.choices):
            output = ChoiceOutput(self.tokenizer, msg.prompt_token_ids, params)
            base = msg.requests[i] if msg.requests else None
            choices.append(_Choice(engine_id, i, params, output, base))
        req = _Request(msg.request_id, len(msg.prompt_token_ids), choices, asyncio.Queue())
        if choices[0].params.prompt_logprobs is not None and len(choices) > 1:
            req.held = []
        self.requests[msg.request_id] = req
        for c in choices:
            self.by_engine_id[c.request_id] = (req, c)
        return req.queue

    def _on_outputs(self, step: worker_pb2.StepOutputs) -> None:
        deltas: dict[str, list[ChoiceDelta]] = {}
        to_abort: list[str] = []
        for out in step.outputs:
            self._take(out, deltas, to_abort)
        for request_id, batch in deltas.items():
            req = self.requests.get(request_id)
            if req is None:
                continue
            event = StepEvent(deltas=_one_per_choice(batch))
            if req.finished:
                event.usage = Usage(
                    req.num_prompt_tokens,
                    sum(c.output.num_tokens for c in req.choices),
                    req.num_cached_tokens,
                )
                self._forget(req)
            req.queue.put_nowait(event)
        if to_abort:
            self._abort(to_abort)

    def _take(
        self,
        out: worker_pb2.RequestOutput,
        deltas: dict[str, list[ChoiceDelta]],
        to_abort: list[str],
    ) -> None:
        """One worker output: applied in its choice's order (into `deltas`), kept until its
        turn, or dropped (a duplicate, a lost attempt's)."""
        found = self._choice_of(out.request_id)
        if found is None:
            return
        req, choice = found
        if req.held is not None and choice is not req.choices[0]:
            req.held.append(out)  # until the first choice's first output brings the prompt's
            return
        index = out.output_index + choice.index_offset
        if index > choice.next_index:
            choice.pending[index] = out
            return
        if index < choice.next_index:
            return  # a duplicate
        if out.invalid_request:
            # The engine could not run it (its structured-output spec does not compile, or
            # not in time): the client's request is at fault, 400 naming the problem.
            message = out.error or "the request's output constraint could not be compiled"
            self._fail(req, FrontendError(grpc.StatusCode.INVALID_ARGUMENT, message))
            return
        if out.finish_reason == common_pb2.FINISH_REASON_ABORT and out.error:
            self._choice_failed(req, choice, FrontendError(grpc.StatusCode.UNAVAILABLE, out.error))
            return
        batch = deltas.setdefault(req.request_id, [])
        while True:
            batch.append(self._apply(req, choice, out, to_abort))
            if choice.output.finished:
                break
            nxt = choice.pending.pop(choice.next_index, None)
            if nxt is None:
                break
            out = nxt
        if req.held is not None and req.prompt_logprobs is not None:
            held, req.held = req.held, None
            for out in held:
                self._take(out, deltas, to_abort)

    def _choice_of(self, engine_request_id: str) -> tuple[_Request, _Choice] | None:
        """The choice an output of `engine_request_id` belongs to; None when it belongs to
        none (an unknown id, a lost attempt, or an older dispatch attempt than one seen)."""
        found = self.by_engine_id.get(engine_request_id)
        attempt = 0
        if found is None:
            split = split_dispatch_request_id(engine_request_id)
            if split is None:
                return None
            base, attempt = split
            found = self.by_engine_id.get(base)
            if found is None:
                return None
        choice = found[1]
        if attempt < choice.dispatch_attempt:
            return None
        if attempt > choice.dispatch_attempt:
            choice.dispatch_attempt = attempt
            choice.pending.clear()  # an older attempt's, ahead of what the client has
        return found

    def _apply(
        self,
        req: _Request,
        choice: _Choice,
        out: worker_pb2.RequestOutput,
        to_abort: list[str],
    ) -> ChoiceDelta:
        tokens = list(out.new_token_ids)
        first = choice.next_index == 0
        if first and choice.params.prompt_logprobs is not None and choice is req.choices[0]:
            req.prompt_logprobs = [logprobs_from_proto(lp) for lp in out.prompt_logprobs]
        choice.next_index += len(tokens)
        choice.token_ids += tokens
        req.num_cached_tokens = max(req.num_cached_tokens, out.num_cached_tokens)
        logprobs: list[Logprobs] | None = None
        if choice.params.logprobs is not None and out.logprobs:
            logprobs = [logprobs_from_proto(lp) for lp in out.logprobs]
        output = choice.output
        finish = FINISH_FROM_PROTO.get(out.finish_reason)
        stop_token = None
        if finish is not None and out.HasField("stop_token_id"):
            stop_token = out.stop_token_id
        if output.update(tokens, finish, stop_token):
            to_abort.append(choice.request_id)
        if output.finished:
            self.by_engine_id.pop(choice.request_id, None)
        return ChoiceDelta(
            index=choice.index,
            text=output.take_text(),
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            prompt_logprobs=req.prompt_logprobs if first else None,
        )

    def _on_failed(self, msg: Failed) -> None:
        for engine_id in msg.engine_request_ids:
            found = self.by_engine_id.get(engine_id)
            if found is not None:
                self._choice_failed(found[0], found[1], msg.error, msg.migratable)

    def _choice_failed(
        self, req: _Request, choice: _Choice, error: FrontendError, migratable: bool = True
    ) -> None:
        """Migrate the choice if its worker was lost and it may still move; else fail it."""
        if self.requests.get(req.request_id) is not req:
            return
        migration = self._migration(choice, error) if migratable else None
        if migration is None:
            if choice.migrations and error.code == grpc.StatusCode.UNAVAILABLE:
                error = FrontendError(
                    error.code, f"{error.message} (after {choice.migrations} migrations)"
                )
            self._fail(req, error)
            return
        old = choice.request_id
        self.by_engine_id.pop(old, None)
        choice.request_id = migration.request.request_id
        choice.index_offset = choice.next_index
        choice.pending.clear()  # the lost attempt's, ahead of what the client has
        choice.dispatch_attempt = 0
        choice.migrations += 1
        self.num_migrations += 1
        self.by_engine_id[choice.request_id] = (req, choice)
        logger.info(
            "%s: %s; migrating after %d tokens as %s (migration %d of %d)",
            old,
            error.message,
            choice.next_index,
            choice.request_id,
            choice.migrations,
            self.migration_limit,
        )
        assert self._migrate is not None
        self._migrate(migration)

    def _migration(self, choice: _Choice, error: FrontendError) -> Migration | None:
        """The continuation of `choice`, or None when it may not migrate."""
        if (
            error.code != grpc.StatusCode.UNAVAILABLE
            or self._migrate is None
            or choice.base is None
            or choice.output.finished
            or choice.migrations >= self.migration_limit
        ):
            return None
        base = choice.base
        k = len(choice.token_ids)
        params = common_pb2.SamplingParams()
        params.CopyFrom(base.sampling_params)
        if params.HasField("max_tokens"):
            if params.max_tokens - k < 1:
                return None
            params.max_tokens -= k
        if params.HasField("min_tokens"):
            params.min_tokens = max(params.min_tokens - k, 0)
        if k:
            params.ClearField("prompt_logprobs")  # the first output brought them
        request = common_pb2.EngineRequest()
        request.CopyFrom(base)
        request.request_id = migration_request_id(base.request_id, choice.migrations + 1)
        request.prompt_token_ids.extend(choice.token_ids)
        request.sampling_params.CopyFrom(params)
        return Migration(choice.request_id, request, k)

    def _fail(self, req: _Request, error: FrontendError) -> None:
        if self.requests.get(req.request_id) is not req:
            return
        running = self._drop(req.request_id)
        if running:
            self._abort(running)
        req.queue.put_nowait(StepEvent(error=error))

    def _drop(self, request_id: str) -> list[str]:
        req = self.requests.get(request_id)
        if req is None:
            return []
        running = [c.request_id for c in req.choices if not c.output.finished]
        self._forget(req)
        return running

    def _forget(self, req: _Request) -> None:
        self.requests.pop(req.request_id, None)
        for c in req.choices:
            self.by_engine_id.pop(c.request_id, None)


def _one_per_choice(batch: list[ChoiceDelta]) -> list[ChoiceDelta]:
    """One delta per choice, in the order choices first appear: an output that arrived ahead
    of its turn (`_Choice.pending`) is applied right after the one it waited for, and their
    deltas are joined (`ChoiceDelta.then`). Two entries of one choice in a single chunk (a
    stream's `choices` list) are not what OpenAI clients expect: one reading `choices[0]`
    lost the first entry's text (a stream read " and I a professional" for " and I'm a
    professional", CI 2026-12-04)."""
    if len(batch) == 1:
        return batch  # the usual case: one output per request a step
    merged: dict[int, ChoiceDelta] = {}
    for d in batch:
        before = merged.get(d.index)
        merged[d.index] = d if before is None else before.then(d)
    return list(merged.values())
