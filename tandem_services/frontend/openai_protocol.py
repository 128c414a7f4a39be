"""OpenAI-compatible request models and response shapes (completions and chat completions).

Each endpoint's request is declared once, as a `RequestModel`: a table of its fields, each with
its reader (the JSON value -> the typed value, a 400 naming the field for a wrong type or a
value over its limit, limits.py) and, for a sampling parameter, the `SamplingParams` keyword it
fills. A body is validated in one pass:

    body --RequestModel.read: each field by its declared reader; a field not declared is
    |     refused by name, unless its value is the one tandem already behaves as-->
    values --the rules across fields (best_of = n, one output constraint, tool_choice with
    |     tools, logprobs with top_logprobs)-->
    SamplingParams (its own value ranges) --> CompletionBody / ChatBody

What needs the prompt's tokens (prompt tokens x n, the context, token ids in the vocabulary)
is checked once they exist, in one place (`FrontendEngine.inputs`), which makes the
engine-facing `GenerateInput`s. A chat body's tools come out as the template's `tools` and a
`ToolCalling` plan (structured.py); its output is parsed for calls by tool_parsers.py.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tandem.core.outputs import FinishReason, Logprobs
from tandem.engine.output_processor import logprob_entry
from tandem.sampling_params import (
    MAX_LOGPROBS,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)
from tandem_services.frontend.limits import (
    RequestLimits,
    check_at_most,
    check_messages,
    check_stop,
    check_tools,
)
from tandem_services.frontend.structured import (
    ToolCalling,
    parse_response_format,
    parse_structured_outputs,
    parse_tool_choice,
    parse_tools,
)
from tandem_services.frontend.types import (
    DEFAULT_PROMPT_OPTIONS,
    DEFAULT_TEMPLATE,
    ChatTemplateOptions,
    ChoiceDelta,
    PromptOptions,
    ToolCallDelta,
    Usage,
    invalid,
)

# A field's reader: (the field's name, its JSON value, never null, the limits) -> its value.
Reader = Callable[[str, Any, RequestLimits], Any]


@dataclass(frozen=True, slots=True)
class Field:
    """One declared request field. `param`: the `SamplingParams` keyword its value fills (left
    out of the body: SamplingParams' default); `missing`: the refusal when it is left out or
    null (a required field)."""

    read: Reader
    param: str | None = None
    missing: str | None = None


class RequestModel:
    """A request body declared as its fields. `read` is the one pass over a body."""

    def __init__(self, fields: dict[str, Field]) -> None:
        self.fields = fields
        self._required = tuple((n, f.missing) for n, f in fields.items() if f.missing)

    def read(
        self, body: dict[str, Any], limits: RequestLimits
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the sampling keywords, the other fields' values) of the fields `body` gives, each
        read by its reader; null is left out. A field not declared is refused by name (400)
        unless its value is the one tandem already behaves as."""
        kwargs: dict[str, Any] = {}
        values: dict[str, Any] = {}
        for name, value in body.items():
            f = self.fields.get(name)
            if f is None:
                _refuse_undeclared(name, value)
            elif value is not None:
                typed = f.read(name, value, limits)
                if f.param is None:
                    values[name] = typed
                else:
                    kwargs[f.param] = typed
        for name, missing in self._required:
            if name not in values:
                raise invalid(missing, name)
        return kwargs, values


# ----------------------------------------------------------------------------- readers


# The wire fields' widths (common.proto): an integer that does not fit its field is refused
# here, by name, not by protobuf's conversion on the way to the scheduler (a 500).
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)


def _int(limit: str | None = None, width: tuple[int, int] = _INT32) -> Reader:
    """An integer within its wire field's `width`, at most the `RequestLimits` field `limit`
    if given."""

    def read(name: str, v: Any, limits: RequestLimits) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise invalid(f"{name} must be an integer, got {v!r}", name)
        if limit is not None:
            check_at_most(limits, name, v, limit)
        lo, hi = width
        if not lo <= v <= hi:
            raise invalid(f"{name} must be in [{lo}, {hi}], got {v}", name)
        return v

    return read


