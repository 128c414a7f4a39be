"""Structured outputs and tools as the frontend parses them (structured.py through
openai_protocol.parse_chat / parse_completion): the StructuredOutputsParams each body makes,
the grammars tool_choice builds, and the 400s (naming the field and the problem) for bad
specs, bad tools and conflicting constraints."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from tandem.sampling_params import StructuredOutputsParams
from tandem_services.frontend.config import FrontendConfigError, config_from_args
from tandem_services.frontend.openai_protocol import ChoiceAccumulator, parse_chat, parse_completion
from tandem_services.frontend.structured import required_schema
from tandem_services.frontend.types import ChoiceDelta, FrontendError, ToolCallDelta

CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION: dict[str, Any] = {"prompt": "hi"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def refused(fn: Any, *args: Any) -> FrontendError:
    with pytest.raises(FrontendError) as info:
        fn(*args)
    assert info.value.http_status == 400
    return info.value


GOOD: list[tuple[dict[str, Any], StructuredOutputsParams | None]] = [
    ({"response_format": {"type": "text"}}, None),
    (
        {"response_format": {"type": "json_object"}},
        StructuredOutputsParams(json={"type": "object"}),
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True},
            }
        },
        StructuredOutputsParams(json=SCHEMA),
    ),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputsParams(choice=("a", "b"))),
    (
        {"structured_outputs": {"grammar": 'root ::= "a"'}},
        StructuredOutputsParams(grammar='root ::= "a"'),
    ),
    (
        {"structured_outputs": {"json_object": True, "disable_any_whitespace": False}},
        StructuredOutputsParams(json_object=True),
    ),
]


@pytest.mark.parametrize(("extra", "spec"), GOOD)
def test_specs_on_both_endpoints(extra: dict[str, Any], spec: StructuredOutputsParams) -> None:
    assert parse_chat({**CHAT, **extra}).params.structured_outputs == spec
    assert parse_completion({**COMPLETION, **extra}).params.structured_outputs == spec


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
        "schema is required",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
        "response_format",
        "name",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objekt"}},
            }
        },
        "response_format",
        "not a valid JSON schema",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"properties": {"a": {"minLength": -1}}}},
            }
        },
        "response_format",
        "properties/a/minLength",
    ),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "empty"),
    ({"structured_outputs": {"choice": "ab"}}, "structured_outputs", "list of strings"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
    ({"structured_outputs": {"json": {"type": 5}}}, "structured_outputs", "not a valid JSON"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs", "non-empty string"),
    ({"structured_outputs": {"frob": 1}}, "structured_outputs", "'frob'"),
    (
        {"structured_outputs": {"json": SCHEMA, "structural_tag": "x"}},
        "structured_outputs",
        "structural_tag",
    ),
    (
        {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
        "structured_outputs",
        "give one",
    ),
]


@pytest.mark.parametrize(("extra", "param", "needle"), BAD)
def test_bad_specs(extra: dict[str, Any], param: str, needle: str) -> None:
    for parse, base in [(parse_chat, CHAT), (parse_completion, COMPLETION)]:
        err = refused(parse, {**base, **extra})
        assert err.param == param and needle in err.message, err.message


def test_named_tool_choice_generates_the_arguments_schema() -> None:
    body = parse_chat(
        {
            **CHAT,
            "tools": [WEATHER, ADD],
            "tool_choice": {"type": "function", "function": {"name": "add"}},
        }
    )
    assert body.tool_calling is not None and body.tool_calling.mode == "named"
    assert body.params.structured_outputs == StructuredOutputsParams(
        json=ADD["function"]["parameters"]  # type: ignore[index]
    )
    assert body.tools == [WEATHER, ADD] and body.structured_param == "tools"


def test_required_schema_accepts_calls_and_refuses_others() -> None:
    params = {
        "get_weather": WEATHER["function"]["parameters"],  # type: ignore[index]
        "add": ADD["function"]["parameters"],  # type: ignore[index]
    }
    body = parse_chat({**CHAT, "tools": [WEATHER, ADD], "tool_choice": "required"})
    spec = body.params.structured_outputs
    assert spec is not None and spec.json == required_schema(params, True)
    schema = spec.json
    assert isinstance(schema, dict)
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [
        {"name": "add", "arguments": {"a": 1, "b": 2}},
        {"name": "get_weather", "arguments": {"city": "Rome"}},
    ]
    jsonschema.validate(ok, schema)
    for bad in [
        [],
        [{"name": "add", "arguments": {"city": "Rome"}}],
        [{"name": "sub", "arguments": {"a": 1, "b": 2}}],
        [{"name": "add", "arguments": {"a": 1, "b": 2}, "extra": 1}],
    ]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = parse_chat(
        {**CHAT, "tools": [ADD], "tool_choice": "required", "parallel_tool_calls": False}
    ).params.structured_outputs
    assert single is not None and isinstance(single.json, dict) and single.json["maxItems"] == 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok[:1] * 2, single.json)


def test_tool_choice_none_and_auto() -> None:
    body = parse_chat({**CHAT, "tools": [WEATHER], "tool_choice": "none"})
    assert body.tool_calling is None and body.params.structured_outputs is None
    assert body.tools == [WEATHER]  # still shown to the template
    body = parse_chat({**CHAT, "tools": [WEATHER]}, None, "llama3_json")
    assert body.tool_calling is not None and body.tool_calling.mode == "auto"
    assert body.params.structured_outputs is None
    # auto with a constraint of its own is allowed (the output is parsed for calls after).
    body = parse_chat(
        {**CHAT, "tools": [WEATHER], "structured_outputs": {"choice": ["x"]}}, None, "hermes"
    )
    assert body.params.structured_outputs == StructuredOutputsParams(choice=("x",))


BAD_TOOLS: list[tuple[dict[str, Any], str, str]] = [
    ({"tools": [{"type": "retrieval"}]}, "tools", '"function"'),
    ({"tools": [{"type": "function"}]}, "tools", "function must be an object"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools", "name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "'a b'"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "two tools"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}]},
        "tools",
        "tools[0].function.parameters is not a valid JSON schema",
    ),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
            ]
        },
        "tools",
        "object schema",
    ),
    ({"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]}, "tools", "'x'"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "'sometimes'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}},
        "tool_choice",
        "'add', which is not in tools",
    ),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "name"),
    (
        {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": 1},
        "parallel_tool_calls",
        "true or false",
    ),
    (
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
        "cannot be combined",
    ),
]


@pytest.mark.parametrize(("extra", "param", "needle"), BAD_TOOLS)
def test_bad_tools(extra: dict[str, Any], param: str, needle: str) -> None:
    err = refused(parse_chat, {**CHAT, **extra})
    assert err.param == param and needle in err.message, err.message


def test_history_with_tool_calls_and_results() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = parse_chat({**CHAT, "messages": messages, "tools": [WEATHER], "tool_choice": "none"})
    assert body.messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    assert body.messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


def test_accumulated_message_has_tool_calls_and_null_content() -> None:
    acc = ChoiceAccumulator()
    acc.add(ChoiceDelta(0, "", [1], tool_calls=[ToolCallDelta(0, "call_x", "add", '{"a"')]))
    acc.add(
        ChoiceDelta(
            0, "", [2], finish_reason="tool_calls", tool_calls=[ToolCallDelta(0, arguments=": 1}")]
        )
    )
    assert acc.message() == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_x",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 1}'},
            }
        ],
    }
    plain = ChoiceAccumulator()
    plain.add(ChoiceDelta(0, "hi", [1], finish_reason="stop"))
    assert plain.message() == {"role": "assistant", "content": "hi"}


def test_auto_tool_choice_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_from_args([]).auto_tool_parser is None
    on = config_from_args(["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    assert on.auto_tool_parser == "llama3_json"
    # A parser alone does not turn "auto" on (vLLM's flags).
    assert config_from_args(["--tool-call-parser", "hermes"]).auto_tool_parser is None
    with pytest.raises(FrontendConfigError, match="tool_call_parser"):
        config_from_args(["--enable-auto-tool-choice"])
    with pytest.raises(SystemExit):
        config_from_args(["--tool-call-parser", "mystery"])
    monkeypatch.setenv("TANDEM_FRONTEND_ENABLE_AUTO_TOOL_CHOICE", "true")
    monkeypatch.setenv("TANDEM_FRONTEND_TOOL_CALL_PARSER", "qwen")
    assert config_from_args([]).auto_tool_parser == "qwen"


def test_a_schema_is_checked_against_its_meta_schema_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The meta-schema check of a schema that passed is remembered by the schema's content
    (key order aside); a bad schema is refused every time it comes."""
    from tandem_services.frontend import structured

    checks: list[dict[str, Any]] = []
    original = jsonschema.Draft202012Validator.check_schema

    def counting(schema: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        checks.append(schema)
        original(schema, *args, **kwargs)

    monkeypatch.setattr(jsonschema.Draft202012Validator, "check_schema", counting)
    monkeypatch.setattr(structured, "_CHECKED_SCHEMAS", type(structured._CHECKED_SCHEMAS)())
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    same = {"required": ["a"], "properties": {"a": {"type": "integer"}}, "type": "object"}
    for body in (schema, same, json.dumps(schema)):
        assert structured.check_json_schema(body, "json", "json") == schema
    assert len(checks) == 1
    bad = {"type": "object", "properties": {"a": {"type": 7}}}
    for _ in range(2):
        with pytest.raises(FrontendError, match="not a valid JSON schema"):
            structured.check_json_schema(bad, "json", "json")
    assert len(checks) == 3
    monkeypatch.setattr(structured, "_CHECKED_SCHEMAS_MAX", 1)
    other = {"type": "string"}
    structured.check_json_schema(other, "json", "json")  # evicts `schema`
    structured.check_json_schema(schema, "json", "json")
    assert len(checks) == 5
