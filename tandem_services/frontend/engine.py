"""`FrontendEngine`: what both APIs call to generate, plus the frontend's links to the
scheduler (submit, abort, worker-set and failure events) and to every worker (one output
stream each)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from tandem.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from tandem.engine.output_state import child_params, child_request_id
from tandem.sampling_params import SamplingParams, SamplingParamsError
from tandem_protos.v1 import (
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tandem_services.common.convert import sampling_params_to_proto
from tandem_services.common.server import (
    PLAINTEXT,
    RETRY_AFTER_KEY,
    TlsConfig,
    channel,
)
from tandem_services.frontend.health import Readiness, readiness
from tandem_services.frontend.limits import RequestLimits, check_prompt_work
from tandem_services.frontend.tool_parsers import render_tool_calls
from tandem_services.frontend.tracker import (
    Cancel,
    Count,
    FailAll,
    Failed,
    Migration,
    Outputs,
    Register,
    RequestTracker,
)
from tandem_services.frontend.types import (
    DEFAULT_PROMPT_OPTIONS,
    DEFAULT_TEMPLATE,
    ChatTemplateOptions,
    FrontendError,
    GenerateInput,
    PromptOptions,
    StepEvent,
    invalid,
)

logger = logging.getLogger(__name__)

_CODES = {c.value[0]: c for c in grpc.StatusCode}
# Texts longer than this are tokenized off the event loop.
_LONG_TEXT_CHARS = 20_000


def merge_queued(event: StepEvent, queue: asyncio.Queue[StepEvent]) -> list[StepEvent]:
    """`event` and whatever else the request's queue holds now, merged into one event (so a
    handler that fell behind sends one chunk, one write, for all of it), followed by an
    error event if one was queued (its deltas before it are sent first, as they came)."""
    if event.error is not None or queue.empty():
        return [event]
    merged = StepEvent(deltas=list(event.deltas), usage=event.usage)
    by_index = {d.index: i for i, d in enumerate(merged.deltas)}
    while not queue.empty():
        nxt = queue.get_nowait()
        if nxt.error is not None:
            return [merged, nxt]
        for d in nxt.deltas:
            i = by_index.get(d.index)
            if i is None:
                by_index[d.index] = len(merged.deltas)
                merged.deltas.append(d)
            else:
                merged.deltas[i] = merged.deltas[i].then(d)
        if nxt.usage is not None:
            merged.usage = nxt.usage
    return [merged]


def _calls_in_content(message: dict[str, Any], tool_format: str | None) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    text = render_tool_calls(
        tool_format,
        [(c["function"]["name"], json.dumps(c["function"]["arguments"])) for c in calls],
    )
    content = message.get("content") or ""
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = f"{content}\n{text}" if content else text
    return out


def retry_after_of(exc: grpc.aio.AioRpcError) -> int | None:
    """The retry hint (whole seconds) in a refusal's trailing metadata, if any."""
    for key, value in exc.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY and isinstance(value, str) and value.isdigit():
            return int(value)
    return None


@dataclass(frozen=True)
class ClusterView:
    """The workers the scheduler announced last (an immutable snapshot)."""

    workers: tuple[scheduler_pb2.WorkerInfo, ...] = ()

    @property
    def max_model_len(self) -> int:
        """The context of the served model (0 while no worker is known)."""
        lens = [w.max_model_len for w in self.workers if w.max_model_len > 0]
        return min(lens) if lens else 0


