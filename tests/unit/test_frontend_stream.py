"""The frontend's per-step output: queued events merged into one, one SSE write per event
whose bytes are the JSON encoding of the chunk."""

from __future__ import annotations

import asyncio
import json

import grpc

from tandem.core.outputs import Logprobs
from tandem_services.frontend.engine import merge_queued
from tandem_services.frontend.openai_protocol import (
    TokenText,
    parse_completion,
    prompt_logprobs_body,
)
from tandem_services.frontend.sse import ChatStream, CompletionStream, dumps, with_usage
from tandem_services.frontend.types import (
    ChoiceDelta,
    FrontendError,
    StepEvent,
    ToolCallDelta,
    Usage,
)


def _queue(events: list[StepEvent]) -> asyncio.Queue[StepEvent]:
    queue: asyncio.Queue[StepEvent] = asyncio.Queue()
    for e in events:
        queue.put_nowait(e)
    return queue


def test_queued_events_merge_into_one() -> None:
    first = StepEvent([ChoiceDelta(0, "a", [1]), ChoiceDelta(1, "x", [7])])
    queue = _queue(
        [
            StepEvent([ChoiceDelta(0, "b", [2])]),
            StepEvent(
                [ChoiceDelta(1, "y", [8], None, "stop", "y"), ChoiceDelta(0, "c", [3])],
                usage=Usage(4, 5),
            ),
        ]
    )
    [merged] = merge_queued(first, queue)
    assert queue.empty()
    assert [
        (d.index, d.text, d.token_ids, d.finish_reason, d.stop_reason) for d in merged.deltas
    ] == [
        (0, "abc", [1, 2, 3], None, None),
        (1, "xy", [7, 8], "stop", "y"),
    ]
    assert merged.usage == Usage(4, 5) and merged.finished
    # Nothing queued: the event itself.
    alone = StepEvent([ChoiceDelta(0, "a", [1])])
    assert merge_queued(alone, _queue([])) == [alone]


def test_an_error_is_not_merged_and_comes_after_the_text() -> None:
    error = StepEvent(error=FrontendError(grpc.StatusCode.UNAVAILABLE, "worker lost"))
    queue = _queue([StepEvent([ChoiceDelta(0, "b", [2])]), error, StepEvent()])
    merged, err = merge_queued(StepEvent([ChoiceDelta(0, "a", [1])]), queue)
    assert merged.deltas[0].text == "ab" and not merged.finished
    assert err is error
    assert queue.qsize() == 1


def test_one_write_per_event_is_the_json_of_the_chunk() -> None:
    tt = TokenText(None)
    text = 'é "quoted" \\ 🎉\n'
    deltas = [ChoiceDelta(0, text, [1]), ChoiceDelta(1, "", [2], None, "stop", 13)]
    cmpl = CompletionStream("cmpl-1", 9, "m", 2, False, True, tt)
    write = cmpl.render(1, StepEvent(deltas))
    assert write.startswith("data: ") and write.endswith("\n\n") and write.count("data: ") == 1
    want = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 9,
        "model": "m",
        "choices": [
            {
                "index": 2,
                "text": text,
                "logprobs": None,
                "finish_reason": None,
                "stop_reason": None,
            },
            {"index": 3, "text": "", "logprobs": None, "finish_reason": "stop", "stop_reason": 13},
        ],
    }
    assert write == f"data: {dumps(want)}\n\n"
    assert cmpl.render(0, StepEvent([ChoiceDelta(0, "", [5])])) == ""  # nothing to send

    chat = ChatStream("chat-1", 9, "m", False, False, tt)
    first = chat.render(0, StepEvent([ChoiceDelta(0, "hi", [1])]))
    role, content = [json.loads(part[len("data: ") :]) for part in first.strip().split("\n\n")]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert content["choices"][0]["delta"] == {"content": "hi"}
    assert content["object"] == "chat.completion.chunk"
    later = chat.render(0, StepEvent([ChoiceDelta(0, "", [2], None, "length")]))
    assert json.loads(later[len("data: ") :])["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length", "stop_reason": None}
    ]
    assert chat.final(Usage(1, 2)) == ""  # include_usage off


