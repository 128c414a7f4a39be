"""Server-sent events of the OpenAI streaming responses: one renderer per stream.

`render(i, event)` turns one `StepEvent` of prompt `i` (every choice's new text of one
step, or of several when the handler fell behind) into ONE string, the stream's one write
for it ("" when there is nothing to send); `final(usage)` the usage chunk (with
`stream_options.include_usage`). The HTTP handler writes what they return, the last event's
together with `final` and `data: [DONE]`.

The per-step path builds no dict for a chunk's constant fields: they are encoded once per
stream (`_head`), and a choice without logprobs is formatted directly; the bytes are those
of `json.dumps(chunk, separators=(",", ":"), ensure_ascii=False)` either way.
"""

from __future__ import annotations

import json
from typing import Any

from tandem.core.outputs import Logprobs
from tandem_services.frontend.openai_protocol import (
    TokenText,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    joined_logprobs,
    tool_call_body,
    usage_body,
)
from tandem_services.frontend.types import StepEvent, Usage

DONE = "data: [DONE]\n\n"


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


def with_usage(text: str, usage: Usage) -> str:
    """Each chunk of `text` (rendered SSE) with `usage` after its choices (vLLM's
    `continuous_usage_stats`). A chunk ends in `]}` and a blank line; JSON strings hold no
    raw newline, so no string ends one."""
    return text.replace("]}\n\n", f'],"usage":{dumps(usage_body(usage))}}}\n\n')


def _reason(value: int | str | None) -> str:
    """A finish or stop reason as JSON."""
    if value is None:
        return "null"
    if isinstance(value, int):
        return str(value)
    return dumps(value)


def _head(rid: str, obj: str, created: int, model: str) -> str:
    """`data: {"id":..,"object":..,"created":..,"model":..,"choices":` of every chunk."""
    return (
        f'data: {{"id":{dumps(rid)},"object":{dumps(obj)},"created":{created},'
        f'"model":{dumps(model)},"choices":'
    )


