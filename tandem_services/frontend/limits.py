"""Request bounds and the request fields tandem implements, checked at the frontend.

Everything here runs on the parsed JSON body (or the gRPC message) before anything is queued
or sent to the scheduler, so a request refused here costs nothing downstream. Each refusal is
a `FrontendError` with INVALID_ARGUMENT (HTTP 400) whose `param` names the field and whose
message names the field, the value and the limit (with the flag that sets it).

Invariants:
- a value equal to its limit is accepted; limit + 1 is refused;
- a field tandem does not implement is refused by name, never silently dropped; a field is
  accepted only where it is implemented or where its value is the one tandem's behaviour
  already matches (e.g. `echo: false`, `suffix: ""`). Structured outputs and tools are
  parsed (and their specs checked) in structured.py.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem_services.frontend.structured import template_tool_calls
from tandem_services.frontend.types import FrontendError, invalid


@dataclass(frozen=True)
class RequestLimits:
    """The frontend's configured per-request limits (flags `--max-n` ... in config.py)."""

    max_n: int = 128
    max_best_of: int = 128
    # vLLM's max_logprobs (default 20): top logprobs per token (completions `logprobs`,
    # chat `top_logprobs`, gRPC `sampling_params.logprobs`).
    max_logprobs: int = 20
    max_stop_sequences: int = 64
    # Characters in one stop string.
    max_stop_sequence_len: int = 1024
    max_tools: int = 128
    # Bytes of one tool's JSON (its function schema included).
    max_tool_schema_bytes: int = 64 * 1024
    # The prompt tokens a request makes the workers hold: prompt tokens x n, summed over a
    # completions request's prompts.
    max_prompt_tokens_times_n: int = 1 << 20

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def over_limit(
    field: str, value: int, limit: int, flag: str, what: str | None = None
) -> FrontendError:
    """The error for `field` (its `what`, if not the field itself) at `value`, above `limit`
    (set by `--flag`)."""
    head = f"{field}: {what}" if what else field
    return invalid(f"{head} is {value}; the limit is {limit} (--{flag})", field)


def check_sampling(
    limits: RequestLimits,
    *,
    n: int | None,
    best_of: int | None = None,
    logprobs: int | None = None,
    logprobs_field: str = "logprobs",
    stop: Sequence[str] = (),
) -> None:
    """n, best_of, logprobs and the stop list against their limits (types already checked)."""
    if n is not None and n > limits.max_n:
        raise over_limit("n", n, limits.max_n, "max-n")
    if best_of is not None and best_of > limits.max_best_of:
        raise over_limit("best_of", best_of, limits.max_best_of, "max-best-of")
    if logprobs is not None and logprobs > limits.max_logprobs:
        raise over_limit(logprobs_field, logprobs, limits.max_logprobs, "max-logprobs")
    if len(stop) > limits.max_stop_sequences:
        raise over_limit(
            "stop",
            len(stop),
            limits.max_stop_sequences,
            "max-stop-sequences",
            what="the number of stop sequences",
        )
    for i, s in enumerate(stop):
        if len(s) > limits.max_stop_sequence_len:
            raise over_limit(
                "stop",
                len(s),
                limits.max_stop_sequence_len,
                "max-stop-sequence-len",
                what=f"the length of stop[{i}] (characters)",
            )


def check_prompt_work(limits: RequestLimits, prompt_lens: Sequence[int], n: int) -> None:
    """Prompt tokens x n (summed over the prompts) against `max_prompt_tokens_times_n`."""
    total = sum(prompt_lens) * n
    if total > limits.max_prompt_tokens_times_n:
        raise over_limit(
            "n",
            total,
            limits.max_prompt_tokens_times_n,
            "max-prompt-tokens-times-n",
            what=f"prompt tokens x n ({sum(prompt_lens)} x {n})",
        )


