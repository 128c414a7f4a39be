"""Request bounds and the shape of chat messages: the checks a request's declared fields
name (openai_protocol.py's request models, grpc_api.py's `parse_generate`).

Nothing here walks a request: each check is called once, by the one pass that reads the field
it belongs to (or, for `check_prompt_work`, once the prompts are tokenized), before anything
is queued or sent to the scheduler, so a request refused here costs nothing downstream. Each
refusal is a `FrontendError` with INVALID_ARGUMENT (HTTP 400) whose `param` names the field and
whose message names the field, the value and the limit (with the flag that sets it).

Invariant: a value equal to its limit is accepted; limit + 1 is refused.
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
    # chat `top_logprobs`, `prompt_logprobs`, gRPC `sampling_params.logprobs` and
    # `sampling_params.prompt_logprobs`).
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


def check_at_most(limits: RequestLimits, field: str, value: int, limit: str) -> None:
    """`field`'s `value` against the limit named `limit` (a `RequestLimits` field, set by the
    flag of the same name: `max_n` -> `--max-n`)."""
    bound = getattr(limits, limit)
    if value > bound:
        raise over_limit(field, value, bound, limit.replace("_", "-"))


def check_stop(limits: RequestLimits, stop: Sequence[str]) -> None:
    """The stop list's length and each stop string's length against their limits."""
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
