"""Tool-call parsers (tandem_services/frontend/tool_parsers.py) on crafted outputs in each
format: the calls and content parsed from the whole text, and the same again when the text
arrives chunk by chunk (every split, one character at a time, random chunks): deltas that
concatenate to the whole, the id and name on each call's first delta only."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from tandem_services.frontend.structured import ToolCalling
from tandem_services.frontend.tool_parsers import (
    GraniteToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    NamedToolParser,
    RequiredToolParser,
    ToolCallExtractor,
    ToolParser,
    parser_factory,
    render_tool_calls,
)
from tandem_services.frontend.types import ChoiceDelta, StepEvent

NAMES = ("get_weather", "add")
Calls = list[tuple[str, Any]]


def run(parser: ToolParser, chunks: list[str]) -> tuple[str, Calls]:
    """Feeds `chunks`, checks the delta protocol, returns (content, [(name, arguments)])."""
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in [*chunks, None]:
        out = parser.feed(chunk) if chunk is not None else parser.finish()
        content += out.content
        seen = set()
        for d in out.tool_calls:
            assert d.index not in seen, "one delta per call per feed"
            seen.add(d.index)
            if d.index not in calls:
                assert d.index == len(calls), "calls are numbered in order"
                assert d.id and d.id.startswith("call_") and d.name, d
                calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
            else:
                assert d.id is None and d.name is None, d
            calls[d.index]["arguments"] += d.arguments
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


def splits(text: str, seed: int = 0) -> list[list[str]]:
    """The text whole, one character at a time, and in random chunks."""
    rng = random.Random(seed)
    ways = [[text], list(text)]
    for _ in range(5):
        chunks, i = [], 0
        while i < len(text):
            k = rng.randint(1, 7)
            chunks.append(text[i : i + k])
            i += k
        ways.append(chunks)
    return ways


def check(make: Any, text: str, content: str, calls: Calls) -> None:
    for chunks in splits(text):
        got_content, got_calls = run(make(), chunks)
        assert got_content == content, (chunks, got_content)
        assert [(n, json.loads(a)) for n, a in got_calls] == calls, (chunks, got_calls)


HERMES_CASES: list[tuple[str, str, Calls]] = [
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        'Let me check.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": [2, {"c": "}"}]}}'
        '</tool_call>\n<tool_call>\n{"arguments": {"city": "Rome \\"x\\""}, "name": '
        '"get_weather"}\n</tool_call>',
        "Let me check.",
        [("add", {"a": 1, "b": [2, {"c": "}"}]}), ("get_weather", {"city": 'Rome "x"'})],
    ),
    ("No tools: 2 < 3, <tool is a word.\n", "No tools: 2 < 3, <tool is a word.\n", []),
    ('<tool_call>{"name": "add"}</tool_call>', "", [("add", {})]),
    # Arguments given as a JSON string.
    (
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}</tool_call>',
        "",
        [("add", {"a": 2})],
    ),
    # Malformed: not a call, so content (the tag included).
    ("<tool_call>oops</tool_call>", "<tool_call>oops</tool_call>", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes(text: str, content: str, calls: Calls) -> None:
    check(lambda: HermesToolParser(NAMES), text, content, calls)


def test_hermes_streams_arguments_before_the_call_ends() -> None:
    p = HermesToolParser(NAMES)
    assert p.feed("Sure <tool").content == "Sure"
    out = p.feed('_call>{"name": "get_weather", "arguments": {"ci')
    assert out.content == ""
    assert [(d.name, d.arguments) for d in out.tool_calls] == [("get_weather", '{"ci')]
    out = p.feed('ty": "Paris"}}</tool_call>')
    assert [(d.index, d.name, d.arguments) for d in out.tool_calls] == [(0, None, 'ty": "Paris"}')]
    assert p.finish().content == ""


def test_hermes_text_that_ends_like_a_tag_is_released_at_the_end() -> None:
    check(lambda: HermesToolParser(NAMES), "a <tool_ca", "a <tool_ca", [])


LLAMA_CASES: list[tuple[str, str, Calls]] = [
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", '
        '"parameters": {"city": "Oslo"}}',
        "",
        [("add", {"a": 1}), ("get_weather", {"city": "Oslo"})],
    ),
    ('  {"name": "add", "arguments": {"a": 2}}  ', "", [("add", {"a": 2})]),
    # Not calls: plain text, JSON that is not a call, a name that is not a tool.
    ("The weather is fine.", "The weather is fine.", []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA_CASES)
def test_llama3_json(text: str, content: str, calls: Calls) -> None:
    check(lambda: Llama3JsonToolParser(NAMES), text, content, calls)


# A marker, then a list of calls (Mistral's, Granite's); content before; a marker without a
# list is content.
TAGGED_CASES: list[tuple[str, str, Calls]] = [
    (
        '{tag}[{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}]',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        'Checking both. {tag} [ {{"name": "add", "arguments": {{"a": 1, "b": [2, "]"]}}}},\n'
        '{{"arguments": {{"city": "Rome \\"x\\""}}, "name": "get_weather"}} ]',
        "Checking both.",
        [("add", {"a": 1, "b": [2, "]"]}), ("get_weather", {"city": 'Rome "x"'})],
    ),
    ('{tag}{{"name": "add", "arguments": {{}}}}', "", [("add", {})]),
    ("No calls [here], <tool is text.\n", "No calls [here], <tool is text.\n", []),
    ("{tag} nothing", "{tag} nothing", []),
]


@pytest.mark.parametrize("parser", [MistralToolParser, GraniteToolParser])
@pytest.mark.parametrize(("text", "content", "calls"), TAGGED_CASES)
def test_tagged_lists(parser: Any, text: str, content: str, calls: Calls) -> None:
    for tag in parser.STARTS:
        filled = text.format(tag=tag)
        check(lambda: parser(NAMES), filled, content.format(tag=tag), calls)


# Mistral's v11+ form: one marker per call, the name first, then [ARGS] (or [CALL_ID]id
# [ARGS], or the arguments at once); a name that is no identifier, or no arguments, is content.
MISTRAL_V11_CASES: list[tuple[str, str, Calls]] = [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [("get_weather", {"city": "Paris"})]),
    (
        'Both. [TOOL_CALLS]add[ARGS]{"a": 1, "b": [2, "}"]}[TOOL_CALLS]get_weather[CALL_ID]'
        'a1B2c3D4e[ARGS] {"city": "Rome \\"x\\""}',
        "Both.",
        [("add", {"a": 1, "b": [2, "}"]}), ("get_weather", {"city": 'Rome "x"'})],
    ),
    ('[TOOL_CALLS]add{"a": 2}', "", [("add", {"a": 2})]),
    ("[TOOL_CALLS]add[ARGS]", "[TOOL_CALLS]add[ARGS]", []),
    ("[TOOL_CALLS]not a call", "[TOOL_CALLS]not a call", []),
    ("[TOOL_CALLS]add[ARGS]oops", "[TOOL_CALLS]add[ARGS]oops", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), MISTRAL_V11_CASES)
def test_mistral_v11(text: str, content: str, calls: Calls) -> None:
    check(lambda: MistralToolParser(NAMES), text, content, calls)


def test_mistral_v11_streams_arguments_before_the_call_ends() -> None:
    parser = MistralToolParser(NAMES)
    out = parser.feed('[TOOL_CALLS]add[ARGS]{"a": 1')
    assert [(d.name, d.arguments) for d in out.tool_calls] == [("add", '{"a": 1')]
    out = parser.feed(', "b": 2}')
    assert [d.arguments for d in out.tool_calls] == [', "b": 2}']


REQUIRED_CASES: list[tuple[str, Calls]] = [
    ('[{"name": "add", "arguments": {"a": 1, "b": 2}}]', [("add", {"a": 1, "b": 2})]),
    (
        '[ {"name":"get_weather","arguments":{"city":"Paris, \\"FR\\""}} ,\n'
        '{"name":"add","arguments":{}} ]',
        [("get_weather", {"city": 'Paris, "FR"'}), ("add", {})],
    ),
]


@pytest.mark.parametrize(("text", "calls"), REQUIRED_CASES)
def test_required(text: str, calls: Calls) -> None:
    check(lambda: RequiredToolParser(NAMES), text, "", calls)


def test_named() -> None:
    check(lambda: NamedToolParser("add"), '{"a": 1, "b": 2}', "", [("add", {"a": 1, "b": 2})])


def test_rendered_calls_parse_back() -> None:
    calls = [("add", '{"a": 1}'), ("get_weather", '{"city": "Paris"}')]
    expected = [(n, json.loads(a)) for n, a in calls]
    check(lambda: HermesToolParser(NAMES), render_tool_calls("hermes", calls), "", expected)
    text = render_tool_calls("llama3_json", calls)
    check(lambda: Llama3JsonToolParser(NAMES), text, "", expected)
    for name, parser in (("mistral", MistralToolParser), ("granite", GraniteToolParser)):
        check(lambda p=parser: p(NAMES), render_tool_calls(name, calls), "", expected)


def test_extractor_sets_finish_reason_and_keeps_plain_text() -> None:
    calling = ToolCalling("auto", {"add": {"type": "object"}})
    ex = ToolCallExtractor(parser_factory(calling, "hermes"))
    tool = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    e1 = ex.apply(StepEvent([ChoiceDelta(0, tool[:20], [1]), ChoiceDelta(1, "Hi ", [1])]))
    e2 = ex.apply(
        StepEvent(
            [
                ChoiceDelta(0, tool[20:], [2], finish_reason="stop"),
                ChoiceDelta(1, "there", [2], finish_reason="stop"),
            ]
        )
    )
    d0 = [e1.deltas[0], e2.deltas[0]]
    assert all(d.text == "" for d in d0)
    args = "".join(c.arguments for d in d0 for c in d.tool_calls or [])
    assert json.loads(args) == {"a": 1}
    assert e2.deltas[0].finish_reason == "tool_calls"
    assert e1.deltas[1].text + e2.deltas[1].text == "Hi there"
    assert e2.deltas[1].finish_reason == "stop" and e2.deltas[1].tool_calls is None


def test_bad_keys_and_names_are_content() -> None:
    for text in [
        '<tool_call>{"na\\x": "add"}</tool_call>',
        '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
        '<tool_call>{"name" "add"}</tool_call>',
    ]:
        check(lambda: HermesToolParser(NAMES), text, text, [])
