"""The Responses API's rewriting into a chat completion and its output shapes
(tandem_services/frontend/responses.py), without a server: the body's fields each land where
the chat path reads them, refusals name their field, and the stream's events come in the
order (and with the numbering) the official client's stream helper accepts."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from tandem.core.outputs import FinishReason, Logprobs
from tandem_services.frontend.openai_protocol import ChoiceAccumulator, TokenIdText, parse_chat
from tandem_services.frontend.response_store import ResponseStore, StoredResponse
from tandem_services.frontend.responses import (
    ResponseBuilder,
    ResponsesRequest,
    ResponsesStream,
    chat_request,
)
from tandem_services.frontend.types import (
    ChoiceDelta,
    FrontendError,
    StepEvent,
    ToolCallDelta,
    Usage,
)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def test_body_becomes_the_chat_completion_it_asks_for() -> None:
    body, asked = chat_request(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": [{"type": "input_text", "text": "Use metric."}]},
                {"type": "message", "role": "user", "content": "Weather in Paris and Rome?"},
                {"type": "function_call", "call_id": "a", "name": "get_weather",
                 "arguments": '{"city": "Paris"}'},
                {"type": "function_call", "call_id": "b", "name": "get_weather",
                 "arguments": '{"city": "Rome"}'},
                {"type": "function_call_output", "call_id": "a", "output": "sunny"},
                {"type": "function_call_output", "call_id": "b",
                 "output": [{"type": "input_text", "text": "rain"}]},
            ],
            "max_output_tokens": 7,
            "temperature": 0,
            "top_k": 5,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "metadata": {"k": "v"},
            "store": True,
        }
    )  # fmt: skip
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "system", "user", "assistant", "tool", "tool"]
    assert body["messages"][0]["content"] == "Be brief."
    assert body["messages"][1]["content"] == "Use metric."
    calls = body["messages"][3]["tool_calls"]  # one turn's calls in one assistant message
    assert [c["id"] for c in calls] == ["a", "b"] and calls[1]["function"]["name"] == "get_weather"
    assert body["messages"][5] == {"role": "tool", "tool_call_id": "b", "content": "rain"}
    assert body["max_completion_tokens"] == 7 and "max_output_tokens" not in body
    assert body["tools"] == [
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert "metadata" not in body and "store" not in body and "instructions" not in body
    chat = parse_chat(body)  # the chat path takes it as it is
    assert chat.params.max_tokens == 7 and chat.params.top_k == 5
    assert asked.echo["metadata"] == {"k": "v"} and asked.echo["instructions"] == "Be brief."
    assert asked.echo["tools"] == [WEATHER] and asked.echo["store"] is False
    plain, _ = chat_request({"input": "hi", "text": {"format": {"type": "json_object"}}})
    assert plain["messages"] == [{"role": "user", "content": "hi"}]
    assert plain["response_format"] == {"type": "json_object"}
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}
    shaped, asked = chat_request({"input": "hi", "text": {"format": fmt}})
    assert shaped["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
    }
    assert parse_chat(shaped).structured_param == "response_format"
    assert asked.echo["text"] == {"format": fmt}


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({}, "input", "input is required"),
        ({"input": []}, "input", "holds no message"),
        ({"input": "x", "previous_response_id": 3}, "previous_response_id", "a string"),
        ({"input": "x", "store": "yes"}, "store", "a boolean"),
        ({"input": "x", "conversation": "c"}, "conversation", "stored conversations"),
        ({"input": "x", "background": True}, "background", "not supported"),
        ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning", "not supported"),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include", "only"),
        ({"input": "x", "logprobs": True}, "logprobs", "chat completions field"),
        ({"input": "x", "truncation": "auto"}, "truncation", "'auto'"),
        ({"input": "x", "max_tokens": 3}, "max_tokens", "chat completions field"),
        ({"input": "x", "n": 2}, "n", "chat completions field"),
        ({"input": "x", "metadata": [1]}, "metadata", "an object"),
        ({"input": [{"role": "tool", "content": "x"}]}, None, "role 'tool'"),
        ({"input": [{"type": "reasoning"}]}, "input", "'reasoning'"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input", "text only"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input", "call_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "'web_search'"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text", "'yaml'"),
    ],
)
def test_refusals_name_their_field(body: dict[str, Any], param: str | None, message: str) -> None:
    with pytest.raises(FrontendError, match=message) as err:
        chat_request(body)
    assert err.value.http_status == 400 and err.value.param == param


def _stream_events(stream: ResponsesStream, events: list[StepEvent], usage: Usage) -> list[Any]:
    """The SSE text a stream writes, parsed back into the client's event models."""
    text = "".join(stream.render(0, e) for e in events) + stream.final(usage)
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    out = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        assert kind.startswith("event: ")
        event = adapter.validate_python(json.loads(data.removeprefix("data: ")))
        assert event.type == kind.removeprefix("event: ")
        out.append(event)
    return out


