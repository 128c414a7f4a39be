"""OpenAI-compatible request parsing and response shapes (completions and chat completions).

Parsing turns a JSON body into `SamplingParams` (structured outputs included) and prompts,
and raises `FrontendError` (HTTP 400) naming the offending field for anything malformed or
unsupported. A chat body's tools come out as the template's `tools` and a `ToolCalling` plan
(structured.py); its output is parsed for calls by tool_parsers.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from tandem.core.outputs import FinishReason, Logprobs
from tandem.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from tandem_services.frontend.limits import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    RequestLimits,
    check_messages,
    check_sampling,
    check_tools,
    reject_unimplemented,
)
from tandem_services.frontend.structured import (
    ToolCalling,
    parse_response_format,
    parse_structured_outputs,
    parse_tool_choice,
    parse_tools,
)
from tandem_services.frontend.types import ChoiceDelta, ToolCallDelta, Usage, invalid


class Fields:
    """Typed access to a JSON object's fields; errors name the field."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def _get(self, name: str) -> Any:
        return self.body.get(name)

    def int_(self, name: str, default: int | None = None) -> int | None:
        v = self._get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise invalid(f"{name} must be an integer, got {v!r}", name)
        return v

    def float_(self, name: str, default: float | None = None) -> float | None:
        v = self._get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise invalid(f"{name} must be a number, got {v!r}", name)
        return float(v)

    def bool_(self, name: str, default: bool = False) -> bool:
        v = self._get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise invalid(f"{name} must be true or false, got {v!r}", name)
        return v

    def str_(self, name: str, default: str | None = None) -> str | None:
        v = self._get(name)
        if v is None:
            return default
        if not isinstance(v, str):
            raise invalid(f"{name} must be a string, got {type(v).__name__}", name)
        return v

    def stop(self) -> list[str]:
        v = self._get("stop")
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
            raise invalid("stop must be a non-empty string or a list of them", "stop")
        return v

    def int_list(self, name: str) -> list[int]:
        v = self._get(name)
        if v is None:
            return []
        if not isinstance(v, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in v):
            raise invalid(f"{name} must be a list of integers", name)
        return v

    def logit_bias(self) -> dict[int, float] | None:
        """OpenAI's map of token id (a JSON key: a string) to a bias."""
        v = self._get("logit_bias")
        if v is None or v == {}:
            return None
        if not isinstance(v, dict):
            raise invalid("logit_bias must be an object of token id to bias", "logit_bias")
        bias: dict[int, float] = {}
        for key, value in v.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise invalid(
                    f"logit_bias keys must be token ids, got {key!r}", "logit_bias"
                ) from None
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise invalid(f"logit_bias[{key}] must be a number, got {value!r}", "logit_bias")
            bias[token] = float(value)
        return bias

    def str_list(self, name: str) -> list[str] | None:
        v = self._get(name)
        if v is None:
            return None
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise invalid(f"{name} must be a list of strings", name)
        return v

    def object_(self, name: str) -> dict[str, Any] | None:
        v = self._get(name)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise invalid(f"{name} must be an object", name)
        return v

    def stream_include_usage(self) -> bool:
        opts = self._get("stream_options")
        if opts is None:
            return False
        if not isinstance(opts, dict):
            raise invalid("stream_options must be an object", "stream_options")
        v = opts.get("include_usage", False)
        if not isinstance(v, bool):
            raise invalid("stream_options.include_usage must be true or false", "stream_options")
        return v


