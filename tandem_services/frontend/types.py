"""The frontend's internal messages: what a client asked for and what it gets back."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from tandem.core.outputs import FinishReason, Logprobs
from tandem.engine.chat_template import template_options_problem
from tandem.sampling_params import SamplingParams

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class FrontendError(Exception):
    """A request that cannot be served; carries the gRPC code (and so the HTTP status)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        param: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        # Overload (RESOURCE_EXHAUSTED): when to retry, from the scheduler's admission
        # control; HTTP `Retry-After`, gRPC trailing metadata `retry-after`.
        self.retry_after_s = retry_after_s

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS.get(self.code, 500)


def invalid(message: str, param: str | None = None) -> FrontendError:
    return FrontendError(grpc.StatusCode.INVALID_ARGUMENT, message, param)


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How a conversation becomes the prompt (vLLM's fields). `add_generation_prompt`: end
    with the assistant's turn opened; `continue_final_message`: end inside the final message,
    left open for the model to go on (its trailing end-of-turn tokens dropped); never both.
    `kwargs`: extra template variables (tandem.engine.chat_template)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problem = template_options_problem(
            self.add_generation_prompt, self.continue_final_message, self.kwargs
        )
        if problem is not None:
            raise invalid(*problem)


# The template as vLLM applies it when a request says nothing: the generation prompt added.
DEFAULT_TEMPLATE = ChatTemplateOptions()


@dataclass(frozen=True)
class PromptOptions:
    """How a request's prompt is tokenized and cached (vLLM's fields, both APIs).

    `add_special_tokens`: the tokenizer's own (BOS, ...) around a text prompt; None: the
    endpoint's default (true for text, false for a chat, whose template writes them).
    `truncate_prompt_tokens`: keep only the last k prompt tokens (-1: the model's context).
    `cache_salt`: a secret mixed into the first block's hash, so only requests with the same
    salt share cached prefixes (tandem.core.kv_cache_utils)."""

    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        k = self.truncate_prompt_tokens
        if k is not None and k != -1 and k < 1:
            raise invalid(
                f"truncate_prompt_tokens must be -1 (the model's context) or >= 1, got {k}",
                "truncate_prompt_tokens",
            )
        if self.cache_salt is not None and not self.cache_salt:
            raise invalid("cache_salt must be a non-empty string", "cache_salt")

    def special_tokens(self, default: bool) -> bool:
        return default if self.add_special_tokens is None else self.add_special_tokens


DEFAULT_PROMPT_OPTIONS = PromptOptions()


@dataclass(frozen=True)
class GenerateInput:
    """One prompt, tokenized, with validated sampling parameters (n choices)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None
    priority: int = 0
    cache_salt: str | None = None


@dataclass
class ToolCallDelta:
    """More of one tool call: the first delta of call `index` (its position in the choice's
    tool_calls) has `id` and `name`; each carries more of the arguments' JSON text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def then(self, later: ToolCallDelta) -> ToolCallDelta:
        """This delta followed by a later one of the same call, as one delta."""
        return ToolCallDelta(
            self.index,
            self.id or later.id,
            self.name or later.name,
            self.arguments + later.arguments,
        )


@dataclass
class ChoiceDelta:
    """What one choice produced since the previous event. With tool calling (chat), `text`
    is the content part and `tool_calls` the calls' deltas (tool_parsers.py)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    # With sampling_params.prompt_logprobs, on each choice's first delta: its prompt's, one
    # per prompt token after the first (the prompt token first, at its rank, then the top k).
    prompt_logprobs: list[Logprobs] | None = None

    def then(self, later: ChoiceDelta) -> ChoiceDelta:
        """This delta followed by a later one of the same choice, as one delta."""
        logprobs = self.logprobs
        if later.logprobs:
            logprobs = (logprobs or []) + later.logprobs
        return ChoiceDelta(
            self.index,
            self.text + later.text,
            self.token_ids + later.token_ids,
            logprobs,
            later.finish_reason if later.finish_reason is not None else self.finish_reason,
            later.stop_reason if later.finish_reason is not None else self.stop_reason,
            _then_calls(self.tool_calls, later.tool_calls),
            self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
        )


def _then_calls(
    a: list[ToolCallDelta] | None, b: list[ToolCallDelta] | None
) -> list[ToolCallDelta] | None:
    if not a or not b:
        return a or b
    out = list(a)
    for d in b:
        for i, have in enumerate(out):
            if have.index == d.index:
                out[i] = have.then(d)
                break
        else:
            out.append(d)
    return out


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class StepEvent:
    """One batch of deltas for one request; the last one has `usage` set."""

    deltas: list[ChoiceDelta] = field(default_factory=list)
    usage: Usage | None = None
    error: FrontendError | None = None

    @property
    def finished(self) -> bool:
        return self.usage is not None or self.error is not None
