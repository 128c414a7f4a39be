"""Server-sent events of the OpenAI streaming responses: one renderer per stream.

`render(i, event)` turns one `StepEvent` of prompt `i` into the lines to send for it;
`final(usage)` the usage chunk (with `stream_options.include_usage`). The HTTP handler
writes what they return, then `data: [DONE]`.
"""

from __future__ import annotations

import json
from typing import Any

from services.frontend.openai_protocol import (
    TokenText,
    chat_logprobs,
    completion_logprobs,
    usage_body,
)
from services.frontend.types import StepEvent, Usage

DONE = "data: [DONE]\n\n"


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


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
    ) -> None:
        self.rid = rid
        self.created = created
        self.model = model
        self.n = n
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.token_text = token_text
        self._offsets: dict[int, int] = {}

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

    def render(self, i: int, event: StepEvent) -> list[str]:
        choices = []
        want_logprobs = self.want_logprobs
        offsets = self._offsets
        for d in event.deltas:
            if not d.text and d.finish_reason is None and not (want_logprobs and d.logprobs):
                continue
            index = i * self.n + d.index
            lp = None
            if want_logprobs:
                lp = completion_logprobs(d.logprobs or [], self.token_text, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in lp["tokens"])
            choices.append(
                {
                    "index": index,
                    "text": d.text,
                    "logprobs": lp,
                    "finish_reason": d.finish_reason,
                    "stop_reason": d.stop_reason,
                }
            )
        return [sse(self.chunk(choices))] if choices else []

    def final(self, usage: Usage) -> list[str]:
        return [sse(self.chunk([], usage))] if self.include_usage else []


class ChatStream:
    """`/v1/chat/completions` with `stream: true`: a role chunk opens each choice."""

    def __init__(
        self,
        rid: str,
        created: int,
        model: str,
        want_logprobs: bool,
        include_usage: bool,
        token_text: TokenText,
    ) -> None:
        self.rid = rid
        self.created = created
        self.model = model
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.token_text = token_text
        self._started: set[int] = set()

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

    def render(self, i: int, event: StepEvent) -> list[str]:
        lines = []
        choices = []
        want_logprobs = self.want_logprobs
        for d in event.deltas:
            if d.index not in self._started:
                self._started.add(d.index)
                lines.append(
                    sse(
                        self.chunk(
                            [
                                {
                                    "index": d.index,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ]
                        )
                    )
                )
            if not d.text and d.finish_reason is None and not (want_logprobs and d.logprobs):
                continue
            choices.append(
                {
                    "index": d.index,
                    "delta": {"content": d.text} if d.text else {},
                    "logprobs": chat_logprobs(d.logprobs or [], self.token_text)
                    if want_logprobs
                    else None,
                    "finish_reason": d.finish_reason,
                    "stop_reason": d.stop_reason,
                }
            )
        if choices:
            lines.append(sse(self.chunk(choices)))
        return lines

    def final(self, usage: Usage) -> list[str]:
        return [sse(self.chunk([], usage))] if self.include_usage else []
