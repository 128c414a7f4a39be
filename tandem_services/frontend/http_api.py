"""The OpenAI-compatible HTTP API (Starlette): /v1/completions, /v1/chat/completions,
/v1/models (behind the API key, and 503 with Retry-After until /health would be 200), and
/health, /ready (health.py), /metrics (Prometheus text).
Streaming responses are server-sent events ending in `data: [DONE]`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tandem import __version__ as tandem_version
from tandem.engine.beam_search import BeamSearchOutput, BeamSearchParams
from tandem.sampling_params import SamplingParams
from tandem_protos.v1 import scheduler_pb2
from tandem_services.frontend.auth import api_key_matches
from tandem_services.frontend.engine import FrontendEngine
from tandem_services.frontend.health import readiness, require_serving
from tandem_services.frontend.limits import RequestLimits
from tandem_services.frontend.openai_protocol import (
    ChatBody,
    ChoiceAccumulator,
    TokenIdText,
    TokenText,
    chat_logprobs,
    error_body,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
    prompt_logprobs_body,
)
from tandem_services.frontend.response_store import ResponseStore, StoredResponse
from tandem_services.frontend.responses import (
    ResponseBuilder,
    ResponsesStream,
    chat_request,
    previous_response_id,
    response_id,
)
from tandem_services.frontend.sse import DONE, ChatStream, CompletionStream, sse, with_usage
from tandem_services.frontend.tool_parsers import (
    AUTO_TOOL_PARSERS,
    ToolCallExtractor,
    parser_factory,
)
from tandem_services.frontend.types import FrontendError, GenerateInput, StepEvent, Usage, invalid

_READY_TIMEOUT_S = 2.0
# How long a request waits for the deployment to become ready before its 503.
_NOT_READY_WAIT_S = 0.5
# A JSON escape of a UTF-16 surrogate (\uD800-\uDFFF): the one way a body that is valid UTF-8
# carries one. A pair is one character; a lone one is not text (I-JSON, RFC 7493, refuses it)
# and would fail the tokenizer or protobuf's UTF-8 strings later, as a 500.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_TOO_DEEP = "malformed JSON body: its arrays and objects nest too deeply"


def _error_response(exc: FrontendError) -> JSONResponse:
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    return JSONResponse(
        error_body(exc.message, exc.http_status, exc.param),
        status_code=exc.http_status,
        headers=headers,
    )


async def _merge(
    engine: FrontendEngine, inputs: list[GenerateInput]
) -> AsyncIterator[tuple[int, StepEvent]]:
    """Events of several requests as they come, tagged with the request's position."""
    if len(inputs) == 1:
        async for event in engine.generate(inputs[0]):
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, StepEvent | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, inp: GenerateInput) -> None:
        try:
            async for event in engine.generate(inp):
                queue.put_nowait((i, event))
            queue.put_nowait((i, None))
        except Exception as exc:
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, inp)) for i, inp in enumerate(inputs)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _with_param(
    events: AsyncIterator[tuple[int, StepEvent]], param: str | None
) -> AsyncIterator[tuple[int, StepEvent]]:
    """`events`, with a 400 the engine raised (an output constraint that does not compile)
    naming the request field the constraint came from."""
    try:
        async for item in events:
            yield item
    except FrontendError as exc:
        if exc.http_status == 400 and exc.param is None and param is not None:
            exc.param = param
        raise
    finally:
        await events.aclose()  # type: ignore[attr-defined]


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _refuse_lone_surrogates(data: dict[str, Any]) -> None:
    """A 400 naming the top-level field whose strings (keys included) hold a lone UTF-16
    surrogate; nothing for a body whose surrogates all pair up."""
    for key, value in data.items():
        try:
            json.dumps({key: value}, ensure_ascii=False).encode("utf-8")
        except RecursionError:
            raise invalid(_TOO_DEEP) from None
        except UnicodeEncodeError as exc:
            name = key.encode("utf-8", "backslashreplace").decode("utf-8")
            raise invalid(
                f"{name} holds a lone UTF-16 surrogate ({ascii(exc.object[exc.start])[1:-1]}), "
                "which is not text: send a character as UTF-8 or as an escaped surrogate pair",
                name,
            ) from None