def _float(name: str, v: Any, limits: RequestLimits) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise invalid(f"{name} must be a number, got {v!r}", name)
    return float(v)


def _bool(name: str, v: Any, limits: RequestLimits) -> bool:
    if not isinstance(v, bool):
        raise invalid(f"{name} must be true or false, got {v!r}", name)
    return v


def _str(name: str, v: Any, limits: RequestLimits) -> str:
    if not isinstance(v, str):
        raise invalid(f"{name} must be a string, got {type(v).__name__}", name)
    return v


def _any(name: str, v: Any, limits: RequestLimits) -> Any:
    return v


def _object(name: str, v: Any, limits: RequestLimits) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise invalid(f"{name} must be an object", name)
    return v


def _int_list(name: str, v: Any, limits: RequestLimits) -> list[int]:
    """Token ids: integers that fit the wire's int32."""
    lo, hi = _INT32
    if not isinstance(v, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in v):
        raise invalid(f"{name} must be a list of integers", name)
    for t in v:
        if not lo <= t <= hi:
            raise invalid(f"{name} must hold integers in [{lo}, {hi}], got {t}", name)
    return v


def _str_list(name: str, v: Any, limits: RequestLimits) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise invalid(f"{name} must be a list of strings", name)
    return v


def _stop(name: str, v: Any, limits: RequestLimits) -> list[str]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise invalid("stop must be a non-empty string or a list of them", "stop")
    check_stop(limits, v)
    return v


