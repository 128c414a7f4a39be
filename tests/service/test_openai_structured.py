"""Structured outputs and tool calling over HTTP (issue 16): a real disaggregated deployment
of the embedded model (the frontend's tool parsing and the prefill -> decode hand-off of a
grammar's state), the official openai client. The unified topology's structured outputs are
checked against the offline engine in test_structured_outputs.py; what this module adds is
the frontend's (OpenAI fields, tool calls, streaming), which is the same for both.

Every output under a JSON schema parses and validates (jsonschema); json_object outputs parse;
regex and choice outputs match; named and required tool calls carry arguments that validate
against the tool's parameter schema, with finish_reason "tool_calls", streamed and not (the
streamed deltas join to the same calls); tool_choice "auto" parses a call the model writes in
the frontend's format (--tool-call-parser hermes; the call is made certain by constraining
the output to it); a history with tool calls and tool results renders; bad specs and tools
are 400s naming the problem (over gRPC too: INVALID_ARGUMENT), and the next request is served;
the block pools are whole after every test.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest

from tandem_protos.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tandem_services.launcher import Deployment
from tests.service.conftest import GRACE_S, PROMPTS, assert_pools_whole, launch

MAX_TOKENS = 160
FRONTEND_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
MESSAGES: list[Any] = [{"role": "user", "content": "Describe a person as JSON."}]

# Bounded so a small model under the grammar ends well within MAX_TOKENS.
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array_enum": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"type": "string", "enum": ["red", "green", "blue"]},
                "minItems": 2,
                "maxItems": 3,
            },
            "mood": {"enum": ["happy", "sad"]},
        },
        "required": ["colors", "mood"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "ok": {"type": "boolean"},
            "tag": {"type": "string", "pattern": "^[a-z]{2,6}$"},
        },
        "required": ["age", "ok", "tag"],
        "additionalProperties": False,
    },
}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD_PARAMS = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 999},
        "b": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {"name": "add", "description": "a + b", "parameters": ADD_PARAMS},
    },
]
PARAMS = {"get_weather": WEATHER_PARAMS, "add": ADD_PARAMS}


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    logs = tmp_path_factory.mktemp("logs-structured")
    d = launch(logs, unified=False, frontend_args=FRONTEND_ARGS)
    try:
        yield d
    finally:
        d.stop(timeout_s=GRACE_S + 10)


@pytest.fixture
def client(dep: Deployment) -> Iterator[openai.OpenAI]:
    yield openai.OpenAI(base_url=f"http://{dep.http_address}/v1", api_key="x", max_retries=0)
    assert_pools_whole(dep)


def _chat(client: openai.OpenAI, stream: bool, **kwargs: Any) -> dict[str, Any]:
    """One chat completion as {content, tool_calls, finish_reason}, from the response or
    from its stream's deltas joined (checking each call's id and name come first, once)."""
    kwargs = {"model": "default", "messages": MESSAGES, "max_tokens": MAX_TOKENS, **kwargs}
    kwargs.setdefault("temperature", 0)
    if not stream:
        out = client.chat.completions.create(**kwargs)
        choice = out.choices[0]
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls or []
        ]
        return {
            "content": choice.message.content,
            "tool_calls": calls,
            "finish_reason": choice.finish_reason,
        }
    content = ""
    calls_by_index: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.index not in calls_by_index:
                    assert d.id and d.function and d.function.name, d
                    assert d.type == "function"
                    calls_by_index[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and (d.function is None or d.function.name is None), d
                if d.function and d.function.arguments:
                    calls_by_index[d.index]["arguments"] += d.function.arguments
            if choice.finish_reason is not None:
                finish = choice.finish_reason
    calls = [c for _, c in sorted(calls_by_index.items())]
    return {"content": content or None, "tool_calls": calls, "finish_reason": finish}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(client: openai.OpenAI, name: str, stream: bool) -> None:
    schema = SCHEMAS[name]
    out = _chat(
        client,
        stream,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        },
    )
    assert out["finish_reason"] == "stop", out
    jsonschema.validate(json.loads(out["content"]), schema)


def test_seeded_samples_each_validate(client: openai.OpenAI) -> None:
    schema = SCHEMAS["array_enum"]
    out = client.completions.create(
        model="default",
        prompt=PROMPTS[2],
        max_tokens=MAX_TOKENS,
        n=4,
        # Hotter, this model can fill max_tokens with whitespace the JSON grammar allows.
        temperature=0.5,
        seed=7,
        extra_body={"structured_outputs": {"json": schema}},
    )
    assert len(out.choices) == 4
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.text), schema)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_json_object_parses(client: openai.OpenAI, endpoint: str) -> None:
    if endpoint == "chat":
        messages = [{"role": "user", "content": "Give me a JSON object with a name and an age."}]
        text = _chat(client, False, messages=messages, response_format={"type": "json_object"})[
            "content"
        ]
    else:
        text = (
            client.completions.create(
                model="default",
                prompt=PROMPTS[0],
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"response_format": {"type": "json_object"}},
            )
            .choices[0]
            .text
        )
    assert isinstance(json.loads(text), dict), text


def test_regex_and_choice_match(client: openai.OpenAI) -> None:
    regex = r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3}"
    for stream in (False, True):
        out = _chat(client, stream, extra_body={"structured_outputs": {"regex": regex}})
        assert re.fullmatch(regex, out["content"]), out
    choices = ["yes", "no", "maybe later"]
    out = client.completions.create(
        model="default",
        prompt=PROMPTS[1],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert out.choices[0].text in choices, out.choices[0].text
    out2 = client.completions.create(
        model="default",
        prompt=PROMPTS[3],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}},
    )
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", out2.choices[0].text), out2.choices[0].text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_named_tool_call(client: openai.OpenAI, stream: bool) -> None:
    out = _chat(
        client,
        stream,
        messages=[{"role": "user", "content": "What is 2 + 3?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
    )
    assert out["finish_reason"] == "tool_calls", out
    assert out["content"] is None, out
    [call] = out["tool_calls"]
    assert call["name"] == "add" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), ADD_PARAMS)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_required_tool_calls(client: openai.OpenAI, stream: bool) -> None:
    for parallel in (True, False):
        out = _chat(
            client,
            stream,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
        )
        assert out["finish_reason"] == "tool_calls", out
        assert out["tool_calls"], out
        if not parallel:
            assert len(out["tool_calls"]) == 1, out
        for call in out["tool_calls"]:
            jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])
        assert len({c["id"] for c in out["tool_calls"]}) == len(out["tool_calls"])


# What a Hermes-format model writes to call a tool (the output is constrained to it, so the
# test does not depend on a 135M model choosing to call).
HERMES_CALL = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
    '"unit": "celsius"}}\n</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_auto_parses_a_call_and_leaves_text_alone(client: openai.OpenAI, stream: bool) -> None:
    out = _chat(
        client,
        stream,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=TOOLS,
        extra_body={"structured_outputs": {"choice": [HERMES_CALL]}},
    )
    assert out["finish_reason"] == "tool_calls", out
    assert out["content"] == "Let me look."
    [call] = out["tool_calls"]
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Oslo", "unit": "celsius"}
    text = "It is sunny <b>today</b>."
    out = _chat(
        client,
        stream,
        tools=TOOLS,
        tool_choice="auto",
        extra_body={"structured_outputs": {"choice": [text]}},
    )
    assert out == {"content": text, "tool_calls": [], "finish_reason": "stop"}


def test_history_with_tool_calls_and_results(client: openai.OpenAI) -> None:
    messages: list[Any] = [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Rome", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "21 degrees, sunny"},
    ]
    out = client.chat.completions.create(
        model="default", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    assert out.choices[0].message.content
    assert out.choices[0].message.tool_calls is None
    assert out.usage is not None and out.usage.prompt_tokens > 40


# (body, the field in `param`, a word of the message): refused at the edge.
BAD: list[tuple[dict[str, Any], str, str]] = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": "zero"}},
            }
        },
        "response_format",
        "not a valid JSON schema",
    ),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "bad name"),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
            ],
            "tool_choice": "required",
        },
        "tools",
        "parameters is not a valid JSON schema",
    ),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
        "tool_choice",
        "'mul'",
    ),
]
# Refused by the engine (the spec does not compile): 400 too.
BAD_COMPILE: list[tuple[dict[str, Any], str]] = [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
]


def test_bad_specs_are_400_and_the_next_request_is_served(dep: Deployment) -> None:
    url = f"http://{dep.http_address}/v1/chat/completions"
    base = {"model": "default", "messages": MESSAGES, "max_tokens": 4}
    with httpx.Client(timeout=120) as http:
        for body, param, needle in BAD:
            r = http.post(url, json={**base, **body})
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and needle in err["message"], (body, err)
            assert http.post(url, json=base).status_code == 200
        for body, param in BAD_COMPILE:
            for stream in (False, True):
                r = http.post(url, json={**base, **body, "stream": stream})
                assert r.status_code == 400, (body, r.text)
                err = r.json()["error"]
                assert err["param"] == param and err["message"], (body, err)
                ok = http.post(url, json={**base, "structured_outputs": {"choice": ["fine"]}})
                assert ok.status_code == 200, ok.text
                assert ok.json()["choices"][0]["message"]["content"] == "fine"
    assert_pools_whole(dep)


def test_grpc_specs_are_checked_at_the_edge(dep: Deployment) -> None:
    def request(spec: common_pb2.StructuredOutputs) -> frontend_pb2.GenerateRequest:
        params = common_pb2.SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec)
        return frontend_pb2.GenerateRequest(text=PROMPTS[0], sampling_params=params)

    async def run() -> None:
        async with grpc.aio.insecure_channel(dep.grpc_address) as channel:
            stub = frontend_pb2_grpc.FrontendStub(channel)
            bad = request(common_pb2.StructuredOutputs(json='{"type": 5}'))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                _ = [r async for r in stub.Generate(bad)]
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid JSON schema" in (info.value.details() or "")
            good = request(
                common_pb2.StructuredOutputs(choice=common_pb2.Choices(choices=["ab", "cd"]))
            )
            text = "".join([c.text async for r in stub.Generate(good) for c in r.choices])
            assert text in ("ab", "cd")

    asyncio.run(run())
    assert_pools_whole(dep)