def sampling_params(
    f: Fields,
    max_tokens: int | None,
    logprobs: int | None,
    limits: RequestLimits,
    logprobs_field: str = "logprobs",
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """Sampling parameters shared by both endpoints (vLLM-style extensions included), checked
    against `limits` before they are built."""
    n = f.int_("n", 1)
    best_of = f.int_("best_of")
    stop = f.stop()
    check_sampling(
        limits, n=n, best_of=best_of, logprobs=logprobs, logprobs_field=logprobs_field, stop=stop
    )
    if best_of is not None and best_of != n:
        raise invalid("best_of must equal n (or be left out)", "best_of")
    kwargs: dict[str, Any] = {
        "n": n,
        "temperature": f.float_("temperature", 1.0),
        "top_p": f.float_("top_p", 1.0),
        "top_k": f.int_("top_k", -1),
        "min_p": f.float_("min_p", 0.0),
        "seed": f.int_("seed"),
        "presence_penalty": f.float_("presence_penalty", 0.0),
        "frequency_penalty": f.float_("frequency_penalty", 0.0),
        "repetition_penalty": f.float_("repetition_penalty", 1.0),
        "max_tokens": max_tokens,
        "min_tokens": f.int_("min_tokens", 0),
        "stop": stop,
        "stop_token_ids": f.int_list("stop_token_ids"),
        "ignore_eos": f.bool_("ignore_eos"),
        "include_stop_str_in_output": f.bool_("include_stop_str_in_output"),
        "logprobs": logprobs,
        "skip_special_tokens": f.bool_("skip_special_tokens", True),
        "structured_outputs": structured_outputs,
        "logit_bias": f.logit_bias(),
        "allowed_token_ids": f.int_list("allowed_token_ids")
        if f.body.get("allowed_token_ids") is not None
        else None,
        "bad_words": f.str_list("bad_words"),
        "extra_args": f.object_("vllm_xargs"),
    }
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        message = str(exc)
        field = re.match(r"[a-z_]+", message)
        raise invalid(message, field.group(0) if field else None) from None


def structured_field(body: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str | None]:
    """The body's output constraint (`response_format` or `structured_outputs`, at most one)
    and the field it came from."""
    rf = parse_response_format(body.get("response_format"))
    so = parse_structured_outputs(body.get("structured_outputs"))
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
    model: str | None
    # Each entry: text, or token ids.
    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int
    # The field the output constraint came from (for errors the engine reports), if any.
    structured_param: str | None = None


def parse_completion(body: dict[str, Any], limits: RequestLimits | None = None) -> CompletionBody:
    """A /v1/completions body; 400 naming the field for anything malformed, unimplemented or
    over a limit."""
    limits = limits or RequestLimits()
    reject_unimplemented(body, COMPLETION_FIELDS)
    f = Fields(body)
    prompt = body.get("prompt")
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        prompts = [list(prompt)]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            for p in prompt
        )
    ):
        prompts = [list(p) for p in prompt]
    elif prompt is None:
        raise invalid("prompt is required", "prompt")
    else:
        raise invalid(
            "prompt must be a string, a list of strings, a list of token ids, or a list of "
            "token id lists",
            "prompt",
        )
    logprobs = f.int_("logprobs")
    structured, structured_param = structured_field(body)
    return CompletionBody(
        model=f.str_("model"),
        prompts=prompts,
        params=sampling_params(
            f, f.int_("max_tokens", 16), logprobs, limits, structured_outputs=structured
        ),
        stream=f.bool_("stream"),
        include_usage=f.stream_include_usage(),
        priority=f.int_("priority", 0) or 0,
        structured_param=structured_param,
    )


@dataclass(frozen=True)
class ChatBody:
    model: str | None
    messages: list[dict[str, Any]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int
    # max_tokens was left out: the frontend fills in the rest of the context.
    max_tokens_given: bool
    # The request's tools as given (for the chat template), and how they are used (None:
    # tool_choice "none", or no tools).
    tools: list[dict[str, Any]] | None = None
    tool_calling: ToolCalling | None = None
    # The field the output constraint came from (for errors the engine reports), if any.
    structured_param: str | None = None


def parse_chat(
    body: dict[str, Any],
    limits: RequestLimits | None = None,
    auto_tool_parser: str | None = None,
) -> ChatBody:
    """A /v1/chat/completions body; 400 naming the field for anything malformed,
    unimplemented or over a limit. `auto_tool_parser` is the frontend's --tool-call-parser
    when started with --enable-auto-tool-choice (tool_choice "auto" needs it)."""
    limits = limits or RequestLimits()
    # The tools' number and size first (a huge list is refused for its size).
    check_tools(limits, body.get("tools"))
    reject_unimplemented(body, CHAT_FIELDS)
    f = Fields(body)
    messages = check_messages(body.get("messages"))
    tools = parse_tools(body.get("tools"))
    calling = parse_tool_choice(
        tools, body.get("tool_choice"), body.get("parallel_tool_calls"), auto_tool_parser
    )
    structured, structured_param = structured_field(body)
    if calling is not None and calling.mode != "auto":
        if structured is not None:
            raise invalid(
                f"{structured_param} cannot be combined with a required or named tool_choice "
                "(the output is the tool call)",
                structured_param,
            )
        structured, structured_param = calling.structured_outputs(), "tools"
    max_tokens = f.int_("max_completion_tokens", f.int_("max_tokens"))
    logprobs = None
    top = f.int_("top_logprobs")
    if f.bool_("logprobs"):
        logprobs = top or 0
    elif top is not None:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    return ChatBody(
        model=f.str_("model"),
        messages=messages,
        params=sampling_params(
            f, max_tokens, logprobs, limits, "top_logprobs", structured_outputs=structured
        ),
        stream=f.bool_("stream"),
        include_usage=f.stream_include_usage(),
        priority=f.int_("priority", 0) or 0,
        max_tokens_given=max_tokens is not None,
        tools=list(body["tools"]) if tools else None,
        tool_calling=calling,
        structured_param=structured_param,
    )


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

    def add(self, d: ChoiceDelta) -> None:
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
