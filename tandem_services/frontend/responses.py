"""OpenAI's Responses API (`POST /v1/responses`, `client.responses.create`) over the chat path.

A Responses body is rewritten into the chat completion it asks for (`chat_request`), which
`parse_chat` then checks as any chat body (so sampling fields, vLLM's extensions, limits and
refusals are the chat endpoint's), and the chat machinery's output is shaped back:

    input (a string, or items)      messages: `message` items (roles user / system /
                                    developer / assistant; text parts), `function_call`
                                    items as the assistant's tool calls, `function_call_output`
                                    items as tool messages
    instructions                    a system message first
    max_output_tokens               max_completion_tokens
    text.format                     response_format (text, json_object, json_schema)
    tools / tool_choice             function tools as chat's (`{"type": "function",
                                    "function": {...}}`)

The response is one `response` object: a `message` item with the text as `output_text`,
then a `function_call` item per tool call; status `incomplete` (`max_output_tokens`) when
the output ran into its limit. Streamed (`ResponsesStream`), the typed events OpenAI sends
(`response.created`, `response.output_item.added`, `response.output_text.delta`, ...,
`response.completed`), numbered by `sequence_number`. `include:
["message.output_text.logprobs"]` (or `top_logprobs`) puts each output token's logprob, and
its `top_logprobs` alternatives, on the text (chat's entries).

Stored responses (`store`, true unless the body says false; response_store.py): the
finished response and its conversation's items are kept by the frontend, and a body naming
`previous_response_id` is answered over that conversation followed by its own input (the
handler looks it up and passes its items as `history`). A background run, a prompt
template, reasoning options, stored conversations, input images and files are refused by
name (400).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.core.outputs import FinishReason, Logprobs
from tandem_services.frontend.openai_protocol import ChoiceAccumulator, TokenText, chat_logprobs
from tandem_services.frontend.sse import dumps
from tandem_services.frontend.types import FrontendError, StepEvent, Usage, invalid

# Responses fields refused, with what they ask for (a value of None / false is accepted).
_REFUSED = {
    "conversation": "stored conversations (previous_response_id chains responses)",
    "background": "background responses",
    "prompt": "prompt templates",
    "reasoning": "reasoning options",
    "max_tool_calls": "a cap on built-in tool calls",
}
# `include` values served: the output text's logprobs (with `top_logprobs` alternatives).
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Chat completion fields a Responses body does not take (it has its own for some).
_CHAT_ONLY = (
    "messages", "max_tokens", "max_completion_tokens", "response_format", "n", "logprobs",
    "stream_options", "use_beam_search", "prompt_logprobs", "echo", "return_token_ids",
    "functions", "function_call",
)  # fmt: skip
# Fields echoed into the response object and not passed on to the chat body.
_ECHOED = ("metadata", "truncation")
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


@dataclass(frozen=True)
class ResponsesRequest:
    """What a Responses body says beyond the chat completion it becomes: what its response
    echoes, whether the output text carries its logprobs (`include`), whether it is stored,
    and the conversation's input items so far (a stored predecessor's, then its own)."""

    echo: dict[str, Any]
    logprobs: bool = False
    store: bool = False
    items: tuple[dict[str, Any], ...] = ()


def previous_response_id(values: Any) -> str | None:
    """The body's `previous_response_id` (None when absent); 400 when not a string."""
    previous = values.get("previous_response_id") if isinstance(values, dict) else None
    if previous is not None and not isinstance(previous, str):
        raise invalid("previous_response_id must be a string", "previous_response_id")
    return previous