def _builder() -> ResponseBuilder:
    echo = {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}
    return ResponseBuilder("resp_1", "m", ResponsesRequest(echo))


def test_stream_events_build_the_final_response_in_the_clients_helper() -> None:
    events = [
        StepEvent([ChoiceDelta(0, "The cap", [1, 2])]),
        StepEvent([ChoiceDelta(0, "", [3])]),  # a token with no text yet: no delta event
        StepEvent([ChoiceDelta(0, "ital.", [4], finish_reason=FinishReason.STOP)]),
    ]
    parsed = _stream_events(ResponsesStream(_builder()), events, Usage(5, 4, 2))
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    deltas = [e.delta for e in parsed if e.type == "response.output_text.delta"]
    assert deltas == ["The cap", "ital."]
    state = ResponseStreamState(text_format=omit, input_tools=omit)
    for e in parsed:
        state.handle_event(e)
    final = state._completed_response
    assert final is not None and final.output_text == "The capital." and final.status == "completed"
    assert final.usage is not None and final.usage.input_tokens_details.cached_tokens == 2


def test_stream_of_tool_calls_and_a_cut_response() -> None:
    call = ToolCallDelta(0, "call_9", "get_weather", '{"city": "Paris"}')
    events = [StepEvent([ChoiceDelta(0, "", [1, 2], finish_reason=FinishReason.TOOL_CALLS,
                                     tool_calls=[call])])]  # fmt: skip
    parsed = _stream_events(ResponsesStream(_builder()), events, Usage(5, 2))
    kinds = [e.type for e in parsed]
    assert "response.output_text.delta" not in kinds and kinds[-1] == "response.completed"
    [item] = parsed[-1].response.output
    assert item.type == "function_call" and item.call_id == "call_9"
    assert json.loads(item.arguments) == {"city": "Paris"}
    cut = [StepEvent([ChoiceDelta(0, "Par", [1], finish_reason=FinishReason.LENGTH)])]
    parsed = _stream_events(ResponsesStream(_builder()), cut, Usage(5, 1))
    assert parsed[-1].type == "response.incomplete"
    whole = parsed[-1].response
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output[0].status == "incomplete" and whole.output_text == "Par"
    acc = ChoiceAccumulator()
    acc.add(ChoiceDelta(0, "", [], finish_reason=FinishReason.STOP))
    empty = _builder().finished(acc, Usage(5, 0))  # nothing said: one empty message
    assert [i["type"] for i in empty["output"]] == ["message"]
    assert empty["output"][0]["content"][0]["text"] == ""