def test_echo_goes_before_each_choices_first_text_once() -> None:
    cmpl = CompletionStream("cmpl-1", 9, "m", 2, False, False, TokenText(None), ["P0", "P1"])

    def texts(i: int, deltas: list[ChoiceDelta]) -> dict[int, str]:
        write = cmpl.render(i, StepEvent(deltas))
        return {c["index"]: c["text"] for c in json.loads(write[len("data: ") :])["choices"]}

    # Nothing to send yet: the echo waits for the choice's first text.
    assert cmpl.render(1, StepEvent([ChoiceDelta(0, "", [5])])) == ""
    assert texts(1, [ChoiceDelta(0, "a", [1]), ChoiceDelta(1, "b", [2])]) == {
        2: "P1a",
        3: "P1b",
    }
    assert texts(1, [ChoiceDelta(0, "c", [3])]) == {2: "c"}
    # A choice that ends without text still gets its echo.
    assert texts(0, [ChoiceDelta(1, "", [4], None, "stop", None)]) == {1: "P0"}


def test_tool_call_deltas_in_chat_chunks() -> None:
    chat = ChatStream("chat-2", 9, "m", False, False, TokenText(None))
    first = ToolCallDelta(0, "call_1", "add", '{"a"')
    write = chat.render(0, StepEvent([ChoiceDelta(0, "", [1], tool_calls=[first])]))
    _, chunk = [json.loads(part[len("data: ") :]) for part in write.strip().split("\n\n")]
    assert chunk["choices"][0]["delta"] == {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a"'},
            }
        ]
    }
    more = [ToolCallDelta(0, arguments=": 1}")]
    last = chat.render(0, StepEvent([ChoiceDelta(0, "", [2], None, "tool_calls", tool_calls=more)]))
    [choice] = json.loads(last[len("data: ") :])["choices"]
    assert choice["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}
    assert choice["finish_reason"] == "tool_calls"
    # Merged queued events join a call's deltas.
    a = ChoiceDelta(0, "x", [1], tool_calls=[first])
    b = ChoiceDelta(0, "y", [2], tool_calls=[*more, ToolCallDelta(1, "call_2", "sub", "{}")])
    joined = a.then(b)
    assert joined.text == "xy" and joined.tool_calls == [
        ToolCallDelta(0, "call_1", "add", '{"a": 1}'),
        ToolCallDelta(1, "call_2", "sub", "{}"),
    ]


class _Pieces:
    """A tokenizer whose token i decodes to PIECES[i]."""

    def decode(self, ids: list[int]) -> str:
        return "".join(PIECES[i] for i in ids)


PIECES = ["<s>", "The", " cat", " sat", ".", " A"]


def test_echo_with_logprobs_heads_each_choice_with_its_prompt() -> None:
    """Streamed echo with logprobs: a choice's first chunk has the prompt's tokens first (the
    first without a logprob), then its own, offsets running on across both; later chunks
    continue from there. The non-streamed object (`logprobs`) is the same whole."""
    lp = Logprobs
    prompt = [lp([1, 1, 2], [-1.0, -1.0, -2.0], 1), lp([2, 3], [-0.5, -0.25], 2)]
    out = [lp([3, 3], [-0.125, -0.125], 1)]
    cmpl = CompletionStream(
        "cmpl-1", 9, "m", 1, True, False, TokenText(_Pieces()), ["The cat"], prompt_ids=[[0, 1, 2]]
    )
    write = cmpl.render(0, StepEvent([ChoiceDelta(0, " sat", [3], out, prompt_logprobs=prompt)]))
    [choice] = json.loads(write[len("data: ") :])["choices"]
    assert choice["text"] == "The cat sat"
    assert choice["logprobs"] == {
        "tokens": ["<s>", "The", " cat", " sat"],
        "token_logprobs": [None, -1.0, -0.5, -0.125],
        "top_logprobs": [None, {"The": -1.0, " cat": -2.0}, {" sat": -0.25}, {" sat": -0.125}],
        "text_offset": [0, 3, 6, 10],
    }
    write = cmpl.render(0, StepEvent([ChoiceDelta(0, ".", [4], [lp([4], [-0.5], 1)])]))
    [choice] = json.loads(write[len("data: ") :])["choices"]
    assert choice["text"] == "." and choice["logprobs"]["text_offset"] == [14]
    assert choice["logprobs"]["tokens"] == ["."]
    whole = CompletionStream(
        "cmpl-2", 9, "m", 1, True, False, TokenText(_Pieces()), ["The cat"], prompt_ids=[[0, 1, 2]]
    ).logprobs(0, out, prompt)
    assert whole["tokens"] == ["<s>", "The", " cat", " sat"]
    assert whole["text_offset"] == [0, 3, 6, 10]


def test_prompt_logprobs_body_is_vllms_layout() -> None:
    """None for the first prompt token, then by token id: the prompt token at its rank first,
    then the top ones at ranks 1.. (a token in both keeps its own entry); -inf floored."""
    prompt = [
        Logprobs([2, 1, 2], [-2.0, -1.0, -2.0], 2),
        Logprobs([3, 3], [float("-inf"), float("-inf")], 1),
    ]
    body = prompt_logprobs_body(prompt, TokenText(_Pieces()))
    assert body == [
        None,
        {
            "2": {"logprob": -2.0, "rank": 2, "decoded_token": " cat"},
            "1": {"logprob": -1.0, "rank": 1, "decoded_token": "The"},
        },
        {"3": {"logprob": -9999.0, "rank": 1, "decoded_token": " sat"}},
    ]
    assert json.loads(dumps(body)) == body


def test_token_ids_in_stream_chunks() -> None:
    """return_token_ids: a completions choice's first chunk has its prompt's ids, every chunk
    its new ids (a chunk of ids whose text is held back is still sent); a chat stream's first
    chunk has the prompt's ids at the top, each choice its ids."""
    cmpl = CompletionStream(
        "cmpl-1",
        9,
        "m",
        1,
        False,
        False,
        TokenText(None),
        prompt_ids=[[1, 2], [3]],
        return_token_ids=True,
    )

    def choices(write: str) -> list[dict[str, object]]:
        return [c for part in write.strip().split("\n\n") for c in json.loads(part[6:])["choices"]]

    [c] = choices(cmpl.render(1, StepEvent([ChoiceDelta(0, "", [7])])))
    assert c == {
        "index": 1,
        "text": "",
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
        "token_ids": [7],
        "prompt_token_ids": [3],
    }
    [c] = choices(cmpl.render(1, StepEvent([ChoiceDelta(0, "ab", [8], None, "length")])))
    assert c["token_ids"] == [8] and "prompt_token_ids" not in c
    chat = ChatStream("chat-1", 9, "m", False, False, TokenText(None), prompt_ids=[4, 5])
    write = chat.render(0, StepEvent([ChoiceDelta(0, "x", [6])]))
    first, second = [json.loads(part[6:]) for part in write.strip().split("\n\n")]
    assert first["prompt_token_ids"] == [4, 5] and "prompt_token_ids" not in second
    assert second["choices"][0]["token_ids"] == [6]


def test_continuous_usage_goes_into_every_chunk() -> None:
    """stream_options.continuous_usage_stats: every chunk of a write, the role chunk of a
    chat stream too, carries the usage so far after its choices; a text holding "]}" and
    newlines (escaped in JSON) is left as it is."""
    chat = ChatStream("chat-1", 9, "m", False, False, TokenText(None))
    write = chat.render(0, StepEvent([ChoiceDelta(0, ']}\n\n"x"', [6])]))
    parts = with_usage(write, Usage(5, 1)).strip().split("\n\n")
    chunks = [json.loads(p[len("data: ") :]) for p in parts]
    assert len(chunks) == 2
    for c in chunks:
        assert c["usage"] == {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    assert chunks[1]["choices"][0]["delta"]["content"] == ']}\n\n"x"'
    assert with_usage("", Usage(5, 1)) == ""
    body = parse_completion(
        {"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}}
    )
    assert body.continuous_usage and not body.include_usage
    assert not parse_completion({"prompt": "hi"}).continuous_usage