class FrontendEngine:
    def __init__(
        self,
        frontend_id: str,
        scheduler_address: str,
        tokenizer: Any,
        model_id: str,
        rpc_timeout_s: float = 30.0,
        tls: TlsConfig = PLAINTEXT,
        migration_limit: int = 0,
        sampling_defaults: Mapping[str, Any] | None = None,
    ) -> None:
        """`migration_limit`: how many times one choice may move to another worker when its
        worker is lost (tracker.py: Migration); 0 fails it instead. `sampling_defaults`: the
        model's default sampling parameters (tandem.loader.sampling_defaults), for the fields
        a request leaves out (both APIs read them here); their `max_tokens` (the model's
        `max_new_tokens`) is not a default but a cap on every request's output
        (`max_tokens_cap`, vLLM's rule)."""
        self.frontend_id = frontend_id
        self.sampling_defaults = dict(sampling_defaults or {})
        self.max_tokens_cap: int | None = self.sampling_defaults.pop("max_tokens", None)
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.rpc_timeout_s = rpc_timeout_s
        self.tls = tls
        self._channel = channel(scheduler_address, tls)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self.tracker = RequestTracker(
            tokenizer, self._abort_soon, self._migrate_soon, migration_limit
        )
        self.cluster = ClusterView()
        self.draining = False
        self._ids = itertools.count()
        self._streams: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._watch_task: asyncio.Task[None] | None = None
        # Set while the announced workers can serve a request (health.py: Readiness.ok).
        self.serving = asyncio.Event()

    async def start(self) -> None:
        self.tracker.start()
        self._watch_task = asyncio.create_task(self._watch(), name="scheduler-watch")

    async def close(self) -> None:
        tasks = [self._watch_task, *self._streams.values(), *self._tasks]
        for task in tasks:
            if task is not None:
                task.cancel()
        for task in tasks:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self.tracker.stop()
        await self._channel.close()

    def readiness(self) -> Readiness:
        """Whether a request can be served now, from the last announced worker set."""
        return readiness(self.cluster.workers, self.draining)

    async def num_inflight(self) -> int:
        return await self.tracker.ask(Count())

    async def fail_inflight(self, message: str) -> int:
        """End every request in flight with UNAVAILABLE `message` (aborted on the workers);
        returns how many there were."""
        return await self.tracker.ask(
            FailAll(FrontendError(grpc.StatusCode.UNAVAILABLE, message, retry_after_s=1))
        )

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{self.frontend_id}-{next(self._ids)}"

    # ------------------------------------------------------------------ inputs

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        def run() -> list[int]:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

        if len(text) > _LONG_TEXT_CHARS:
            return await asyncio.to_thread(run)
        return run()

    async def decode(self, token_ids: list[int], param: str = "tokens") -> str:
        """The text of `token_ids` (special tokens kept), each id checked against the
        vocabulary (400 naming `param`)."""
        vocab = len(self.tokenizer)
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):
            raise invalid(f"{param} must be token ids in [0, {vocab})", param)

        def run() -> str:
            return str(self.tokenizer.decode(token_ids))

        if len(token_ids) > _LONG_TEXT_CHARS // 4:
            return await asyncio.to_thread(run)
        return run()

    async def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tool_format: str | None = None,
        options: ChatTemplateOptions = DEFAULT_TEMPLATE,
        add_special_tokens: bool = False,
    ) -> tuple[str, list[int]]:
        """The chat template's text (the generation prompt added, or the final message left
        open, as `options` say) and its token ids (`add_special_tokens`: the tokenizer's own
        around the template's text, which normally writes them itself).

        `tools` go to the template (transformers' `apply_chat_template(tools=...)`). A
        template that does not render an assistant's `tool_calls` gets them written into the
        message's content in `tool_format`'s text (a --tool-call-parser name; Hermes tags by
        default), so the model still sees the calls it made."""
        template = self.tokenizer.chat_template
        if isinstance(template, str) and "tool_calls" not in template:
            messages = [_calls_in_content(m, tool_format) for m in messages]
        kwargs: dict[str, Any] = {**options.kwargs, **({"tools": tools} if tools else {})}
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages),
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                tokenize=False,
                **kwargs,
            )
        except Exception as exc:  # the template rejects the conversation
            raise invalid(f"the chat template cannot render these messages: {exc}") from exc
        return text, await self.encode(text, add_special_tokens=add_special_tokens)

    def inputs(
        self,
        prompts: Sequence[tuple[list[int], str | None]],
        params: SamplingParams,
        max_tokens: int | None,
        limits: RequestLimits,
        *,
        kind: str,
        priority: int = 0,
        param_prefix: str = "",
        options: PromptOptions = DEFAULT_PROMPT_OPTIONS,
    ) -> list[GenerateInput]:
        """The engine-facing inputs of a request whose fields passed their one-pass check
        (openai_protocol.py, grpc_api.py), one per tokenized prompt (ids, text); what needs
        the tokens is checked here, once, in this order (400 naming the field):

        - `options.truncate_prompt_tokens`: within the context, each prompt cut to its last
          k tokens (a cut prompt's text is then None: echo decodes its ids);
        - prompt tokens x n, summed over the prompts, against the limit (limits.py);
        - the logits processors' token ids against the vocabulary (`param_prefix` + the
          field), their bad words tokenized;
        - each prompt: not empty, its ids in the vocabulary, shorter than the context, and
          with `max_tokens` (None: the rest of the context, when it is known) within it.
        """
        if options.truncate_prompt_tokens is not None:
            prompts = self._truncated(prompts, options.truncate_prompt_tokens)
        check_prompt_work(limits, [len(ids) for ids, _ in prompts], params.n)
        if params.bad_words:
            params = params.clone(bad_words_token_ids=None)
            params.update_from_tokenizer(self.tokenizer)
        vocab = len(self.tokenizer)
        try:
            params.check_vocab(vocab)
        except SamplingParamsError as exc:
            raise invalid(str(exc), param_prefix + str(exc).split(":", 1)[0]) from None
        return [
            GenerateInput(
                self.new_request_id(kind),
                ids,
                params.clone(max_tokens=self._max_tokens(ids, max_tokens, vocab)),
                text,
                priority,
                options.cache_salt,
            )
            for ids, text in prompts
        ]

    def _truncated(
        self, prompts: Sequence[tuple[list[int], str | None]], k: int
    ) -> list[tuple[list[int], str | None]]:
        """Each prompt's last `k` tokens (-1: the model's context); 400 when `k` is over it."""
        limit = self.cluster.max_model_len
        if k == -1:
            if not limit:
                return list(prompts)
            k = limit
        if limit and k > limit:
            raise invalid(
                f"truncate_prompt_tokens ({k}) exceeds the model's context ({limit} tokens)",
                "truncate_prompt_tokens",
            )
        return [(ids[-k:], None) if len(ids) > k else (ids, text) for ids, text in prompts]

    def _max_tokens(
        self, token_ids: Sequence[int], max_tokens: int | None, vocab: int
    ) -> int | None:
        """A prompt's ids against the vocabulary and its length against the context; returns
        max_tokens, filled in to the rest of the context when it was None (and the context
        is known), at most `max_tokens_cap`."""
        max_tokens = self._checked_max_tokens(token_ids, max_tokens, vocab)
        cap = self.max_tokens_cap
        if cap is None:
            return max_tokens
        return cap if max_tokens is None else min(max_tokens, cap)

    def _checked_max_tokens(
        self, token_ids: Sequence[int], max_tokens: int | None, vocab: int
    ) -> int | None:
        if not token_ids:
            raise invalid("prompt is empty", "prompt")
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise invalid(f"prompt token ids must be in [0, {vocab})", "prompt")
        limit = self.cluster.max_model_len
        if not limit:
            return max_tokens
        n = len(token_ids)
        if n >= limit:
            raise invalid(
                f"prompt has {n} tokens; the model's context is {limit} tokens, and at least "
                "one must remain for output",
                "prompt",
            )
        if max_tokens is None:
            return limit - n
        if n + max_tokens > limit:
            raise invalid(
                f"prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds the model's "
                f"context ({limit} tokens)",
                "max_tokens",
            )
        return max_tokens

    # ------------------------------------------------------------------ generate

    async def generate(self, inp: GenerateInput) -> AsyncIterator[StepEvent]:
        """Stream a request's events; the last has `usage`. Raises FrontendError. Closing the
        iterator early aborts the request everywhere."""
        if self.draining:
            raise FrontendError(
                grpc.StatusCode.UNAVAILABLE, "the frontend is shutting down", retry_after_s=1
            )
        n = inp.params.n
        choices = [
            (child_request_id(inp.request_id, i, n), child_params(inp.params, i)) for i in range(n)
        ]
        requests = tuple(self._engine_request(inp, rid, p) for rid, p in choices)
        queue = await self.tracker.ask(
            Register(inp.request_id, inp.prompt_token_ids, choices, requests)
        )
        done = False
        try:
            await asyncio.gather(*(self._submit_or_fail(r) for r in requests))
            while True:
                for event in merge_queued(await queue.get(), queue):
                    if event.error is not None:
                        done = True
                        raise event.error
                    done = event.finished
                    yield event
                    if done:
                        return
        finally:
            if not done:
                self.tracker.tell(Cancel(inp.request_id))

    async def beam_search(self, inp: GenerateInput, params: BeamSearchParams) -> BeamSearchOutput:
        """vLLM's beam search over the services (tandem.engine.beam_search): each step runs
        every live beam as a one-token request (`generate`) with the top 2 x width logprobs,
        concurrently; the workers' prefix cache gives each beam its earlier blocks back."""
        search = BeamSearch([inp.prompt_token_ids], params, self.tokenizer.eos_token_id)
        while batch := search.pending():
            found = await asyncio.gather(
                *(self._candidates(inp, ids, search.step_params) for ids in batch)
            )
            search.advance(found)
        [out] = search.outputs(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
        return out

    async def _candidates(
        self, inp: GenerateInput, token_ids: list[int], params: SamplingParams
    ) -> list[tuple[int, float]]:
        """One beam's next-token candidates: its one-token request's top logprobs."""
        one = GenerateInput(
            self.new_request_id("beam"), token_ids, params, None, inp.priority, inp.cache_salt
        )
        found: dict[int, float] = {}
        async for event in self.generate(one):
            for d in event.deltas:
                for lp in d.logprobs or ():
                    found.update(zip(lp.token_ids, lp.logprobs, strict=True))
        return list(found.items())

    @staticmethod
    def _engine_request(
        inp: GenerateInput, engine_id: str, params: Any
    ) -> common_pb2.EngineRequest:
        request = common_pb2.EngineRequest(
            request_id=engine_id,
            prompt_token_ids=inp.prompt_token_ids,
            sampling_params=sampling_params_to_proto(params),
            priority=inp.priority,
        )
        if inp.cache_salt is not None:
            request.cache_salt = inp.cache_salt
        return request

    async def _submit_or_fail(self, request: common_pb2.EngineRequest) -> None:
        """Submit; a refusal reaches the request's queue as its error (through the tracker,
        which ignores it if the choice has meanwhile moved to another attempt)."""
        try:
            await self._submit(request)
        except FrontendError as exc:
            self.tracker.tell(Failed([request.request_id], exc, migratable=False))

    async def _submit(self, request: common_pb2.EngineRequest) -> None:
        try:
            await self.scheduler.Submit(
                scheduler_pb2.SubmitRequest(request=request, destination=self.frontend_id)
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.ALREADY_EXISTS:
                code = grpc.StatusCode.INVALID_ARGUMENT
            raise FrontendError(
                code, exc.details() or code.name, retry_after_s=retry_after_of(exc)
            ) from None

    def _migrate_soon(self, migration: Migration) -> None:
        self._spawn(self._migrate(migration))

    async def _migrate(self, migration: Migration) -> None:
        """Abort the lost attempt wherever it may still be (the other worker of a disaggregated
        pair), then submit the continuation; a refusal fails the choice (tracker: Failed)."""
        await self._abort([migration.old_request_id])
        try:
            await self._submit(migration.request)
        except FrontendError as exc:
            self.tracker.tell(Failed([migration.request.request_id], exc, migratable=False))

    def _abort_soon(self, engine_request_ids: list[str]) -> None:
        self._spawn(self._abort(engine_request_ids))

    async def _abort(self, engine_request_ids: list[str]) -> None:
        try:
            await self.scheduler.Abort(
                common_pb2.AbortRequest(request_ids=engine_request_ids),
                timeout=self.rpc_timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            logger.warning("abort of %d requests failed: %s", len(engine_request_ids), exc.code())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ links

    async def _watch(self) -> None:
        """The one owner of `cluster` and the worker streams: follows the scheduler's events."""
        backoff = 0.1
        request = scheduler_pb2.WatchEventsRequest(destination=self.frontend_id)
        while True:
            try:
                async for event in self.scheduler.WatchEvents(request):
                    backoff = 0.1
                    if event.HasField("workers"):
                        self._sync_workers(tuple(event.workers.workers))
                    elif event.HasField("failed"):
                        f = event.failed
                        code = _CODES.get(f.code, grpc.StatusCode.UNAVAILABLE)
                        self.tracker.tell(
                            Failed(list(f.request_ids), FrontendError(code, f.message))
                        )
            except grpc.aio.AioRpcError as exc:
                logger.debug("scheduler event stream: %s", exc.code().name)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def _sync_workers(self, workers: tuple[scheduler_pb2.WorkerInfo, ...]) -> None:
        self.cluster = ClusterView(workers)
        addresses = {w.address for w in workers}
        for address in list(self._streams):
            if address not in addresses:
                self._streams.pop(address).cancel()
        for address in addresses - set(self._streams):
            self._streams[address] = asyncio.create_task(
                self._stream_outputs(address), name=f"outputs-{address}"
            )
        if readiness(workers).ok:
            self.serving.set()
        else:
            self.serving.clear()

    async def _stream_outputs(self, address: str) -> None:
        ch = channel(address, self.tls)
        stub = worker_pb2_grpc.WorkerStub(ch)
        request = worker_pb2.StreamOutputsRequest(destination=self.frontend_id)
        backoff = 0.05
        try:
            while True:
                try:
                    async for step in stub.StreamOutputs(request):
                        backoff = 0.05
                        self.tracker.tell(Outputs(step))
                except grpc.aio.AioRpcError as exc:
                    logger.debug("output stream from %s: %s", address, exc.code().name)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
        finally:
            await ch.close()
