"""The frontend's request bounds and field checks (tandem_services/frontend/limits.py), as parsing
applies them: every limit at its value accepted and one above refused with a 400 naming the
field, the value and the limit; unimplemented fields and bad chat messages refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from tandem_services.frontend.config import FrontendConfigError, config_from_args
from tandem_services.frontend.limits import (
    RequestLimits,
    check_messages,
    check_prompt_work,
    check_tools,
)
from tandem_services.frontend.openai_protocol import parse_chat, parse_completion
from tandem_services.frontend.types import FrontendError

LIMITS = RequestLimits(
    max_n=4,
    max_best_of=4,
    max_logprobs=5,
    max_stop_sequences=3,
    max_stop_sequence_len=8,
    max_tools=2,
    max_tool_schema_bytes=200,
    max_prompt_tokens_times_n=100,
)
COMPLETION: dict[str, Any] = {"model": "default", "prompt": "hi", "max_tokens": 4}
CHAT: dict[str, Any] = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}


def refused(fn: Any, *args: Any) -> FrontendError:
    with pytest.raises(FrontendError) as info:
        fn(*args)
    assert info.value.http_status == 400
    return info.value


def assert_over(err: FrontendError, field: str, value: int, limit: int, flag: str) -> None:
    assert err.param == field
    assert field in err.message and flag in err.message
    assert f"is {value};" in err.message and f"limit is {limit}" in err.message


# (field, value at the limit, the limit's flag)
SAMPLING_LIMITS = [
    ("n", 4, "--max-n"),
    ("best_of", 4, "--max-best-of"),
    ("logprobs", 5, "--max-logprobs"),
]


@pytest.mark.parametrize(("field", "at", "flag"), SAMPLING_LIMITS)
def test_completion_sampling_limits(field: str, at: int, flag: str) -> None:
    body = {**COMPLETION, field: at}
    if field == "best_of":
        body["n"] = at  # best_of must equal n
    params = parse_completion(body, LIMITS).params
    assert params.n == body.get("n", 1)
    over = {**body, field: at + 1}  # (best_of: n stays at its limit)
    err = refused(parse_completion, over, LIMITS)
    assert_over(err, field, at + 1, at, flag)


def test_chat_top_logprobs_limit() -> None:
    ok = parse_chat({**CHAT, "logprobs": True, "top_logprobs": 5}, LIMITS)
    assert ok.params.logprobs == 5
    err = refused(parse_chat, {**CHAT, "logprobs": True, "top_logprobs": 6}, LIMITS)
    assert_over(err, "top_logprobs", 6, 5, "--max-logprobs")
    err = refused(parse_chat, {**CHAT, "n": 5}, LIMITS)
    assert_over(err, "n", 5, 4, "--max-n")


def test_n_100000_is_refused_with_default_limits() -> None:
    err = refused(parse_completion, {**COMPLETION, "n": 100000})
    assert_over(err, "n", 100000, RequestLimits().max_n, "--max-n")


def test_stop_list_limits() -> None:
    assert parse_completion({**COMPLETION, "stop": ["a", "b", "c"]}, LIMITS).params.stop == [
        "a",
        "b",
        "c",
    ]
    err = refused(parse_completion, {**COMPLETION, "stop": ["a", "b", "c", "d"]}, LIMITS)
    assert_over(err, "stop", 4, 3, "--max-stop-sequences")
    assert parse_chat({**CHAT, "stop": "x" * 8}, LIMITS).params.stop == ["x" * 8]
    err = refused(parse_chat, {**CHAT, "stop": ["ok", "x" * 9]}, LIMITS)
    assert_over(err, "stop", 9, 8, "--max-stop-sequence-len")
    assert "stop[1]" in err.message


def test_prompt_tokens_times_n() -> None:
    check_prompt_work(LIMITS, [25], 4)
    check_prompt_work(LIMITS, [10, 40], 2)
    err = refused(check_prompt_work, LIMITS, [101], 1)
    assert_over(err, "n", 101, 100, "--max-prompt-tokens-times-n")
    err = refused(check_prompt_work, LIMITS, [26], 4)
    assert_over(err, "n", 104, 100, "--max-prompt-tokens-times-n")
    assert "26 x 4" in err.message


def _tool(name: str, pad: int = 0) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": "d" * pad}}


def test_tool_limits_then_tools_served() -> None:
    check_tools(LIMITS, None)
    check_tools(LIMITS, [_tool("a"), _tool("b")])
    err = refused(check_tools, LIMITS, [_tool("a"), _tool("b"), _tool("c")])
    assert_over(err, "tools", 3, 2, "--max-tools")
    base = len('{"type":"function","function":{"name":"a","description":""}}')
    check_tools(LIMITS, [_tool("a", 200 - base)])
    err = refused(check_tools, LIMITS, [_tool("a", 201 - base)])
    assert_over(err, "tools", 201, 200, "--max-tool-schema-bytes")
    assert refused(check_tools, LIMITS, {"a": 1}).param == "tools"
    assert refused(check_tools, LIMITS, ["a"]).param == "tools"
    # Within the limits, tools are served: "required" builds the grammar; "auto" (the default)
    # needs the frontend's --enable-auto-tool-choice.
    body = parse_chat({**CHAT, "tools": [_tool("a")], "tool_choice": "required"}, LIMITS)
    assert body.tool_calling is not None and body.tool_calling.names == ("a",)
    assert body.params.structured_outputs is not None
    err = refused(parse_chat, {**CHAT, "tools": [_tool("a")]}, LIMITS)
    assert err.param == "tool_choice" and "--enable-auto-tool-choice" in err.message
    assert parse_chat({**CHAT, "tools": [_tool("a")]}, LIMITS, "hermes").tool_calling is not None
    err = refused(parse_chat, {**CHAT, "tools": [_tool("a")] * 3}, LIMITS)
    assert "--max-tools" in err.message


def test_noop_values_of_unimplemented_fields_are_accepted() -> None:
    body = {
        **CHAT,
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "tools": [],
        "logit_bias": {},
        "user": "someone",
        "store": False,
    }
    assert parse_chat(body, LIMITS).messages == [{"role": "user", "content": "hi"}]
    assert parse_completion({**COMPLETION, "echo": False, "suffix": None}, LIMITS).prompts == ["hi"]


def test_every_implemented_field_is_accepted() -> None:
    common = {
        "n": 2,
        "best_of": 2,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.1,
        "seed": 3,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.1,
        "repetition_penalty": 1.1,
        "max_tokens": 4,
        "min_tokens": 1,
        "stop": ["x"],
        "stop_token_ids": [2],
        "ignore_eos": True,
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "stream": True,
        "stream_options": {"include_usage": True},
        "priority": 1,
        "user": "u",
        "logit_bias": {"7": -100, "8": 2.5},
        "allowed_token_ids": [7, 8, 9],
        "bad_words": ["bad word"],
        "vllm_xargs": {"k": 1},
    }
    c = parse_completion({**COMPLETION, **common, "logprobs": 2}, LIMITS)
    assert c.params.n == 2 and c.params.logprobs == 2 and c.stream and c.include_usage
    assert c.params.logit_bias == {7: -100.0, 8: 2.5} and c.params.allowed_token_ids == [7, 8, 9]
    assert c.params.bad_words == ["bad word"] and c.params.extra_args == {"k": 1}
    ch = parse_chat(
        {**CHAT, **common, "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 2},
        LIMITS,
    )
    assert ch.params.max_tokens == 3 and ch.params.logprobs == 2


UNIMPLEMENTED = [
    ("guided_json", {"type": "object"}),
    ("guided_regex", "[a-z]+"),
    ("guided_choice", ["yes", "no"]),
    ("guided_grammar", "root ::= 'a'"),
    ("functions", [{"name": "f"}]),
    ("audio", {"voice": "alloy"}),
    ("reasoning_effort", "low"),
    ("logits_processors", ["m:C"]),
    ("wizardry", 1),
]


@pytest.mark.parametrize(("field", "value"), UNIMPLEMENTED)
def test_unimplemented_fields_are_refused_by_name(field: str, value: Any) -> None:
    err = refused(parse_chat, {**CHAT, field: value}, LIMITS)
    assert err.param == field and field in err.message
    err = refused(parse_completion, {**COMPLETION, field: value}, LIMITS)
    assert err.param == field and field in err.message


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("logit_bias", {"7": 101}, "[-100, 100]"),
        ("logit_bias", {"seven": 1}, "token ids"),
        ("logit_bias", {"7": "x"}, "number"),
        ("logit_bias", [7], "object"),
        ("allowed_token_ids", [], "empty"),
        ("allowed_token_ids", [-1], "non-negative"),
        ("bad_words", "word", "list of strings"),
        ("bad_words", [" "], "empty"),
        ("vllm_xargs", [1], "object"),
    ],
)
def test_bad_logits_processor_fields_are_refused_by_name(
    field: str, value: Any, needle: str
) -> None:
    for parse, body in ((parse_chat, CHAT), (parse_completion, COMPLETION)):
        err = refused(parse, {**body, field: value}, LIMITS)
        assert err.param == field and needle in err.message, err


def test_completion_only_and_chat_only_fields() -> None:
    for field, value in [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "auto"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ]:
        err = refused(parse_completion, {**COMPLETION, field: value})
        assert err.param == field and "chat/completions only" in err.message
    assert parse_completion({**COMPLETION, "echo": True, "logprobs": 1}).params.prompt_logprobs == 1
    assert refused(parse_completion, {**COMPLETION, "suffix": "x"}).param == "suffix"
    assert refused(parse_completion, {**COMPLETION, "messages": []}).param == "messages"
    assert refused(parse_chat, {**CHAT, "prompt": "x"}).param == "prompt"


BAD_MESSAGES: list[tuple[Any, str]] = [
    ([{"role": "wizard", "content": "hi"}], "'wizard'"),
    ([{"role": "tool", "content": "42"}], "tool_call_id is required"),
    ([{"role": "function", "content": "42", "name": "f"}], "use tools"),
    ([{"role": "user", "content": "hi", "tool_call_id": "c"}], "belongs on a tool message"),
    ([{"content": "hi"}], "role"),
    ([{"role": 3, "content": "hi"}], "role"),
    ([{"role": "user"}], "content is required"),
    ([{"role": "user", "content": None}], "content is required"),
    ([{"role": "assistant", "content": None}], "content is required"),
    ([{"role": "user", "content": 5}], "string or a list"),
    ([{"role": "user", "content": {"type": "text", "text": "hi"}}], "string or a list"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "text must be a string"),
    ([{"role": "user", "content": [{"type": "text"}]}], "text must be a string"),
    ([{"role": "user", "content": [{"type": "hologram", "text": "x"}]}], "unknown content part"),
    ([{"role": "user", "content": [{"text": "x"}]}], "unknown content part"),
    ([{"role": "user", "content": ["hi"]}], "must be an object"),
    (
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        "'image_url'",
    ),
    ([{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}], "'x'"),
    ([{"role": "user", "content": "hi", "mood": "sunny"}], "'mood'"),
    ([{"role": "user", "content": "hi", "name": "bob"}], "name"),
    (
        [{"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function"}]}],
        '"type": "function"',
    ),
    (
        [
            {
                "role": "assistant",
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}],
            }
        ],
        "not valid JSON",
    ),
    (["hi"], "must be an object"),
    ([], "non-empty"),
    ("hi", "non-empty"),
]


@pytest.mark.parametrize(("messages", "needle"), BAD_MESSAGES)
def test_bad_chat_messages(messages: Any, needle: str) -> None:
    err = refused(parse_chat, {**CHAT, "messages": messages}, LIMITS)
    assert err.param == "messages"
    assert needle in err.message, err.message


def test_good_chat_messages() -> None:
    messages = check_messages(
        [
            {"role": "system", "content": "be brief"},
            {"role": "developer", "content": ""},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": "ok", "tool_calls": []},
            {"role": "user", "content": "more"},
        ]
    )
    assert [m["role"] for m in messages] == ["system", "developer", "user", "assistant", "user"]
    assert messages[2]["content"] == "ab"


def test_limits_from_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_from_args([]).request_limits == RequestLimits()
    monkeypatch.setenv("TANDEM_FRONTEND_MAX_N", "7")
    config = config_from_args(["--max-tools", "3", "--max-prompt-tokens-times-n", "99"])
    limits = config.request_limits
    assert (limits.max_n, limits.max_tools, limits.max_prompt_tokens_times_n) == (7, 3, 99)
    assert config_from_args(["--max-n", "2"]).max_n == 2  # the flag beats the env
    with pytest.raises(FrontendConfigError, match="max_stop_sequences"):
        config_from_args(["--max-stop-sequences", "0"])
    with pytest.raises(FrontendConfigError, match="max_logprobs"):
        config_from_args(["--max-logprobs", "21"])