class CompletionStream:
    """`/v1/completions` with `stream: true`: choice `index = i * n + choice`."""

    def __init__(
        self,
        rid: str,
        created: int,
        model: str,
        n: int,
        want_logprobs: bool,
        include_usage: bool,
        token_text: TokenText,
        echo: list[str] | None = None,
        prompt_only: bool = False,
        prompt_ids: list[list[int]] | None = None,
        return_token_ids: bool = False,
    ) -> None:
        """`echo`: each prompt's text, sent before the first text of each of its choices;
        with logprobs, the prompt's tokens (`prompt_ids`, each prompt's token ids) and their
        logprobs (ChoiceDelta.prompt_logprobs) head the choice's logprobs likewise.
        `prompt_only` (echo with max_tokens 0): the choices' own tokens are not shown.
        `return_token_ids` (vLLM's): each chunk's choice carries its new `token_ids`, a
        choice's first one its prompt's `prompt_token_ids` too."""
        self.rid = rid
        self.created = created
        self.model = model
        self.n = n
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.token_text = token_text
        self.echo = echo
        self.prompt_only = prompt_only
        self.prompt_ids = prompt_ids
        self.return_token_ids = return_token_ids
        self._ids_started: set[int] = set()
        self._echoed: set[int] = set()
        self._offsets: dict[int, int] = {}
        self._head = _head(rid, "text_completion", created, model)

    def chunk(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            out["usage"] = usage_body(usage)
        return out

    def logprobs(
        self,
        index: int,
        logprobs: list[Logprobs] | None,
        prompt_logprobs: list[Logprobs] | None = None,
    ) -> dict[str, Any]:
        """Choice `index`'s logprobs object for its next tokens, after the ones it had; the
        echoed prompt's head it when `prompt_logprobs` (its first delta's) are given."""
        offset = self._offsets.get(index, 0)
        head = None
        if self.echo is not None and self.prompt_ids is not None and prompt_logprobs is not None:
            first = self.prompt_ids[index // self.n][0]
            head = echo_logprobs(first, prompt_logprobs, self.token_text)
            offset += sum(len(t) for t in head["tokens"])
        shown = [] if self.prompt_only else logprobs or []
        lp = completion_logprobs(shown, self.token_text, offset)
        self._offsets[index] = offset + sum(len(t) for t in lp["tokens"])
        return lp if head is None else joined_logprobs(head, lp)

    def render(self, i: int, event: StepEvent) -> str:
        choices = []
        want_logprobs = self.want_logprobs
        with_ids = self.return_token_ids
        for d in event.deltas:
            if (
                not d.text
                and d.finish_reason is None
                and not (want_logprobs and d.logprobs)
                and not (with_ids and d.token_ids)
            ):
                continue
            index = i * self.n + d.index
            text = "" if self.prompt_only else d.text
            if self.echo is not None and index not in self._echoed:
                self._echoed.add(index)
                text = self.echo[i] + text
            ids = self._token_ids(i, index, d.token_ids)
            if not want_logprobs:
                choices.append(
                    f'{{"index":{index},"text":{dumps(text)},"logprobs":null,'
                    f'"finish_reason":{_reason(d.finish_reason)},'
                    f'"stop_reason":{_reason(d.stop_reason)}{ids}}}'
                )
                continue
            entry = {
                "index": index,
                "text": text,
                "logprobs": self.logprobs(index, d.logprobs, d.prompt_logprobs),
                "finish_reason": d.finish_reason,
                "stop_reason": d.stop_reason,
            }
            choices.append(dumps(entry)[:-1] + ids + "}")
        if not choices:
            return ""
        return f"{self._head}[{','.join(choices)}]}}\n\n"

    def _token_ids(self, i: int, index: int, token_ids: list[int]) -> str:
        """The choice's `token_ids` (and on its first chunk `prompt_token_ids`) as JSON
        members after a comma; "" without return_token_ids."""
        if not self.return_token_ids or self.prompt_ids is None:
            return ""
        shown = [] if self.prompt_only else token_ids
        out = f',"token_ids":{dumps(shown)}'
        if index not in self._ids_started:
            self._ids_started.add(index)
            out += f',"prompt_token_ids":{dumps(self.prompt_ids[i])}'
        return out

    def final(self, usage: Usage) -> str:
        return sse(self.chunk([], usage)) if self.include_usage else ""


class ChatStream:
    """`/v1/chat/completions` with `stream: true`: a role chunk opens each choice; a delta
    carries `content` and/or `tool_calls` (each call's first delta with its id, type and
    name, every one with more of its arguments)."""

    def __init__(
        self,
        rid: str,
        created: int,
        model: str,
        want_logprobs: bool,
        include_usage: bool,
        token_text: TokenText,
        prompt_ids: list[int] | None = None,
    ) -> None:
        """`prompt_ids` (vLLM's return_token_ids): the first chunk carries them as
        `prompt_token_ids`, each choice its new `token_ids`."""
        self.rid = rid
        self.created = created
        self.model = model
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.token_text = token_text
        self.prompt_ids = prompt_ids
        self._started: set[int] = set()
        self._head = _head(rid, "chat.completion.chunk", created, model)
        self._first_head = self._head
        if prompt_ids is not None:
            self._first_head = (
                self._head.removesuffix('"choices":')
                + f'"prompt_token_ids":{dumps(prompt_ids)},"choices":'
            )

    def chunk(
        self, choices: list[dict[str, Any]], usage: Usage | None = None, full: bool = False
    ) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.rid,
            "object": "chat.completion" if full else "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            out["usage"] = usage_body(usage)
        return out

    def render(self, i: int, event: StepEvent) -> str:
        lines = []
        choices = []
        want_logprobs = self.want_logprobs
        with_ids = self.prompt_ids is not None
        for d in event.deltas:
            if d.index not in self._started:
                head = self._head if self._started else self._first_head
                self._started.add(d.index)
                role = (
                    f'{{"index":{d.index},"delta":{{"role":"assistant","content":""}},'
                    '"logprobs":null,"finish_reason":null}'
                )
                lines.append(f"{head}[{role}]}}\n\n")
            if (
                not d.text
                and d.finish_reason is None
                and not d.tool_calls
                and not (want_logprobs and d.logprobs)
                and not (with_ids and d.token_ids)
            ):
                continue
            parts = []
            if d.text:
                parts.append(f'"content":{dumps(d.text)}')
            if d.tool_calls:
                calls = [tool_call_body(c, index=True) for c in d.tool_calls]
                parts.append(f'"tool_calls":{dumps(calls)}')
            delta = "{" + ",".join(parts) + "}"
            logprobs = (
                dumps(chat_logprobs(d.logprobs or [], self.token_text)) if want_logprobs else "null"
            )
            ids = f',"token_ids":{dumps(d.token_ids)}' if with_ids else ""
            choices.append(
                f'{{"index":{d.index},"delta":{delta},"logprobs":{logprobs},'
                f'"finish_reason":{_reason(d.finish_reason)},'
                f'"stop_reason":{_reason(d.stop_reason)}{ids}}}'
            )
        if choices:
            lines.append(f"{self._head}[{','.join(choices)}]}}\n\n")
        return "".join(lines)

    def final(self, usage: Usage) -> str:
        return sse(self.chunk([], usage)) if self.include_usage else ""
