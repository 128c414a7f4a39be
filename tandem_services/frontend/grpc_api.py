"""The frontend's gRPC API (`tandem.v1.Frontend`).

A Generate request is checked in one pass at the edge (`parse_generate`: the limits, the
sampling parameters' values, a structured-output spec's schema, the prompt's shape and chat
messages) into `GenerateArgs`; what needs its tokens is checked once they exist
(`FrontendEngine.inputs`). Every refusal is INVALID_ARGUMENT."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from tandem.core.outputs import Logprobs
from tandem.sampling_params import SamplingParams, SamplingParamsError
from tandem_protos.v1 import frontend_pb2, frontend_pb2_grpc
from tandem_services.common.convert import (
    FINISH_TO_PROTO,
    logprobs_to_proto,
    sampling_params_kwargs,
)
from tandem_services.common.server import RETRY_AFTER_KEY
from tandem_services.frontend.auth import api_key_matches
from tandem_services.frontend.engine import FrontendEngine
from tandem_services.frontend.limits import (
    RequestLimits,
    check_at_most,
    check_messages,
    check_stop,
)
from tandem_services.frontend.openai_protocol import ChoiceAccumulator
from tandem_services.frontend.structured import check_structured
from tandem_services.frontend.types import (
    DEFAULT_PROMPT_OPTIONS,
    DEFAULT_TEMPLATE,
    ChatTemplateOptions,
    ChoiceDelta,
    FrontendError,
    PromptOptions,
    StepEvent,
    Usage,
    invalid,
)


def _choice(d: ChoiceDelta | ChoiceAccumulator, index: int) -> frontend_pb2.Choice:
    msg = frontend_pb2.Choice(
        index=index,
        text=d.text,
        token_ids=d.token_ids or [],
        finish_reason=FINISH_TO_PROTO[d.finish_reason],
    )
    if d.logprobs:
        msg.logprobs.extend(logprobs_to_proto(lp) for lp in d.logprobs)
    if isinstance(d.stop_reason, str):
        msg.stop_str = d.stop_reason
    elif isinstance(d.stop_reason, int):
        msg.stop_token_id = d.stop_reason
    return msg


def _prompt_logprobs(
    deltas: Sequence[ChoiceDelta] | Sequence[ChoiceAccumulator],
) -> list[Logprobs] | None:
    """The prompt's logprobs, from the first of `deltas` that carries them."""
    return next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)


def _usage(u: Usage) -> frontend_pb2.Usage:
    return frontend_pb2.Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.total_tokens,
        cached_tokens=u.cached_tokens,
    )


def step_response(
    request_id: str,
    choices: list[frontend_pb2.Choice],
    num_prompt_tokens: int,
    usage: Usage | None,
    prompt_logprobs: list[Logprobs] | None = None,
) -> frontend_pb2.GenerateResponse:
    """One Generate stream message: every choice's output of one step (the last has usage;
    the first with a choice's first output, the prompt's logprobs when asked for)."""
    response = frontend_pb2.GenerateResponse(
        request_id=request_id, choices=choices, prompt_tokens=num_prompt_tokens
    )
    if usage is not None:
        response.usage.CopyFrom(_usage(usage))
    if prompt_logprobs:
        response.prompt_logprobs.extend(map(logprobs_to_proto, prompt_logprobs))
    return response


def stream_response(
    request_id: str,
    event: StepEvent,
    num_prompt_tokens: int,
    prompt_logprobs: list[Logprobs] | None = None,
) -> frontend_pb2.GenerateResponse:
    """The streamed (not final-only) message for one `StepEvent`."""
    choices = [_choice(d, d.index) for d in event.deltas]
    return step_response(request_id, choices, num_prompt_tokens, event.usage, prompt_logprobs)


# The gRPC sampling fields a limit bounds, with the limit (limits.py); stop has its own.
_BOUNDED = (("n", "max_n"), ("logprobs", "max_logprobs"), ("prompt_logprobs", "max_logprobs"))