def chat_request(
    values: dict[str, Any],
    history: tuple[dict[str, Any], ...] = (),
    store_enabled: bool = False,
) -> tuple[dict[str, Any], ResponsesRequest]:
    """The chat completion body a Responses body asks for, and what its response echoes.
    `history`: the input items of the stored response the body's `previous_response_id`
    names (the handler's lookup), put before its input. `store_enabled`: whether the
    frontend keeps responses (else `store` is answered false). FrontendError (400, naming
    the field) for what is not implemented or malformed."""
    if not isinstance(values, dict):
        raise invalid("the body must be a JSON object")
    body = dict(values)
    previous = previous_response_id(body)
    body.pop("previous_response_id", None)
    store = body.pop("store", None)
    if store is not None and not isinstance(store, bool):
        raise invalid("store must be a boolean", "store")
    for name in _CHAT_ONLY:
        if name in body:
            raise invalid(
                f"{name} is a chat completions field, not one of /v1/responses (see input, "
                "max_output_tokens, text.format)",
                name,
            )
    for name, what in _REFUSED.items():
        value = body.pop(name, None)
        if value not in (None, False, [], {}):
            raise invalid(f"{name} is not supported: {what}", name)
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise invalid(
            f"truncation {truncation!r} is not supported (disabled: a prompt over the "
            "context is refused)",
            "truncation",
        )
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise invalid("metadata must be an object", "metadata")
    echo = {name: body.pop(name) for name in _ECHOED if name in body}
    if "input" not in body or body["input"] is None:
        raise invalid("input is required", "input")
    instructions = body.pop("instructions", None)
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions must be a string", "instructions")
    items = (*history, *_items(body.pop("input")))
    messages = _messages(list(items))
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    body["messages"] = messages
    if "max_output_tokens" in body:
        body["max_completion_tokens"] = body.pop("max_output_tokens")
    include = body.pop("include", None) or []
    if not isinstance(include, list) or any(v != LOGPROBS_INCLUDE for v in include):
        raise invalid(f"include: only {LOGPROBS_INCLUDE!r} is supported", "include")
    logprobs = bool(include) or body.get("top_logprobs") is not None
    if logprobs:
        body["logprobs"] = True
    text = body.pop("text", None)
    if text is not None:
        body["response_format"] = _response_format(text)
    if body.get("tools") is not None:
        body["tools"] = [_tool(t, i) for i, t in enumerate(_list(body["tools"], "tools"))]
    if "tool_choice" in body:
        body["tool_choice"] = _tool_choice(body["tool_choice"])
    echo.update(
        instructions=instructions,
        max_output_tokens=values.get("max_output_tokens"),
        metadata=echo.get("metadata") or {},
        parallel_tool_calls=values.get("parallel_tool_calls", True),
        temperature=values.get("temperature", 1.0),
        top_p=values.get("top_p", 1.0),
        tool_choice=values.get("tool_choice", "auto"),
        tools=values.get("tools") or [],
        text=text or {"format": {"type": "text"}},
        truncation="disabled",
        store=store_enabled and store is not False,
        user=values.get("user"),
        top_logprobs=values.get("top_logprobs"),
        previous_response_id=previous,
    )
    return body, ResponsesRequest(echo, logprobs, echo["store"], items)


def _items(value: Any) -> tuple[dict[str, Any], ...]:
    """`input` as input items: a string is one user message."""
    if isinstance(value, str):
        return ({"type": "message", "role": "user", "content": value},)
    return tuple(_list(value, "input"))


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise invalid(f"{name} must be a list", name)
    return value


def _messages(value: Any) -> list[dict[str, Any]]:
    """`input` as chat messages (see the module docstring)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(_list(value, "input")):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise invalid(f"{where}.role {item.get('role')!r} is not one of {list(_ROLES)}")
            messages.append({"role": role, "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _field(item, "name", where),
                    "arguments": _field(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # calls of one turn, together
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _content(output, where)
            messages.append(
                {"role": "tool", "tool_call_id": _field(item, "call_id", where), "content": output}
            )
        else:
            raise invalid(f"{where}: input items of type {kind!r} are not supported", "input")
    if not messages:
        raise invalid("input holds no message", "input")
    return messages


def _field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise invalid(f"{where}.{name} must be a string", "input")
    return value


def _content(content: Any, where: str) -> str:
    """A message's content as text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    parts = []
    for part in _list(content, "input"):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise invalid(
                f"{where}: content parts of type {kind!r} are not supported (text only)", "input"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{where}: a {kind} part needs its text", "input")
        parts.append(text)
    return "".join(parts)


def _response_format(text: Any) -> dict[str, Any]:
    """`text.format` as chat's `response_format`."""
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict):
        raise invalid("text.format must be an object", "text")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise invalid(f"text.format.type {kind!r} is not one of text, json_object, json_schema", "text")