def check_tools(limits: RequestLimits, tools: Any) -> None:
    """The tools list's shape, number and sizes (each tool is checked in structured.py)."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise invalid(f"tools must be a list, got {type(tools).__name__}", "tools")
    if len(tools) > limits.max_tools:
        raise over_limit(
            "tools", len(tools), limits.max_tools, "max-tools", what="the number of tools"
        )
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise invalid(f"tools[{i}] must be an object, got {type(tool).__name__}", "tools")
        size = len(json.dumps(tool, separators=(",", ":")).encode())
        if size > limits.max_tool_schema_bytes:
            raise over_limit(
                "tools",
                size,
                limits.max_tool_schema_bytes,
                "max-tool-schema-bytes",
                what=f"the size of tools[{i}] (bytes of JSON)",
            )


# ----------------------------------------------------------------------------- fields

# Fields both endpoints implement (tandem's SamplingParams and the OpenAI basics).
_COMMON = frozenset(
    {
        "model",
        "n",
        "best_of",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "max_tokens",
        "min_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "include_stop_str_in_output",
        "logprobs",
        "skip_special_tokens",
        "stream",
        "stream_options",
        "priority",
        # An end-user id for abuse monitoring: nothing to do with the output.
        "user",
        # Logits processors (OpenAI's logit_bias; vLLM's extra-body fields).
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
        "vllm_xargs",
    }
)
# Structured outputs (structured.py), on both endpoints.
_STRUCTURED = frozenset({"response_format", "structured_outputs"})
COMPLETION_FIELDS = _COMMON | _STRUCTURED | {"prompt"}
CHAT_FIELDS = (
    _COMMON
    | _STRUCTURED
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
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
    "echo": (lambda v: v is None or v is False, "echo is not implemented"),
    "use_beam_search": (lambda v: v is None or v is False, "use_beam_search is not implemented"),
    "add_generation_prompt": (
        lambda v: v is None or v is True,
        "add_generation_prompt: false is not implemented (the generation prompt is always added)",
    ),
    "continue_final_message": (
        lambda v: v is None or v is False,
        "continue_final_message is not implemented",
    ),
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
    "length_penalty": "beam search",
    "early_stopping": "beam search",
    "prompt_logprobs": "prompt logprobs",
    "truncate_prompt_tokens": "prompt truncation",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "add_special_tokens": "add_special_tokens",
    "chat_template": "a per-request chat template",
    "chat_template_kwargs": "chat template arguments",
    "documents": "documents (RAG chat templates)",
    "mm_processor_kwargs": "multimodal inputs",
    "prompt_embeds": "prompt embeddings",
    "request_id": "client-chosen request ids",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids",
    "return_token_ids": "return_token_ids",
    "cache_salt": "cache_salt",
    "kv_transfer_params": "client KV-transfer parameters",
    "logits_processors": "per-request logits processors (the engine's --logits-processors "
    "are applied to every request; pass their arguments in vllm_xargs)",
    "response_format_schema": "response_format_schema; use response_format",
    "thinking": "reasoning options",
    "include_reasoning": "reasoning options",
}


def reject_unimplemented(body: dict[str, Any], implemented: frozenset[str]) -> None:
    """Refuses (400, naming it) every field of `body` tandem does not implement."""
    for name, value in body.items():
        if name in implemented:
            continue
        if name in _NO_OP_VALUES:
            ok, reason = _NO_OP_VALUES[name]
            if ok(value):
                continue
            raise invalid(f"{reason} (got {name}={_short(value)})", name)
        if name in _UNIMPLEMENTED:
            raise invalid(f"{name} ({_UNIMPLEMENTED[name]}) is not implemented by tandem", name)
        raise invalid(f"unknown field {name!r} (tandem does not implement it)", name)


def _short(value: Any, limit: int = 80) -> str:
    s = json.dumps(value, default=str)
    return s if len(s) <= limit else s[: limit - 3] + "..."


# ----------------------------------------------------------------------------- chat messages

# Roles tandem renders through the chat template; "tool" messages answer an assistant's
# tool calls.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_FIELDS = frozenset({"role", "content"})
_UNSUPPORTED_PARTS = {
    "image_url": "images",
    "input_image": "images",
    "input_audio": "audio",
    "audio_url": "audio",
    "video_url": "video",
    "file": "files",
    "refusal": "refusal parts",
}


def _content_text(content: Any, i: int) -> str:
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(
            f"{where} must be a string or a list of content parts, got {type(content).__name__}",
            "messages",
        )
    parts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise invalid(f"{at} must be an object, got {type(part).__name__}", "messages")
        kind = part.get("type")
        if kind != "text":
            if kind in _UNSUPPORTED_PARTS:
                raise invalid(
                    f"{at}: content parts of type {kind!r} ({_UNSUPPORTED_PARTS[kind]}) are not "
                    'supported; only "text"',
                    "messages",
                )
            raise invalid(f'{at}: unknown content part type {kind!r}; only "text"', "messages")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{at}.text must be a string, got {type(text).__name__}", "messages")
        extra = sorted(set(part) - {"type", "text"})
        if extra:
            raise invalid(f"{at}: unknown field {extra[0]!r} in a text part", "messages")
        parts.append(text)
    return "".join(parts)


def check_messages(raw: Any) -> list[dict[str, Any]]:
    """A chat request's messages for the chat template: role and content (a string), with an
    assistant's `tool_calls` (arguments parsed into objects) and a tool message's
    `tool_call_id`; 400 naming the first problem."""
    if not isinstance(raw, list) or not raw:
        raise invalid("messages must be a non-empty list", "messages")
    messages: list[dict[str, Any]] = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise invalid(f"messages[{i}] must be an object", "messages")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise invalid(f"messages[{i}].role must be a non-empty string", "messages")
        if role not in CHAT_ROLES:
            hint = " (legacy function calling is not implemented; use tools)" * (role == "function")
            raise invalid(
                f"messages[{i}].role {role!r} is not one of {', '.join(CHAT_ROLES)}{hint}",
                "messages",
            )
        out: dict[str, Any] = {"role": role}
        for key in msg:
            if key in _MESSAGE_FIELDS:
                continue
            if key == "tool_calls" and role == "assistant":
                if msg[key]:
                    out["tool_calls"] = template_tool_calls(msg[key], f"messages[{i}].tool_calls")
                continue
            if key == "tool_call_id" and role == "tool":
                if not isinstance(msg[key], str) or not msg[key]:
                    raise invalid(
                        f"messages[{i}].tool_call_id must be a non-empty string", "messages"
                    )
                out["tool_call_id"] = msg[key]
                continue
            if key in ("tool_calls", "function_call", "tool_call_id"):
                if msg[key] is None or msg[key] == []:
                    continue
                where = "assistant" if key == "tool_calls" else "tool"
                if key == "function_call":
                    raise invalid(
                        f"messages[{i}].function_call (legacy function calling) is not "
                        "implemented; use tool_calls",
                        "messages",
                    )
                raise invalid(
                    f"messages[{i}].{key} belongs on a {where} message, not {role!r}", "messages"
                )
            if key == "name":
                if msg[key] is None:
                    continue
                raise invalid(
                    f"messages[{i}].name (participant names) is not implemented", "messages"
                )
            raise invalid(f"messages[{i}]: unknown field {key!r}", "messages")
        content = msg.get("content")
        if content is None:
            if "tool_calls" not in out:
                raise invalid(f"messages[{i}].content is required for role {role!r}", "messages")
            content = ""
        if role == "tool" and "tool_call_id" not in out:
            raise invalid(f"messages[{i}].tool_call_id is required for role 'tool'", "messages")
        out["content"] = _content_text(content, i)
        messages.append(out)
    return messages
