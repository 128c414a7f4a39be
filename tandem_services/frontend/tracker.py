"""`RequestTracker`: the one owner of every in-flight request's client-side state.

Worker output streams, scheduler events and request handlers all talk to it by message. Per
request it keeps one `ChoiceOutput` per choice (the per-choice state machine shared with the
offline API, tandem.engine.output_state: incremental detokenization, stop strings, finish
reasons), orders outputs by `output_index` (the first token comes from the prefill worker,
the rest from the decode worker, on two streams), and puts one `StepEvent` per incoming step
on the request's queue, which its handler drains. A request the engine ends as the request's
own fault (`invalid_request`: a structured-output spec that does not compile) fails with
INVALID_ARGUMENT (HTTP 400), other failures with UNAVAILABLE.
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
from tandem_services.frontend.types import ChoiceDelta, FrontendError, StepEvent, Usage

logger = logging.getLogger(__name__)


@dataclass
class _Choice:
    request_id: str
    index: int
    params: SamplingParams
    output: ChoiceOutput
    next_index: int = 0
    # Outputs that arrived ahead of `next_index`.
    pending: dict[int, worker_pb2.RequestOutput] = field(default_factory=dict)


@dataclass
class _Request:
    request_id: str
    num_prompt_tokens: int
    choices: list[_Choice]
    queue: asyncio.Queue[StepEvent]
    num_cached_tokens: int = 0

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


@dataclass
class Outputs:
    step: worker_pb2.StepOutputs


@dataclass
class Failed:
    """Engine requests that ended with an error (worker lost, submit refused)."""

    engine_request_ids: list[str]
    error: FrontendError


@dataclass
class Cancel:
    """The client went away (or the submit failed): forget the request, abort what runs."""

    request_id: str


@dataclass
class Count(Ask[int]):
    pass


TrackerMessage = Register | Outputs | Failed | Cancel | Count


class RequestTracker(Actor[TrackerMessage]):
    def __init__(self, tokenizer: Any, abort: Callable[[list[str]], None]) -> None:
        super().__init__("request-tracker")
        self.tokenizer = tokenizer
        self._abort = abort
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

    def _register(self, msg: Register) -> asyncio.Queue[StepEvent]:
        if msg.request_id in self.requests:
            raise FrontendError(
                grpc.StatusCode.ALREADY_EXISTS, f"request id {msg.request_id!r} is in flight"
            )
        choices = []
        for i, (engine_id, params) in enumerate(msg.choices):
            output = ChoiceOutput(self.tokenizer, msg.prompt_token_ids, params)
            choices.append(_Choice(engine_id, i, params, output))
        req = _Request(msg.request_id, len(msg.prompt_token_ids), choices, asyncio.Queue())
        self.requests[msg.request_id] = req
        for c in choices:
            self.by_engine_id[c.request_id] = (req, c)
        return req.queue

    def _on_outputs(self, step: worker_pb2.StepOutputs) -> None:
        deltas: dict[str, list[ChoiceDelta]] = {}
        to_abort: list[str] = []
        for out in step.outputs:
            found = self.by_engine_id.get(out.request_id)
            if found is None:
                continue
            req, choice = found
            if out.output_index > choice.next_index:
                choice.pending[out.output_index] = out
                continue
            if out.output_index < choice.next_index:
                continue  # a duplicate
            if out.invalid_request:
                # The engine could not run it (its structured-output spec does not compile,
                # or not in time): the client's request is at fault, 400 naming the problem.
                message = out.error or "the request's output constraint could not be compiled"
                self._fail(req, FrontendError(grpc.StatusCode.INVALID_ARGUMENT, message))
                continue
            if out.finish_reason == common_pb2.FINISH_REASON_ABORT and out.error:
                self._fail(req, FrontendError(grpc.StatusCode.UNAVAILABLE, out.error))
                continue
            batch = deltas.setdefault(req.request_id, [])
            while True:
                batch.append(self._apply(req, choice, out, to_abort))
                if choice.output.finished:
                    break
                nxt = choice.pending.pop(choice.next_index, None)
                if nxt is None:
                    break
                out = nxt
        for request_id, batch in deltas.items():
            req = self.requests.get(request_id)
            if req is None:
                continue
            event = StepEvent(deltas=batch)
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

    def _apply(
        self,
        req: _Request,
        choice: _Choice,
        out: worker_pb2.RequestOutput,
        to_abort: list[str],
    ) -> ChoiceDelta:
        tokens = list(out.new_token_ids)
        choice.next_index += len(tokens)
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
        )

    def _on_failed(self, msg: Failed) -> None:
        for engine_id in msg.engine_request_ids:
            found = self.by_engine_id.get(engine_id)
            if found is not None:
                self._fail(found[0], msg.error)

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