def _tool(tool: Any, i: int) -> dict[str, Any]:
    """A Responses function tool (flat) as chat's."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise invalid(f"tools[{i}]: tools of type {kind!r} are not supported (function)", "tools")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


# ----------------------------------------------------------------------------- output


def response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        # cache_write_tokens: OpenAI's explicit cache writes; tandem's prefix cache is
        # automatic, so there are none to count.
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _message(
    item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    content = [part]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [] if status == "in_progress" else content,
    }


def _function_call(call: Any, item_id: str, arguments: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id or f"call_{uuid.uuid4().hex[:24]}",
        "name": call.name or "",
        "arguments": arguments,
        "status": "completed",
    }


class ResponseBuilder:
    """One response object and its output items, whole (`response`) or as stream events."""

    def __init__(
        self,
        rid: str,
        model: str,
        request: ResponsesRequest,
        token_text: TokenText | None = None,
        on_finished: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """`on_finished`: called with each finished response of a request that is stored."""
        self.rid = rid
        self.model = model
        self.request = request
        self.token_text = token_text
        self.on_finished = on_finished
        self.created = int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex}"

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: Usage | None,
        incomplete: str | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "usage": _usage(usage) if usage is not None else None,
            "reasoning": None,
            "background": False,
            **self.request.echo,
        }

    def logprobs(self, logprobs: list[Logprobs] | None) -> list[dict[str, Any]]:
        """The output text's logprobs as the Responses API lays them out (chat's entries:
        token, logprob, bytes, top_logprobs), when the request included them."""
        if not self.request.logprobs or not logprobs:
            return []
        assert self.token_text is not None, "a response with logprobs needs the token text"
        content: list[dict[str, Any]] = chat_logprobs(logprobs, self.token_text)["content"]
        return content

    def output(self, acc: ChoiceAccumulator) -> list[dict[str, Any]]:
        """The finished choice's output items: its text as a message (unless it only called
        tools), then its tool calls."""
        calls = sorted((acc.tool_calls or {}).items())
        status = "incomplete" if acc.finish_reason == FinishReason.LENGTH else "completed"
        message = _message(self.message_id, acc.text, status, self.logprobs(acc.logprobs))
        items = [] if calls and not acc.text else [message]
        for _, call in calls:
            items.append(_function_call(call, f"fc_{uuid.uuid4().hex}", call.arguments))
        return items

    def finished(self, acc: ChoiceAccumulator, usage: Usage) -> dict[str, Any]:
        """The whole response of a finished choice, stored (`on_finished`) when asked."""
        if acc.finish_reason == FinishReason.LENGTH:
            whole = self.response("incomplete", self.output(acc), usage, "max_output_tokens")
        else:
            whole = self.response("completed", self.output(acc), usage)
        if self.request.store and self.on_finished is not None:
            self.on_finished(whole)
        return whole


class ResponsesStream:
    """`stream: true`: the Responses API's typed events, written as `render` / `final` for
    the HTTP handler's stream (one prompt, one choice). Text opens the message item on its
    first piece and streams as `response.output_text.delta`; tool calls (their text withheld
    by the tool-call parser) come as `function_call` items once the choice ends."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.builder = builder
        self.acc = ChoiceAccumulator()
        self.seq = 0
        self.started = False
        self.message_open = False
        # Logprobs of tokens that added no text yet: sent with the next text delta.
        self.pending: list[Logprobs] = []

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {dumps(body)}\n\n"

    def _start(self) -> str:
        self.started = True
        skeleton = self.builder.response("in_progress", [], None)
        return self._event("response.created", response=skeleton) + self._event(
            "response.in_progress", response=skeleton
        )

    def _part(self) -> dict[str, Any]:
        return {"item_id": self.builder.message_id, "output_index": 0, "content_index": 0}

    def render(self, i: int, event: StepEvent) -> str:
        out = [] if self.started else [self._start()]
        for d in event.deltas:
            self.acc.add(d)
            self.pending += d.logprobs or []
            if not d.text:
                continue
            if not self.message_open:
                self.message_open = True
                item = _message(self.builder.message_id, "", "in_progress")
                out.append(self._event("response.output_item.added", output_index=0, item=item))
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                out.append(self._event("response.content_part.added", **self._part(), part=part))
            logprobs, self.pending = self.builder.logprobs(self.pending), []
            out.append(
                self._event(
                    "response.output_text.delta", **self._part(), delta=d.text, logprobs=logprobs
                )
            )
        return "".join(out)

    def final(self, usage: Usage) -> str:
        out = [] if self.started else [self._start()]
        acc = self.acc
        items = self.builder.output(acc)
        index = 0
        if self.message_open or (items and items[0]["type"] == "message"):
            if not self.message_open:  # an empty message: opened and closed here
                item = _message(self.builder.message_id, "", "in_progress")
                out.append(self._event("response.output_item.added", output_index=0, item=item))
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                out.append(self._event("response.content_part.added", **self._part(), part=part))
            message = items[0]
            logprobs = message["content"][0]["logprobs"]
            out.append(
                self._event(
                    "response.output_text.done", **self._part(), text=acc.text, logprobs=logprobs
                )
            )
            out.append(
                self._event(
                    "response.content_part.done", **self._part(), part=message["content"][0]
                )
            )
            out.append(self._event("response.output_item.done", output_index=0, item=message))
            index = 1
        for item in items[index:]:
            opened = {**item, "arguments": "", "status": "in_progress"}
            ref = {"item_id": item["id"], "output_index": index}
            out.append(self._event("response.output_item.added", output_index=index, item=opened))
            args = item["arguments"]
            out.append(self._event("response.function_call_arguments.delta", **ref, delta=args))
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    **ref,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            out.append(self._event("response.output_item.done", output_index=index, item=item))
            index += 1
        whole = self.builder.finished(acc, usage)
        kind = "response.incomplete" if whole["status"] == "incomplete" else "response.completed"
        out.append(self._event(kind, response=whole))
        return "".join(out)

    def error(self, exc: FrontendError) -> str:
        """A failure after the stream began: the `error` event."""
        return self._event("error", code=str(exc.http_status), message=exc.message, param=exc.param)