def _logit_bias(name: str, v: Any, limits: RequestLimits) -> dict[int, float] | None:
    """OpenAI's map of token id (a JSON key: a string) to a bias; {} is none."""
    if v == {}:
        return None
    if not isinstance(v, dict):
        raise invalid("logit_bias must be an object of token id to bias", "logit_bias")
    bias: dict[int, float] = {}
    for key, value in v.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise invalid(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise invalid(f"logit_bias[{key}] must be a number, got {value!r}", "logit_bias")
        bias[token] = float(value)
    return bias


def _stream_options(name: str, v: Any, limits: RequestLimits) -> tuple[bool, bool]:
    """`stream_options`: whether the stream ends with a usage chunk (`include_usage`), and
    whether every chunk carries the usage so far (vLLM's `continuous_usage_stats`)."""
    if not isinstance(v, dict):
        raise invalid("stream_options must be an object", "stream_options")
    flags = []
    for key in ("include_usage", "continuous_usage_stats"):
        flag = v.get(key, False)
        if not isinstance(flag, bool):
            raise invalid(f"stream_options.{key} must be true or false", "stream_options")
        flags.append(flag)
    return flags[0], flags[1]


def _is_ids(p: Any) -> bool:
    return isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def _prompt(name: str, v: Any, limits: RequestLimits) -> list[str | list[int]]:
    """Completions' prompt: text, texts, token ids, or token id lists; one entry each."""
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v:
        if all(isinstance(p, str) for p in v):
            return list(v)
        if _is_ids(v):
            return [list(v)]
        if all(_is_ids(p) for p in v):
            return [list(p) for p in v]
    raise invalid(
        "prompt must be a string, a list of strings, a list of token ids, or a list of "
        "token id lists",
        "prompt",
    )


def _messages(name: str, v: Any, limits: RequestLimits) -> list[dict[str, Any]]:
    return check_messages(v)


def _tools(
    name: str, v: Any, limits: RequestLimits
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """(the tools as given, each tool's name -> its parameter schema); their number and
    size are checked before each tool is (a huge list is refused for its size)."""
    check_tools(limits, v)
    return list(v), parse_tools(v)


def _response_format(name: str, v: Any, limits: RequestLimits) -> StructuredOutputsParams | None:
    return parse_response_format(v)


def _structured_outputs(name: str, v: Any, limits: RequestLimits) -> StructuredOutputsParams | None:
    return parse_structured_outputs(v)


_TEMPLATE: dict[str, Field] = {
    "add_generation_prompt": Field(_bool),
    "continue_final_message": Field(_bool),
    # Extra template variables; ChatTemplateOptions refuses the template's own arguments.
    "chat_template_kwargs": Field(_object),
}


def _template_options(values: dict[str, Any]) -> ChatTemplateOptions:
    return ChatTemplateOptions(
        add_generation_prompt=values.get("add_generation_prompt", True),
        continue_final_message=values.get("continue_final_message", False),
        kwargs=values.get("chat_template_kwargs", {}),
    )


# ----------------------------------------------------------------------------- the models

# Fields both endpoints implement: tandem's SamplingParams and the OpenAI basics.
_COMMON: dict[str, Field] = {
    "model": Field(_str),
    "n": Field(_int("max_n"), "n"),
    "best_of": Field(_int("max_best_of")),
    "temperature": Field(_float, "temperature"),
    "top_p": Field(_float, "top_p"),
    "top_k": Field(_int(), "top_k"),
    "min_p": Field(_float, "min_p"),
    "seed": Field(_int(width=_INT64), "seed"),
    "presence_penalty": Field(_float, "presence_penalty"),
    "frequency_penalty": Field(_float, "frequency_penalty"),
    "repetition_penalty": Field(_float, "repetition_penalty"),
    "min_tokens": Field(_int(), "min_tokens"),
    "stop": Field(_stop, "stop"),
    "stop_token_ids": Field(_int_list, "stop_token_ids"),
    "ignore_eos": Field(_bool, "ignore_eos"),
    "include_stop_str_in_output": Field(_bool, "include_stop_str_in_output"),
    "skip_special_tokens": Field(_bool, "skip_special_tokens"),
    # vLLM's: per prompt token after the first, its logprob, rank and the top k (not streamed).
    "prompt_logprobs": Field(_int("max_logprobs"), "prompt_logprobs"),
    # vLLM's: the prompt's and each choice's token ids beside the text; logprobs' tokens
    # written "token_id:<id>" (TokenIdText).
    "return_token_ids": Field(_bool),
    "return_tokens_as_token_ids": Field(_bool),
    # vLLM's beam search: `n` beams (BeamSearchParams; FrontendEngine.beam_search).
    "use_beam_search": Field(_bool),
    "length_penalty": Field(_float),
    # How the prompt is tokenized and cached (PromptOptions).
    "add_special_tokens": Field(_bool),
    "truncate_prompt_tokens": Field(_int()),
    "cache_salt": Field(_str),
    "stream": Field(_bool),
    "stream_options": Field(_stream_options),
    "priority": Field(_int()),
    # An end-user id for abuse monitoring: nothing to do with the output.
    "user": Field(_any),
    # Logits processors (OpenAI's logit_bias; vLLM's extra-body fields).
    "logit_bias": Field(_logit_bias, "logit_bias"),
    "allowed_token_ids": Field(_int_list, "allowed_token_ids"),
    "bad_words": Field(_str_list, "bad_words"),
    "vllm_xargs": Field(_object, "extra_args"),
    # Structured outputs (structured.py): at most one of the two.
    "response_format": Field(_response_format),
    "structured_outputs": Field(_structured_outputs),
}

COMPLETION = RequestModel(
    {
        "prompt": Field(_prompt, missing="prompt is required"),
        **_COMMON,
        "max_tokens": Field(_int(), "max_tokens"),
        "logprobs": Field(_int("max_logprobs"), "logprobs"),
        # The prompt's text before each choice's output.
        "echo": Field(_bool),
    }
)

CHAT = RequestModel(
    {
        "messages": Field(_messages, missing="messages must be a non-empty list"),
        **_COMMON,
        # max_completion_tokens, else max_tokens, else the rest of the context.
        "max_tokens": Field(_int()),
        "max_completion_tokens": Field(_int()),
        "logprobs": Field(_bool),
        "top_logprobs": Field(_int("max_logprobs")),
        "tools": Field(_tools),
        "tool_choice": Field(_any),
        "parallel_tool_calls": Field(_any),
        # How the chat template renders the conversation (`ChatTemplateOptions`).
        **_TEMPLATE,
    }
)


def _is_absent(v: Any) -> bool:
    return v is None


# Known fields tandem does not implement, accepted only with the value it already matches
# (a predicate), with the reason given when refused. Anything else unknown is refused too.
_NO_OP_VALUES: dict[str, tuple[Any, str]] = {
    # Tool calling is a chat feature: on /v1/completions only the no-op values pass.
    "tools": (
        lambda v: v is None or v == [],
        "tools (tool calling) are for /v1/chat/completions only",
    ),
    "tool_choice": (
        lambda v: v is None or v == "none",
        "tool_choice (tool calling) is for /v1/chat/completions only",
    ),
    "parallel_tool_calls": (
        lambda v: v is None or isinstance(v, bool),
        "parallel_tool_calls must be true or false",
    ),
    "functions": (_is_absent, "functions (function calling) are not implemented"),
    "function_call": (
        lambda v: v is None or v == "none",
        "function_call (function calling) is not implemented",
    ),
    "suffix": (lambda v: v is None or v == "", "suffix is not implemented"),
    "store": (lambda v: v is None or v is False, "store (stored completions) is not implemented"),
    "metadata": (_is_absent, "metadata (stored completions) is not implemented"),
    "modalities": (
        lambda v: v is None or v == ["text"],
        'modalities other than ["text"] are not implemented',
    ),
}

# Known fields (OpenAI's and vLLM's) refused whenever present, with what they are.
_UNIMPLEMENTED: dict[str, str] = {
    # vLLM's older guided-decoding fields (structured_outputs replaced them).
    "guided_json": "guided decoding; use structured_outputs.json",
    "guided_regex": "guided decoding; use structured_outputs.regex",
    "guided_choice": "guided decoding; use structured_outputs.choice",
    "guided_grammar": "guided decoding; use structured_outputs.grammar",
    "guided_decoding_backend": "guided decoding backends",
    "guided_whitespace_pattern": "guided decoding whitespace patterns",
    # OpenAI.
    "audio": "audio output",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
    "reasoning_effort": "reasoning models' options",
    "verbosity": "verbosity",
    "service_tier": "service tiers",
    "prompt_cache_key": "prompt cache keys",
    "safety_identifier": "safety identifiers",
    # vLLM's extensions.
    "early_stopping": "beam search's early stopping (beams run to max_tokens or EOS)",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "chat_template": "a per-request chat template",
    "documents": "documents (RAG chat templates)",
    "mm_processor_kwargs": "multimodal inputs",
    "prompt_embeds": "prompt embeddings",
    "request_id": "client-chosen request ids",
    "kv_transfer_params": "client KV-transfer parameters",
    "logits_processors": "per-request logits processors (the engine's --logits-processors "
    "are applied to every request; pass their arguments in vllm_xargs)",
    "response_format_schema": "response_format_schema; use response_format",
    "thinking": "reasoning options",
    "include_reasoning": "reasoning options",
}


def _refuse_undeclared(name: str, value: Any) -> None:
    """Refuses (400, naming it) a field the request model does not declare, unless its value
    is the one tandem already behaves as."""
    if name in _NO_OP_VALUES:
        ok, reason = _NO_OP_VALUES[name]
        if ok(value):
            return
        raise invalid(f"{reason} (got {name}={_short(value)})", name)
    if name in _UNIMPLEMENTED:
        raise invalid(f"{name} ({_UNIMPLEMENTED[name]}) is not implemented by tandem", name)
    raise invalid(f"unknown field {name!r} (tandem does not implement it)", name)


def _short(value: Any, limit: int = 80) -> str:
    s = json.dumps(value, default=str)
    return s if len(s) <= limit else s[: limit - 3] + "..."


# ----------------------------------------------------------------------------- across fields


def _sampling_params(
    kwargs: dict[str, Any], values: dict[str, Any], defaults: Mapping[str, Any] | None = None
) -> SamplingParams:
    """The rules across the sampling fields, then SamplingParams' own value checks (a 400
    naming the field its message starts with). `defaults`: the model's default sampling
    parameters (generation_config.json) for the fields the body leaves out."""
    best_of = values.get("best_of")
    if best_of is not None and best_of != kwargs.get("n", 1):
        raise invalid("best_of must equal n (or be left out)", "best_of")
    kwargs = {**(defaults or {}), **kwargs}
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        message = str(exc)
        field = re.match(r"[a-z_]+", message)
        raise invalid(message, field.group(0) if field else None) from None


def _output_constraint(
    values: dict[str, Any],
) -> tuple[StructuredOutputsParams | None, str | None]:
    """The body's output constraint (`response_format` or `structured_outputs`, at most one)
    and the field it came from."""
    rf = values.get("response_format")
    so = values.get("structured_outputs")
    if rf is not None and so is not None:
        raise invalid(
            "response_format and structured_outputs both constrain the output; give one",
            "structured_outputs",
        )
    if rf is not None:
        return rf, "response_format"
    if so is not None:
        return so, "structured_outputs"
    return None, None


@dataclass(frozen=True)
class CompletionBody:
    """A /v1/completions request after its one-pass check (`parse_completion`)."""

    model: str | None
    # Each entry: text, or token ids.
    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    # Every chunk carries the usage so far (stream_options.continuous_usage_stats).
    continuous_usage: bool
    priority: int
    # The field the output constraint came from (for errors the engine reports), if any.
    structured_param: str | None = None
    echo: bool = False
    # The body asked for `prompt_logprobs` (each choice then shows them); `params` may ask
    # for them without it, for `echo` with `logprobs`.
    show_prompt_logprobs: bool = False
    # echo with max_tokens 0 (vLLM's): the prompt alone is shown (its logprobs with
    # `logprobs`); the engine samples one token (`params.max_tokens` 1) that is not shown.
    prompt_only: bool = False
    prompt_options: PromptOptions = DEFAULT_PROMPT_OPTIONS
    # The prompt's and each choice's token ids in the response (vLLM's return_token_ids).
    return_token_ids: bool = False
    # Logprobs' tokens as "token_id:<id>" (vLLM's return_tokens_as_token_ids).
    tokens_as_ids: bool = False
    # use_beam_search: its length penalty (`params.n` the beam width); None: no beam search.
    beam_length_penalty: float | None = None


def _no_streamed_prompt_logprobs(kwargs: dict[str, Any], values: dict[str, Any]) -> None:
    if values.get("stream", False) and kwargs.get("prompt_logprobs") is not None:
        raise invalid("prompt_logprobs are not available when stream is true", "prompt_logprobs")


def parse_completion(
    body: dict[str, Any],
    limits: RequestLimits | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> CompletionBody:
    """A /v1/completions body, validated in one pass (`COMPLETION`); 400 naming the field for
    anything malformed, unimplemented or over a limit. `defaults`: the model's default
    sampling parameters for the fields the body leaves out."""
    kwargs, values = COMPLETION.read(body, limits or RequestLimits())
    structured, structured_param = _output_constraint(values)
    kwargs["structured_outputs"] = structured
    _no_streamed_prompt_logprobs(kwargs, values)
    echo = values.get("echo", False)
    prompt_only = echo and kwargs.get("max_tokens") == 0
    if prompt_only:
        kwargs["max_tokens"] = 1
    show = kwargs.get("prompt_logprobs") is not None
    if echo and kwargs.get("logprobs") is not None and not show:
        # The echoed prompt's tokens get logprobs as the output's do (vLLM's rule).
        kwargs["prompt_logprobs"] = kwargs["logprobs"]
    beam = _beam_search({**values, **kwargs})
    return CompletionBody(
        prompts=values["prompt"],
        params=_sampling_params(kwargs, values, defaults),
        structured_param=structured_param,
        echo=echo,
        show_prompt_logprobs=show,
        prompt_only=prompt_only,
        beam_length_penalty=beam,
        **_envelope(values),
    )


def _envelope(values: dict[str, Any]) -> dict[str, Any]:
    """The fields both bodies carry beside the prompt and the sampling: the model named, the
    stream's options, the priority and the prompt's options."""
    return {
        "model": values.get("model"),
        "stream": values.get("stream", False),
        "include_usage": values.get("stream_options", (False, False))[0],
        "continuous_usage": values.get("stream_options", (False, False))[1],
        "priority": values.get("priority", 0),
        "prompt_options": PromptOptions(
            values.get("add_special_tokens"),
            values.get("truncate_prompt_tokens"),
            values.get("cache_salt"),
        ),
        "return_token_ids": values.get("return_token_ids", False),
        "tokens_as_ids": values.get("return_tokens_as_token_ids", False),
    }


# What a beam-search request may not ask for: beams follow the model's own logprobs, whole.
_NOT_WITH_BEAMS = (
    "stream",
    "logprobs",
    "top_logprobs",
    "echo",
    "prompt_logprobs",
    "response_format",
    "structured_outputs",
    "tools",
)


def _beam_search(values: dict[str, Any]) -> float | None:
    """With `use_beam_search`, its length penalty (default 1.0), else None; 400 naming a
    field beam search cannot serve with. `values`: the body's values and sampling kwargs."""
    if not values.get("use_beam_search", False):
        if "length_penalty" in values:
            raise invalid("length_penalty needs use_beam_search: true", "length_penalty")
        return None
    for name in _NOT_WITH_BEAMS:
        value = values.get(name)
        if value is not None and value is not False:  # 0 asks too (logprobs: 0)
            raise invalid(f"{name} cannot be combined with use_beam_search", name)
    if values.get("temperature", 0.0) != 0.0:
        raise invalid(
            "temperature must be 0 with use_beam_search (beams follow the model's own logprobs)",
            "temperature",
        )
    n = values.get("n", 1)
    if 2 * n > MAX_LOGPROBS:
        raise invalid(
            f"n (the beam width) must be at most {MAX_LOGPROBS // 2} with use_beam_search",
            "n",
        )
    return values.get("length_penalty", 1.0)


@dataclass(frozen=True)
class ChatBody:
    """A /v1/chat/completions request after its one-pass check (`parse_chat`); its
    `params.max_tokens` is None when the body gave neither max_completion_tokens nor
    max_tokens (the frontend fills in the rest of the context)."""

    model: str | None
    messages: list[dict[str, Any]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    # Every chunk carries the usage so far (stream_options.continuous_usage_stats).
    continuous_usage: bool
    priority: int
    # The request's tools as given (for the chat template), and how they are used (None:
    # tool_choice "none", or no tools).
    tools: list[dict[str, Any]] | None = None
    tool_calling: ToolCalling | None = None
    # The field the output constraint came from (for errors the engine reports), if any.
    structured_param: str | None = None
    template: ChatTemplateOptions = DEFAULT_TEMPLATE
    prompt_options: PromptOptions = DEFAULT_PROMPT_OPTIONS
    # The prompt's and each choice's token ids in the response (vLLM's return_token_ids).
    return_token_ids: bool = False
    # Logprobs' tokens as "token_id:<id>" (vLLM's return_tokens_as_token_ids).
    tokens_as_ids: bool = False
    # use_beam_search: its length penalty (`params.n` the beam width); None: no beam search.
    beam_length_penalty: float | None = None


def parse_chat(
    body: dict[str, Any],
    limits: RequestLimits | None = None,
    auto_tool_parser: str | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> ChatBody:
    """A /v1/chat/completions body, validated in one pass (`CHAT`); 400 naming the field for
    anything malformed, unimplemented or over a limit. `auto_tool_parser` is the frontend's
    --tool-call-parser when started with --enable-auto-tool-choice (tool_choice "auto" needs
    it); `defaults`, the model's default sampling parameters for the fields left out."""
    kwargs, values = CHAT.read(body, limits or RequestLimits())
    _no_streamed_prompt_logprobs(kwargs, values)
    tools, parameters = values.get("tools", (None, {}))
    calling = parse_tool_choice(
        parameters, values.get("tool_choice"), values.get("parallel_tool_calls"), auto_tool_parser
    )
    structured, structured_param = _output_constraint(values)
    if calling is not None and calling.mode != "auto":
        if structured is not None:
            raise invalid(
                f"{structured_param} cannot be combined with a required or named tool_choice "
                "(the output is the tool call)",
                structured_param,
            )
        structured, structured_param = calling.structured_outputs(), "tools"
    kwargs["structured_outputs"] = structured
    # None (neither given): the frontend fills in the rest of the context.
    kwargs["max_tokens"] = values.get("max_completion_tokens", values.get("max_tokens"))
    top = values.get("top_logprobs")
    if values.get("logprobs", False):
        kwargs["logprobs"] = top or 0
    elif top is not None:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    beam = _beam_search({**values, **kwargs, "tools": tools if parameters else None})
    return ChatBody(
        messages=values["messages"],
        beam_length_penalty=beam,
        params=_sampling_params(kwargs, values, defaults),
        tools=tools if parameters else None,
        tool_calling=calling,
        structured_param=structured_param,
        template=_template_options(values),
        **_envelope(values),
    )


# /tokenize and /detokenize (vLLM's): text, or a conversation through the chat template.
_TOKENIZE_COMMON: dict[str, Field] = {
    "model": Field(_str),
    "add_special_tokens": Field(_bool),
    "return_token_strs": Field(_bool),
}
TOKENIZE_TEXT = RequestModel({"prompt": Field(_str), **_TOKENIZE_COMMON})
TOKENIZE_CHAT = RequestModel(
    {"messages": Field(_messages), **_TOKENIZE_COMMON, "tools": Field(_tools), **_TEMPLATE}
)
DETOKENIZE = RequestModel(
    {"model": Field(_str), "tokens": Field(_int_list, missing="tokens is required")}
)


@dataclass(frozen=True)
class TokenizeBody:
    """A /tokenize request: `prompt` (text) or `messages` (rendered by the chat template with
    `template`, `tools`). `add_special_tokens` defaults as vLLM's: true for text, false for a
    conversation (the template writes them)."""

    model: str | None
    prompt: str | None
    messages: list[dict[str, Any]] | None
    add_special_tokens: bool
    return_token_strs: bool
    tools: list[dict[str, Any]] | None = None
    template: ChatTemplateOptions = DEFAULT_TEMPLATE


def parse_tokenize(body: dict[str, Any], limits: RequestLimits | None = None) -> TokenizeBody:
    """A /tokenize body: exactly one of prompt and messages; 400 naming the field otherwise."""
    if ("prompt" in body) == ("messages" in body):
        raise invalid("exactly one of prompt and messages is required", "prompt")
    chat = "messages" in body
    _, values = (TOKENIZE_CHAT if chat else TOKENIZE_TEXT).read(body, limits or RequestLimits())
    key = "messages" if chat else "prompt"
    if key not in values:
        raise invalid(f"{key} must not be null", key)
    tools = values.get("tools", (None, {}))[0]
    return TokenizeBody(
        model=values.get("model"),
        prompt=None if chat else values["prompt"],
        messages=values["messages"] if chat else None,
        add_special_tokens=values.get("add_special_tokens", not chat),
        return_token_strs=values.get("return_token_strs", False),
        tools=tools or None,
        template=_template_options(values) if chat else DEFAULT_TEMPLATE,
    )


@dataclass(frozen=True)
class DetokenizeBody:
    model: str | None
    tokens: list[int]


def parse_detokenize(body: dict[str, Any], limits: RequestLimits | None = None) -> DetokenizeBody:
    """A /detokenize body: `tokens`, a list of token ids (checked against the vocabulary by
    the engine's tokenizer)."""
    _, values = DETOKENIZE.read(body, limits or RequestLimits())
    return DetokenizeBody(model=values.get("model"), tokens=values["tokens"])


# ----------------------------------------------------------------------------- responses


def error_body(message: str, code: int, param: str | None = None) -> dict[str, Any]:
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }.get(code, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage_body(usage: Usage) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }
    if usage.cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return body


class TokenText:
    """Decoded text of single tokens (for logprobs), cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self.tokenizer.decode([token_id])
        return s


class TokenIdText(TokenText):
    """A token as "token_id:<id>" (vLLM's return_tokens_as_token_ids), for any tokenizer."""

    def __init__(self) -> None:
        super().__init__(None)

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}"


def completion_logprobs(
    logprobs: list[Logprobs], token_text: TokenText, text_offset: int
) -> dict[str, Any]:
    """The completions API's logprobs object for a run of tokens."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset
    for lp in logprobs:
        s = token_text(lp.token_ids[0])
        tokens.append(s)
        token_logprobs.append(lp.logprobs[0])
        top.append(
            {token_text(t): v for t, v in zip(lp.token_ids[1:], lp.logprobs[1:], strict=True)}
        )
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


# A prompt token's logprob of -inf, which JSON cannot hold, as vLLM's API shows it.
_LOGPROB_FLOOR = -9999.0


def echo_logprobs(
    first_token: int, prompt_logprobs: list[Logprobs], token_text: TokenText
) -> dict[str, Any]:
    """The completions API's logprobs object for an echoed prompt: its first token without a
    logprob (nothing comes before it), then each one's from the tokens before it."""
    rest = completion_logprobs(prompt_logprobs, token_text, len(token_text(first_token)))
    return {
        "tokens": [token_text(first_token), *rest["tokens"]],
        "token_logprobs": [None, *(max(v, _LOGPROB_FLOOR) for v in rest["token_logprobs"])],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": [0, *rest["text_offset"]],
    }


def joined_logprobs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two completions logprobs objects, `b` after `a` (its offsets already after `a`'s)."""
    return {key: a[key] + b[key] for key in a}


def prompt_logprobs_body(
    prompt_logprobs: list[Logprobs], token_text: TokenText
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per prompt token a map
    from token id to its logprob, rank and text: the prompt token at its rank first, then the
    top k at ranks 1.. (a token in both keeps its first entry: `logprob_entry`, as the
    offline LLM lays them out)."""
    body: list[dict[str, dict[str, Any]] | None] = [None]
    for lp in prompt_logprobs:
        body.append(
            {
                str(tok): {
                    "logprob": max(e.logprob, _LOGPROB_FLOOR),
                    "rank": e.rank,
                    "decoded_token": token_text(tok),
                }
                for tok, e in logprob_entry(lp).items()
            }
        )
    return body


def chat_logprobs(logprobs: list[Logprobs], token_text: TokenText) -> dict[str, Any]:
    content = []
    for lp in logprobs:
        s = token_text(lp.token_ids[0])
        content.append(
            {
                "token": s,
                "logprob": lp.logprobs[0],
                "bytes": list(s.encode()),
                "top_logprobs": [
                    {"token": token_text(t), "logprob": v, "bytes": list(token_text(t).encode())}
                    for t, v in zip(lp.token_ids[1:], lp.logprobs[1:], strict=True)
                ],
            }
        )
    return {"content": content}


@dataclass
class ChoiceAccumulator:
    """A choice's whole output, for non-streaming responses."""

    text: str = ""
    token_ids: list[int] | None = None
    logprobs: list[Logprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Tool calls by index (their deltas joined), when the chat request uses tools.
    tool_calls: dict[int, ToolCallDelta] | None = None
    # The prompt's logprobs (ChoiceDelta.prompt_logprobs), when asked for.
    prompt_logprobs: list[Logprobs] | None = None

    def add(self, d: ChoiceDelta) -> None:
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        self.text += d.text
        self.token_ids = (self.token_ids or []) + d.token_ids
        if d.logprobs:
            self.logprobs = (self.logprobs or []) + d.logprobs
        for c in d.tool_calls or ():
            calls = self.tool_calls = self.tool_calls or {}
            calls[c.index] = calls[c.index].then(c) if c.index in calls else c
        if d.finish_reason is not None:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason

    def message(self) -> dict[str, Any]:
        """The chat `message` of this choice: content null when it made only tool calls."""
        if not self.tool_calls:
            return {"role": "assistant", "content": self.text}
        return {
            "role": "assistant",
            "content": self.text or None,
            "tool_calls": [tool_call_body(c) for _, c in sorted(self.tool_calls.items())],
        }


def tool_call_body(c: ToolCallDelta, index: bool = False) -> dict[str, Any]:
    """A tool call (or a streamed delta of one: then with `index`, and id, type and name only
    on its first delta) as OpenAI's JSON."""
    out: dict[str, Any] = {"index": c.index} if index else {}
    fn: dict[str, Any] = {}
    if c.id is not None:
        out["id"] = c.id
        out["type"] = "function"
    if c.name is not None:
        fn["name"] = c.name
    fn["arguments"] = c.arguments
    out["function"] = fn
    return out