@dataclass(frozen=True)
class GenerateArgs:
    """A Generate request whose fields passed their one-pass check (`parse_generate`).

    `prompt` is the oneof's kind: "text" (`text`), "token_ids" (`token_ids`) or "chat"
    (`messages`, checked for the chat template). `max_tokens` is None when the request left it
    out (the rest of the context)."""

    params: SamplingParams
    max_tokens: int | None
    prompt: str
    text: str = ""
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    template: ChatTemplateOptions = DEFAULT_TEMPLATE
    prompt_options: PromptOptions = DEFAULT_PROMPT_OPTIONS


def chat_messages(chat: frontend_pb2.Chat) -> list[dict[str, Any]]:
    """A Chat's messages, checked for the chat template."""
    if not chat.messages:
        raise invalid("chat.messages is empty", "chat")
    return check_messages([{"role": m.role, "content": m.content} for m in chat.messages])


def chat_template(chat: frontend_pb2.Chat) -> ChatTemplateOptions:
    """A Chat's template options (the HTTP API's fields; INVALID_ARGUMENT naming a bad one)."""
    kwargs: Any = {}
    if chat.chat_template_kwargs_json:
        try:
            kwargs = json.loads(chat.chat_template_kwargs_json)
        except (ValueError, RecursionError):
            raise invalid(
                "chat.chat_template_kwargs_json is not a JSON object", "chat_template_kwargs"
            ) from None
        if not isinstance(kwargs, dict):
            raise invalid(
                "chat.chat_template_kwargs_json must be a JSON object", "chat_template_kwargs"
            )
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    return ChatTemplateOptions(add, chat.continue_final_message, kwargs)


def parse_generate(
    request: frontend_pb2.GenerateRequest,
    limits: RequestLimits,
    defaults: Mapping[str, Any] | None = None,
) -> GenerateArgs:
    """The one pass over a Generate request's fields; FrontendError (INVALID_ARGUMENT) naming
    the first problem. `defaults`: the model's default sampling parameters for the fields
    the request does not set."""
    sp = request.sampling_params
    try:
        kwargs = {**(defaults or {}), **sampling_params_kwargs(sp)}
        for field, limit in _BOUNDED:
            if field in kwargs:
                check_at_most(limits, field, kwargs[field], limit)
        check_stop(limits, kwargs["stop"])
        params = SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        raise invalid(str(exc)) from None
    check_structured(params.structured_outputs, "sampling_params.structured_outputs")
    max_tokens = params.max_tokens if sp.HasField("max_tokens") else None
    options = PromptOptions(
        request.add_special_tokens if request.HasField("add_special_tokens") else None,
        request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None,
        request.cache_salt if request.HasField("cache_salt") else None,
    )
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return GenerateArgs(params, max_tokens, kind, text=request.text, prompt_options=options)
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        return GenerateArgs(params, max_tokens, kind, token_ids=ids, prompt_options=options)
    if kind == "chat":
        return GenerateArgs(
            params,
            max_tokens,
            kind,
            messages=chat_messages(request.chat),
            template=chat_template(request.chat),
            prompt_options=options,
        )
    raise invalid("a prompt (text, token_ids or chat) is required", "prompt")