async def _unless_disconnected(request: Request, coro: Any) -> Any:
    """Run `coro`; cancel it (aborting its requests) if the client disconnects first."""
    work = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait([work, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not work.done():
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        raise FrontendError(grpc.StatusCode.CANCELLED, "client disconnected")
    return work.result()


class HttpApi:
    def __init__(
        self,
        engine: FrontendEngine,
        api_key: str,
        max_body_bytes: int,
        model_ids: list[str],
        limits: RequestLimits | None = None,
        tool_call_parser: str | None = None,
        metrics_registry: CollectorRegistry | None = None,
        responses_store_size: int = 0,
    ) -> None:
        """`tool_call_parser`: the format tool_choice "auto" parses (set only with
        --enable-auto-tool-choice; None refuses "auto"). `responses_store_size`: the
        Responses API's stored responses (response_store.py; 0: none)."""
        self.engine = engine
        self.response_store = ResponseStore(responses_store_size)
        self.metrics_registry = metrics_registry
        self.limits = limits or RequestLimits()
        self.tool_call_parser = tool_call_parser
        # The auto parser's tags are special tokens: keep them in the text it parses.
        specials = set(getattr(engine.tokenizer, "all_special_tokens", ()) or ())
        tags = AUTO_TOOL_PARSERS[tool_call_parser].TAGS if tool_call_parser else ()
        self.keep_tool_tags = bool(specials & set(tags))
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.model_ids = model_ids
        self.token_text = TokenText(engine.tokenizer)
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/v1/models", self._guard(self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", self._guard(self.model), methods=["GET"]),
            Route("/v1/completions", self._guard(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._guard(self.chat), methods=["POST"]),
            Route("/v1/responses", self._guard(self.responses), methods=["POST"]),
            Route(
                "/v1/responses/{response_id}",
                self._guard(self.stored_response, serving=False),
                methods=["GET", "DELETE"],
            ),
            # The frontend's own tokenizer: no worker needed, so no 503 before one serves.
            Route("/tokenize", self._guard(self.tokenize, serving=False), methods=["POST"]),
            Route("/detokenize", self._guard(self.detokenize, serving=False), methods=["POST"]),
            Route("/version", self.version, methods=["GET"]),
        ]
        if self.metrics_registry is not None:
            routes.append(Route("/metrics", self.metrics, methods=["GET"]))
        return Starlette(routes=routes)

    def _guard(
        self, handler: Callable[[Request], Any], serving: bool = True
    ) -> Callable[[Request], Any]:
        """`handler` behind the API key and, where it needs the workers (`serving`), answering
        503 with Retry-After until a request can be served (health.py: require_serving)."""

        async def run(request: Request) -> Response:
            try:
                if self.api_key:
                    auth = request.headers.get("authorization", "")
                    if not api_key_matches(auth, self.api_key):
                        raise FrontendError(
                            grpc.StatusCode.UNAUTHENTICATED,
                            "missing or wrong API key (Authorization: Bearer <key>)",
                        )
                if serving:
                    await self._require_serving()
                return await handler(request)
            except FrontendError as exc:
                return _error_response(exc)

        return run

    async def _require_serving(self) -> None:
        """503 with Retry-After unless a request can be served. A request that arrives just
        before the scheduler's worker-set update (a worker registered a moment ago) waits for
        it up to `_NOT_READY_WAIT_S` rather than being refused."""
        state = self.engine.readiness()
        if not state.ok and not state.draining:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.engine.serving.wait(), _NOT_READY_WAIT_S)
            state = self.engine.readiness()
        require_serving(state)

    # ------------------------------------------------------------------ plumbing

    async def _read_json(self, request: Request) -> dict[str, Any]:
        limit = self.max_body_bytes
        body = bytearray()
        too_big = False
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                too_big = True  # keep reading (and dropping) so the client sees our answer
            else:
                body += chunk
        if too_big:
            raise invalid(f"request body is {size} bytes; the limit is {limit} bytes")
        try:
            data = json.loads(body)
        except ValueError as exc:
            raise invalid(f"malformed JSON body: {exc}") from None
        except RecursionError:
            raise invalid(_TOO_DEEP) from None
        if not isinstance(data, dict):
            raise invalid("the JSON body must be an object")
        if _SURROGATE_ESCAPE.search(body):
            _refuse_lone_surrogates(data)
        return data

    def _check_model(self, model: str | None) -> str:
        if model is None or model == "":
            return self.model_ids[0]
        if model not in self.model_ids:
            raise invalid(
                f"model {model!r} is not served here; available: {', '.join(self.model_ids)}",
                "model",
            )
        return model

    # ------------------------------------------------------------------ routes

    async def health(self, request: Request) -> Response:
        """200 when the workers the scheduler last announced cover every role (health.py)."""
        state = self.engine.readiness()
        return JSONResponse(state.body(), status_code=200 if state.ok else 503)

    async def ready(self, request: Request) -> Response:
        """200 when the scheduler, asked now, lists serving workers for every role."""
        workers: list[scheduler_pb2.WorkerInfo] = []
        error = ""
        try:
            reply = await self.engine.scheduler.ListWorkers(
                scheduler_pb2.ListWorkersRequest(), timeout=_READY_TIMEOUT_S
            )
            workers = list(reply.workers)
        except grpc.aio.AioRpcError as exc:
            error = exc.code().name
        state = readiness(workers, self.engine.draining, error)
        return JSONResponse(state.body(), status_code=200 if state.ok else 503)

    async def metrics(self, request: Request) -> Response:
        """Prometheus text of the frontend's registry, here on the API port as well."""
        assert self.metrics_registry is not None
        return Response(generate_latest(self.metrics_registry), media_type=CONTENT_TYPE_LATEST)

    def _card(self, model_id: str) -> dict[str, Any]:
        return {
            "id": model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "tandem",
            "max_model_len": self.engine.cluster.max_model_len or None,
        }

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card(m) for m in self.model_ids]})

    async def model(self, request: Request) -> Response:
        """OpenAI's GET /v1/models/{model} (`client.models.retrieve`): the model's card, or
        404 naming what is served."""
        model_id = request.path_params["model"]
        if model_id not in self.model_ids:
            raise FrontendError(
                grpc.StatusCode.NOT_FOUND,
                f"model {model_id!r} is not served here; available: {', '.join(self.model_ids)}",
                "model",
            )
        return JSONResponse(self._card(model_id))

    async def completions(self, request: Request) -> Response:
        defaults = self.engine.sampling_defaults
        body = parse_completion(await self._read_json(request), self.limits, defaults)
        model = self._check_model(body.model)
        special = body.prompt_options.special_tokens(True)
        encoded: list[tuple[list[int], str | None]] = []
        for prompt in body.prompts:
            if isinstance(prompt, str):
                encoded.append((await self.engine.encode(prompt, special), prompt))
            else:
                encoded.append((prompt, None))
        inputs = self.engine.inputs(
            encoded,
            body.params,
            body.params.max_tokens,
            self.limits,
            kind="cmpl",
            priority=body.priority,
            options=body.prompt_options,
        )
        # echo: each prompt's text (token ids decoded; as truncated) before its choices'
        # output.
        echo = (
            [
                inp.prompt_text
                if inp.prompt_text is not None
                else await self.engine.decode(inp.prompt_token_ids, "prompt")
                for inp in inputs
            ]
            if body.echo
            else None
        )
        token_text = TokenIdText() if body.tokens_as_ids else self.token_text
        prompt_ids = [inp.prompt_token_ids for inp in inputs]
        stream = CompletionStream(
            f"cmpl-{uuid.uuid4().hex}",
            int(time.time()),
            model,
            body.params.n,
            body.params.logprobs is not None,
            body.include_usage,
            token_text,
            echo,
            body.prompt_only,
            prompt_ids,
            body.return_token_ids,
        )
        if body.beam_length_penalty is not None:
            beams, usage = await _unless_disconnected(
                request, self._beams(inputs, body.params, body.beam_length_penalty)
            )
            choices = [
                {
                    "index": i * body.params.n + k,
                    "text": seq.text or "",
                    "logprobs": None,
                    "finish_reason": seq.finish_reason,
                    "stop_reason": None,
                    **(
                        {"prompt_token_ids": prompt_ids[i], "token_ids": generated}
                        if body.return_token_ids
                        else {}
                    ),
                }
                for i, out in enumerate(beams)
                for k, seq in enumerate(out.sequences)
                for generated in [seq.tokens[len(inputs[i].prompt_token_ids) :]]
            ]
            return JSONResponse(stream.chunk(choices, usage))
        if not body.stream:
            acc: dict[int, ChoiceAccumulator] = {}
            usage = await _unless_disconnected(
                request, self._collect(inputs, body.params.n, acc, body.structured_param)
            )
            choices = []
            for index in sorted(acc):
                a = acc[index]
                choice: dict[str, Any] = {
                    "index": index,
                    "text": (echo[index // body.params.n] if echo else "")
                    + ("" if body.prompt_only else a.text),
                    "logprobs": stream.logprobs(index, a.logprobs, a.prompt_logprobs)
                    if stream.want_logprobs
                    else None,
                    "finish_reason": a.finish_reason,
                    "stop_reason": a.stop_reason,
                }
                if body.show_prompt_logprobs:
                    choice["prompt_logprobs"] = prompt_logprobs_body(
                        a.prompt_logprobs or [], token_text
                    )
                if body.return_token_ids:
                    choice["prompt_token_ids"] = prompt_ids[index // body.params.n]
                    choice["token_ids"] = [] if body.prompt_only else a.token_ids or []
                choices.append(choice)
            return JSONResponse(stream.chunk(choices, usage))
        return await self._stream(
            inputs, stream.render, stream.final, body.structured_param, body.continuous_usage
        )

    async def chat(self, request: Request) -> Response:
        body = parse_chat(
            await self._read_json(request),
            self.limits,
            self.tool_call_parser,
            self.engine.sampling_defaults,
        )
        model = self._check_model(body.model)
        inputs, params = await self._chat_inputs(body)
        token_text = TokenIdText() if body.tokens_as_ids else self.token_text
        prompt_ids = inputs[0].prompt_token_ids if body.return_token_ids else None
        stream = ChatStream(
            f"chatcmpl-{uuid.uuid4().hex}",
            int(time.time()),
            model,
            body.params.logprobs is not None,
            body.include_usage,
            token_text,
            prompt_ids,
        )
        if body.beam_length_penalty is not None:
            beams, usage = await _unless_disconnected(
                request, self._beams(inputs, params, body.beam_length_penalty)
            )
            [out] = beams
            chat_choices = [
                {
                    "index": k,
                    "message": {"role": "assistant", "content": seq.text or ""},
                    "logprobs": None,
                    "finish_reason": seq.finish_reason,
                    "stop_reason": None,
                    **(
                        {"token_ids": seq.tokens[len(inputs[0].prompt_token_ids) :]}
                        if prompt_ids is not None
                        else {}
                    ),
                }
                for k, seq in enumerate(out.sequences)
            ]
            response = stream.chunk(chat_choices, usage, full=True)
            if prompt_ids is not None:
                response["prompt_token_ids"] = prompt_ids
            return JSONResponse(response)
        tools = self._tool_calls(body)
        if not body.stream:
            acc: dict[int, ChoiceAccumulator] = {}
            usage = await _unless_disconnected(
                request, self._collect(inputs, 1, acc, body.structured_param, tools)
            )
            choices = [
                {
                    "index": index,
                    "message": a.message(),
                    "logprobs": chat_logprobs(a.logprobs or [], token_text)
                    if stream.want_logprobs
                    else None,
                    "finish_reason": a.finish_reason,
                    "stop_reason": a.stop_reason,
                    **({"token_ids": a.token_ids or []} if prompt_ids is not None else {}),
                }
                for index, a in sorted(acc.items())
            ]
            response = stream.chunk(choices, usage, full=True)
            if params.prompt_logprobs is not None:
                # vLLM's place for them in a chat response: beside the choices (one prompt).
                response["prompt_logprobs"] = prompt_logprobs_body(
                    acc[0].prompt_logprobs or [], token_text
                )
            if prompt_ids is not None:
                response["prompt_token_ids"] = prompt_ids
            return JSONResponse(response)
        render = stream.render
        if tools is not None:
            extract = tools.apply
            render = lambda i, event: stream.render(i, extract(event))  # noqa: E731
        return await self._stream(
            inputs, render, stream.final, body.structured_param, body.continuous_usage
        )

    async def _chat_inputs(self, body: ChatBody) -> tuple[list[GenerateInput], SamplingParams]:
        """The conversation through the chat template, as the one input to generate, and the
        sampling parameters it runs with (special tokens kept where the tool-call parser
        needs its tags)."""
        text, ids = await self.engine.encode_chat(
            body.messages,
            body.tools,
            self.tool_call_parser,
            body.template,
            body.prompt_options.special_tokens(False),
        )
        params = body.params
        auto = body.tool_calling is not None and body.tool_calling.mode == "auto"
        if auto and self.keep_tool_tags:
            params = params.clone(skip_special_tokens=False)
        inputs = self.engine.inputs(
            [(ids, text)],
            params,
            params.max_tokens,
            self.limits,
            kind="chat",
            priority=body.priority,
            options=body.prompt_options,
        )
        return inputs, params

    def _stored(self, rid: str, param: str) -> StoredResponse:
        """The stored response `rid`, or 404 naming it (and why none can be)."""
        stored = self.response_store.get(rid)
        if stored is not None:
            return stored
        why = (
            "not stored, evicted (--responses-store-size) or deleted"
            if self.response_store.enabled
            else "this frontend stores no responses (--responses-store-size 0): send the "
            "whole conversation as input"
        )
        raise FrontendError(grpc.StatusCode.NOT_FOUND, f"response {rid!r} not found: {why}", param)

    async def stored_response(self, request: Request) -> Response:
        """`client.responses.retrieve` / `.delete`: the stored response object, or its
        deletion; 404 naming the id when this frontend does not hold it."""
        rid = request.path_params["response_id"]
        stored = self._stored(rid, "response_id")
        if request.method == "DELETE":
            self.response_store.delete(rid)
            return JSONResponse({"id": rid, "object": "response", "deleted": True})
        return JSONResponse(stored.response)

    def _tool_calls(self, body: ChatBody) -> ToolCallExtractor | None:
        """The extractor of the tool calls in the output, when the request uses tools."""
        if body.tool_calling is None:
            return None
        return ToolCallExtractor(parser_factory(body.tool_calling, self.tool_call_parser))

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API: the chat completion the body asks for (responses.py),
        answered as one `response` object or its stream of typed events."""
        values = await self._read_json(request)
        previous = previous_response_id(values)
        history = () if previous is None else self._stored(previous, "previous_response_id").items
        chat, asked = chat_request(values, history, self.response_store.enabled)
        body = parse_chat(chat, self.limits, self.tool_call_parser, self.engine.sampling_defaults)
        model = self._check_model(body.model)
        inputs, _ = await self._chat_inputs(body)
        rid = response_id()

        def store(whole: dict[str, Any]) -> None:
            items = (*asked.items, *whole["output"])
            self.response_store.put(rid, StoredResponse(whole, items))

        builder = ResponseBuilder(rid, model, asked, self.token_text, on_finished=store)
        tools = self._tool_calls(body)
        if not body.stream:
            acc: dict[int, ChoiceAccumulator] = {}
            usage = await _unless_disconnected(
                request, self._collect(inputs, 1, acc, body.structured_param, tools)
            )
            return JSONResponse(builder.finished(acc[0], usage))
        stream = ResponsesStream(builder)
        render = stream.render
        if tools is not None:
            extract = tools.apply
            render = lambda i, event: stream.render(i, extract(event))  # noqa: E731
        return await self._stream(
            inputs, render, stream.final, body.structured_param, done="", error=stream.error
        )

    async def _beams(
        self, inputs: list[GenerateInput], params: SamplingParams, length_penalty: float
    ) -> tuple[list[BeamSearchOutput], Usage]:
        """Beam search (`params.n` beams) for each input, concurrently, and the usage: the
        prompts' tokens and the returned beams' generated tokens."""
        outs = await asyncio.gather(
            *(
                self.engine.beam_search(
                    inp,
                    BeamSearchParams(
                        beam_width=params.n,
                        # The rest of the context when the request gave no max_tokens; 16
                        # (completions' default) while no worker has told the context.
                        max_tokens=inp.params.max_tokens or 16,
                        ignore_eos=params.ignore_eos,
                        length_penalty=length_penalty,
                    ),
                )
                for inp in inputs
            )
        )
        generated = sum(
            len(seq.tokens) - len(inp.prompt_token_ids)
            for inp, out in zip(inputs, outs, strict=True)
            for seq in out.sequences
        )
        return outs, Usage(sum(len(inp.prompt_token_ids) for inp in inputs), generated)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt's token ids by the served model's tokenizer, or a
        conversation's through its chat template; with the context length."""
        body = parse_tokenize(await self._read_json(request), self.limits)
        self._check_model(body.model)
        if body.messages is not None:
            _, ids = await self.engine.encode_chat(
                body.messages,
                body.tools,
                self.tool_call_parser,
                body.template,
                body.add_special_tokens,
            )
        else:
            assert body.prompt is not None
            ids = await self.engine.encode(body.prompt, body.add_special_tokens)
        strs = self.engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": self.engine.cluster.max_model_len or None,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: token ids back to text (special tokens kept)."""
        body = parse_detokenize(await self._read_json(request), self.limits)
        self._check_model(body.model)
        return JSONResponse({"prompt": await self.engine.decode(body.tokens)})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": tandem_version})

    # ------------------------------------------------------------------ shared

    async def _collect(
        self,
        inputs: list[GenerateInput],
        n: int,
        acc: dict[int, ChoiceAccumulator],
        structured_param: str | None = None,
        tools: ToolCallExtractor | None = None,
    ) -> Usage:
        usage = Usage(0, 0)
        async for i, event in _with_param(_merge(self.engine, inputs), structured_param):
            if tools is not None:
                tools.apply(event)
            for d in event.deltas:
                acc.setdefault(i * n + d.index, ChoiceAccumulator()).add(d)
            if event.usage is not None:
                usage.prompt_tokens += event.usage.prompt_tokens
                usage.completion_tokens += event.usage.completion_tokens
                usage.cached_tokens += event.usage.cached_tokens
        return usage

    async def _stream(
        self,
        inputs: list[GenerateInput],
        render: Callable[[int, StepEvent], str],
        final: Callable[[Usage], str],
        structured_param: str | None = None,
        continuous_usage: bool = False,
        done: str = DONE,
        error: Callable[[FrontendError], str] | None = None,
    ) -> Response:
        """An SSE response; errors before the first event become a plain HTTP error, later
        ones the stream's last event (`error`; default: an OpenAI error body).

        One write per event (each step's new text of every choice in one chunk); the last
        event of a single-prompt stream goes out with the usage chunk and `done` (`[DONE]`;
        the Responses API sends none). With `continuous_usage`, every chunk carries the usage
        so far (the prompts' tokens and the tokens sent)."""
        single = len(inputs) == 1
        running = Usage(sum(len(inp.prompt_token_ids) for inp in inputs), 0)
        events = _with_param(_merge(self.engine, inputs), structured_param)
        try:
            first = await anext(events)
        except FrontendError as exc:
            return _error_response(exc)
        except StopAsyncIteration:
            first = None

        async def body() -> AsyncIterator[str]:
            usage = Usage(0, 0)
            try:
                item = first
                while item is not None:
                    i, event = item
                    if event.usage is not None:
                        usage.prompt_tokens += event.usage.prompt_tokens
                        usage.completion_tokens += event.usage.completion_tokens
                        usage.cached_tokens += event.usage.cached_tokens
                    text = render(i, event)
                    if continuous_usage:
                        running.completion_tokens += sum(len(d.token_ids) for d in event.deltas)
                        text = with_usage(text, running)
                    if single and event.finished:
                        yield text + final(usage) + done
                        return
                    if text:
                        yield text
                    item = await anext(events, None)
                tail = final(usage)
            except FrontendError as exc:
                if error is not None:
                    tail = error(exc)
                else:
                    tail = sse(error_body(exc.message, exc.http_status, exc.param))
            finally:
                await events.aclose()
            yield tail + done

        return StreamingResponse(
            body(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