def test_included_logprobs_on_the_text_whole_and_streamed() -> None:
    """include message.output_text.logprobs (with top_logprobs): the chat body asks for them,
    and the output text carries each token's, its alternatives, on the whole response, the
    deltas (a token that added no text yet goes with the next piece) and the done event."""
    body, asked = chat_request(
        {"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 1}
    )
    assert body["logprobs"] is True and body["top_logprobs"] == 1 and asked.logprobs
    assert parse_chat(body).params.logprobs == 1
    plain, unasked = chat_request({"input": "hi"})
    assert "logprobs" not in plain and not unasked.logprobs
    lp = [Logprobs([7, 8], [-0.5, -1.5], [1, 2]), Logprobs([9, 8], [-0.25, -2.0], [1, 2])]
    events = [
        StepEvent([ChoiceDelta(0, "", [7], logprobs=lp[:1])]),
        StepEvent([ChoiceDelta(0, "ab", [9], logprobs=lp[1:], finish_reason=FinishReason.STOP)]),
    ]
    builder = ResponseBuilder("resp_1", "m", asked, TokenIdText())
    parsed = _stream_events(ResponsesStream(builder), events, Usage(3, 2))
    [delta] = [e for e in parsed if e.type == "response.output_text.delta"]
    assert [x.token for x in delta.logprobs] == ["token_id:7", "token_id:9"]
    assert [x.logprob for x in delta.logprobs] == [-0.5, -0.25]
    assert [t.token for t in delta.logprobs[0].top_logprobs] == ["token_id:8"]
    [done] = [e for e in parsed if e.type == "response.output_text.done"]
    whole = parsed[-1].response.output[0].content[0]
    dumped = [[x.model_dump() for x in lps] for lps in (done.logprobs, delta.logprobs)]
    assert dumped[0] == dumped[1] == [x.model_dump() for x in whole.logprobs]
    acc = ChoiceAccumulator()
    for e in events:
        acc.add(e.deltas[0])
    unlogged = ResponseBuilder("resp_2", "m", unasked, TokenIdText()).finished(acc, Usage(3, 2))
    assert unlogged["output"][0]["content"][0]["logprobs"] == []


def test_a_stored_conversation_continues_and_the_store_is_bounded() -> None:
    """`store` (true unless the body says false, and only where the frontend keeps
    responses) hands the finished response to the store; its input items, then its output
    items, are the history a `previous_response_id` body is answered over: the earlier
    exchange's messages before the new input, the earlier instructions not carried over. The
    store keeps the most recently used `capacity` responses."""
    body, asked = chat_request({"input": "hi", "instructions": "Be brief."}, (), True)
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert asked.store and asked.echo["store"] is True
    assert asked.items == ({"type": "message", "role": "user", "content": "hi"},)
    store = ResponseStore(2)
    acc = ChoiceAccumulator()
    acc.add(ChoiceDelta(0, "hello", [5], finish_reason=FinishReason.STOP))

    def keep(whole: dict[str, Any]) -> None:
        store.put(whole["id"], StoredResponse(whole, (*asked.items, *whole["output"])))

    first = ResponseBuilder("resp_1", "m", asked, on_finished=keep).finished(acc, Usage(3, 1))
    assert store.get("resp_1") is not None and store.get("resp_1").response is first
    history = store.get("resp_1").items
    follow, asked2 = chat_request(
        {"input": [{"role": "user", "content": "and again"}], "previous_response_id": "resp_1"},
        history,
        True,
    )
    assert follow["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "and again"},
    ]
    assert asked2.echo["previous_response_id"] == "resp_1" and len(asked2.items) == 3

    _, unstored = chat_request({"input": "hi", "store": False}, (), True)
    _, off = chat_request({"input": "hi"}, (), False)
    assert not unstored.store and not off.store and off.echo["store"] is False
    calls: list[dict[str, Any]] = []
    ResponseBuilder("resp_2", "m", unstored, on_finished=calls.append).finished(acc, Usage(3, 1))
    assert calls == []

    for rid in ("resp_2", "resp_3"):
        store.put(rid, StoredResponse({"id": rid}, ()))
    assert store.get("resp_1") is None and len(store) == 2  # the least recently used went
    assert store.get("resp_2") is not None
    store.put("resp_4", StoredResponse({"id": "resp_4"}, ()))
    assert store.get("resp_3") is None and store.get("resp_2") is not None  # used: kept
    assert store.delete("resp_2") and not store.delete("resp_2")
    disabled = ResponseStore(0)
    disabled.put("resp_5", StoredResponse({}, ()))
    assert not disabled.enabled and disabled.get("resp_5") is None