class FrontendServicer(frontend_pb2_grpc.FrontendServicer):
    def __init__(
        self,
        engine: FrontendEngine,
        api_key: str,
        model_ids: list[str],
        limits: RequestLimits | None = None,
    ) -> None:
        self.engine = engine
        self.limits = limits or RequestLimits()
        self.api_key = api_key
        self.model_ids = model_ids
        self.created = int(time.time())

    async def _check(self, model: str, context: grpc.aio.ServicerContext) -> None:
        if self.api_key:
            metadata = dict(context.invocation_metadata() or ())
            auth = metadata.get("authorization", "")
            if not api_key_matches(auth if isinstance(auth, str) else "", self.api_key):
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "missing or wrong API key (metadata authorization: Bearer <key>)",
                )
        if model and model not in self.model_ids:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"model {model!r} is not served here; available: {', '.join(self.model_ids)}",
            )

    async def _tokenized(self, args: GenerateArgs) -> tuple[list[int], str | None]:
        """The prompt's token ids, and its text (None for token ids)."""
        options = args.prompt_options
        if args.prompt == "text":
            return await self.engine.encode(args.text, options.special_tokens(True)), args.text
        if args.prompt == "token_ids":
            assert args.token_ids is not None
            return args.token_ids, None
        assert args.messages is not None
        text, ids = await self.engine.encode_chat(
            args.messages,
            options=args.template,
            add_special_tokens=options.special_tokens(False),
        )
        return ids, text

    async def Generate(
        self, request: frontend_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[frontend_pb2.GenerateResponse]:
        await self._check(request.model, context)
        try:
            args = parse_generate(request, self.limits, self.engine.sampling_defaults)
            ids, text = await self._tokenized(args)
            (inp,) = self.engine.inputs(
                [(ids, text)],
                args.params,
                args.max_tokens,
                self.limits,
                kind="grpc",
                priority=request.priority,
                param_prefix="sampling_params.",
                options=args.prompt_options,
            )
            shown_id = request.request_id or inp.request_id
            final_only = request.output_kind == frontend_pb2.OUTPUT_KIND_FINAL_ONLY
            acc: dict[int, ChoiceAccumulator] = {}
            # The prompt's logprobs go once, on the first response any choice's first delta
            # (each carries them) is in.
            prompt_logprobs_sent = False
            async for event in self.engine.generate(inp):
                if not final_only:
                    prompt_logprobs = None
                    if not prompt_logprobs_sent:
                        prompt_logprobs = _prompt_logprobs(event.deltas)
                        prompt_logprobs_sent = prompt_logprobs is not None
                    yield stream_response(shown_id, event, len(ids), prompt_logprobs)
                    continue
                for d in event.deltas:
                    acc.setdefault(d.index, ChoiceAccumulator()).add(d)
                if event.usage is not None:
                    choices = [_choice(a, i) for i, a in sorted(acc.items())]
                    prompt_logprobs = _prompt_logprobs(list(acc.values()))
                    yield step_response(shown_id, choices, len(ids), event.usage, prompt_logprobs)
        except FrontendError as exc:
            trailing: tuple[tuple[str, str], ...] = ()
            if exc.retry_after_s is not None:
                trailing = ((RETRY_AFTER_KEY, str(exc.retry_after_s)),)
            await context.abort(exc.code, exc.message, trailing_metadata=trailing)

    async def ListModels(
        self, request: frontend_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.ListModelsResponse:
        await self._check("", context)
        return frontend_pb2.ListModelsResponse(
            models=[
                frontend_pb2.ModelCard(
                    id=m,
                    owned_by="tandem",
                    max_model_len=self.engine.cluster.max_model_len,
                    created=self.created,
                )
                for m in self.model_ids
            ]
        )

    async def Tokenize(
        self, request: frontend_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.TokenizeResponse:
        await self._check(request.model, context)
        try:
            kind = request.WhichOneof("prompt")
            if kind == "text":
                add = request.add_special_tokens if request.HasField("add_special_tokens") else True
                ids = await self.engine.encode(request.text, add_special_tokens=add)
            elif kind == "chat":
                _, ids = await self.engine.encode_chat(
                    chat_messages(request.chat), options=chat_template(request.chat)
                )
            else:
                raise invalid("text or chat is required", "prompt")
        except FrontendError as exc:
            await context.abort(exc.code, exc.message)
        return frontend_pb2.TokenizeResponse(
            token_ids=ids, count=len(ids), max_model_len=self.engine.cluster.max_model_len
        )
