"""The frontend's declared request models (openai_protocol.py: COMPLETION, CHAT; grpc_api.py:
parse_generate): every declared field, given a bad value, is refused by its one-pass check
with a 400 naming that field; null is as if left out; a Generate request's fields are checked
before anything needs its tokens."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from tandem.core.outputs import EngineCoreOutput, Logprobs
from tandem.sampling_params import SamplingParams
from tandem_protos.v1 import common_pb2, frontend_pb2
from tandem_services.common.convert import (
    logprobs_from_proto,
    output_to_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
)
from tandem_services.frontend.grpc_api import parse_generate
from tandem_services.frontend.limits import RequestLimits
from tandem_services.frontend.openai_protocol import (
    CHAT,
    COMPLETION,
    RequestModel,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from tandem_services.frontend.types import FrontendError, PromptOptions

LIMITS = RequestLimits(max_n=4, max_logprobs=5, max_stop_sequences=2)
COMPLETION_BODY: dict[str, Any] = {"prompt": "hi"}
CHAT_BODY: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}

# A bad value of each declared field (wrong type or shape, or over its limit).
BAD: dict[str, Any] = {
    "prompt": 5,
    "messages": [],
    "model": 1,
    "n": "2",
    "best_of": 1.5,
    "temperature": "hot",
    "top_p": True,
    "top_k": 1.5,
    "min_p": "x",
    "seed": "x",
    "presence_penalty": "x",
    "frequency_penalty": [],
    "repetition_penalty": {},
    "max_tokens": "ten",
    "max_completion_tokens": "ten",
    "min_tokens": "x",
    "stop": 5,
    "stop_token_ids": ["a"],
    "ignore_eos": 1,
    "include_stop_str_in_output": "yes",
    "skip_special_tokens": 0,
    "prompt_logprobs": 1.5,
    "add_special_tokens": "yes",
    "truncate_prompt_tokens": 0,
    "cache_salt": "",
    "return_token_ids": "yes",
    "return_tokens_as_token_ids": 1,
    "use_beam_search": "yes",
    "length_penalty": "long",
    "stream": "yes",
    "stream_options": {"include_usage": 1},
    "priority": 1.5,
    "logit_bias": [7],
    "allowed_token_ids": "x",
    "bad_words": "word",
    "vllm_xargs": [1],
    "response_format": {"type": "xml"},
    "structured_outputs": {"regex": ""},
    "top_logprobs": 6,
    "tools": {"a": 1},
    "tool_choice": "sometimes",
    "parallel_tool_calls": "yes",
    "add_generation_prompt": "yes",
    "continue_final_message": 1,
    "chat_template_kwargs": {"enable_thinking": False, "tokenize": True},
}
# Per endpoint where the field's bad value differs.
BAD_COMPLETION = {"logprobs": 6, "echo": "yes"}
BAD_CHAT = {"logprobs": 1}
# Declared to be accepted whatever it is (an end-user id).
ANY_VALUE = {"user"}


def _cases(model: RequestModel, bad: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(name, bad.get(name, BAD.get(name))) for name in model.fields if name not in ANY_VALUE]


def test_every_declared_field_has_a_bad_case() -> None:
    """A newly declared field gets its bad case here (or is declared to take anything)."""
    for model, bad in ((COMPLETION, BAD_COMPLETION), (CHAT, BAD_CHAT)):
        missing = [n for n, v in _cases(model, bad) if v is None]
        assert missing == []


def _refused(parse: Any, body: dict[str, Any]) -> FrontendError:
    with pytest.raises(FrontendError) as info:
        parse(body, LIMITS)
    assert info.value.http_status == 400
    return info.value


@pytest.mark.parametrize(("name", "value"), _cases(COMPLETION, BAD_COMPLETION))
def test_completion_bad_field_is_named(name: str, value: Any) -> None:
    err = _refused(parse_completion, {**COMPLETION_BODY, name: value})
    assert err.param == name, err.message


@pytest.mark.parametrize(("name", "value"), _cases(CHAT, BAD_CHAT))
def test_chat_bad_field_is_named(name: str, value: Any) -> None:
    err = _refused(parse_chat, {**CHAT_BODY, name: value})
    assert err.param == name, err.message


def test_null_is_left_out_and_required_fields_are_named() -> None:
    nulls = {name: None for name in COMPLETION.fields if name != "prompt"}
    body = parse_completion({**COMPLETION_BODY, **nulls}, LIMITS)
    assert body.params.n == 1 and body.params.max_tokens == 16 and body.params.stop == []
    assert not body.stream and not body.include_usage and body.priority == 0
    nulls = {name: None for name in CHAT.fields if name != "messages"}
    chat = parse_chat({**CHAT_BODY, **nulls}, LIMITS)
    assert chat.params.max_tokens is None and chat.tools is None and chat.tool_calling is None
    assert _refused(parse_completion, {"prompt": None}).message == "prompt is required"
    assert _refused(parse_chat, {}).param == "messages"


def test_echo_and_prompt_logprobs_are_read() -> None:
    """echo with logprobs asks for the prompt's logprobs (as many top ones), shown in the
    echoed logprobs, not as `prompt_logprobs`; asked for by name they are shown, never
    streamed (vLLM's rule), and bounded as logprobs are."""
    assert parse_completion({**COMPLETION_BODY, "echo": True}, LIMITS).echo
    assert not parse_completion(COMPLETION_BODY, LIMITS).echo
    body = parse_completion({**COMPLETION_BODY, "echo": True, "logprobs": 3}, LIMITS)
    assert body.params.prompt_logprobs == 3 and not body.show_prompt_logprobs
    assert parse_completion(COMPLETION_BODY, LIMITS).params.prompt_logprobs is None
    body = parse_completion({**COMPLETION_BODY, "echo": True, "logprobs": 3, "prompt_logprobs": 0})
    assert body.params.prompt_logprobs == 0 and body.show_prompt_logprobs
    assert parse_chat({**CHAT_BODY, "prompt_logprobs": 2}, LIMITS).params.prompt_logprobs == 2
    # echo with max_tokens 0: the prompt alone is shown; the engine samples one token.
    body = parse_completion({**COMPLETION_BODY, "echo": True, "max_tokens": 0}, LIMITS)
    assert body.prompt_only and body.params.max_tokens == 1
    assert not parse_completion({**COMPLETION_BODY, "echo": True}, LIMITS).prompt_only
    assert _refused(parse_completion, {**COMPLETION_BODY, "max_tokens": 0}).param == "max_tokens"
    for parse, base in ((parse_completion, COMPLETION_BODY), (parse_chat, CHAT_BODY)):
        err = _refused(parse, {**base, "prompt_logprobs": 1, "stream": True})
        assert err.param == "prompt_logprobs" and "stream" in err.message
        err = _refused(parse, {**base, "prompt_logprobs": -1})
        assert err.param == "prompt_logprobs"
        err = _refused(parse, {**base, "prompt_logprobs": LIMITS.max_logprobs + 1})
        assert err.param == "prompt_logprobs" and "max-logprobs" in err.message


def test_beam_search_is_read_and_its_conflicts_refused() -> None:
    """use_beam_search: `n` is the beam width, length_penalty defaults to 1; what beam
    search cannot serve with is a 400 naming the field."""
    body = parse_completion({**COMPLETION_BODY, "use_beam_search": True, "n": 3}, LIMITS)
    assert body.beam_length_penalty == 1.0 and body.params.n == 3
    assert parse_completion(COMPLETION_BODY, LIMITS).beam_length_penalty is None
    chat = parse_chat({**CHAT_BODY, "use_beam_search": True, "length_penalty": 0.5}, LIMITS)
    assert chat.beam_length_penalty == 0.5
    for parse, base in ((parse_completion, COMPLETION_BODY), (parse_chat, CHAT_BODY)):
        beam = {**base, "use_beam_search": True}
        for field, value in (
            ("stream", True),
            ("temperature", 0.7),
            ("prompt_logprobs", 0),
            ("structured_outputs", {"regex": "a+"}),
            ("n", 11),
        ):
            assert _refused(parse, {**beam, field: value}).param == field, field
        assert _refused(parse, {**base, "length_penalty": 2.0}).param == "length_penalty"
    assert _refused(parse_completion, {**COMPLETION_BODY, "use_beam_search": True, "logprobs": 0})
    assert _refused(parse_chat, {**CHAT_BODY, "use_beam_search": True, "logprobs": True})


def test_prompt_options_are_read_and_checked() -> None:
    """add_special_tokens (the endpoint's default when left out), truncate_prompt_tokens (-1
    or >= 1) and cache_salt (a non-empty string), on both endpoints and over gRPC."""
    for parse, base, default in (
        (parse_completion, COMPLETION_BODY, True),
        (parse_chat, CHAT_BODY, False),
    ):
        plain = parse(base, LIMITS).prompt_options
        assert plain == PromptOptions() and plain.special_tokens(default) is default
        opts = parse(
            {**base, "add_special_tokens": not default, "truncate_prompt_tokens": 7,
             "cache_salt": "s3cret"},
            LIMITS,
        ).prompt_options  # fmt: skip
        assert opts.special_tokens(default) is (not default)
        assert (opts.truncate_prompt_tokens, opts.cache_salt) == (7, "s3cret")
        assert parse({**base, "truncate_prompt_tokens": -1}, LIMITS).prompt_options == (
            PromptOptions(truncate_prompt_tokens=-1)
        )
        for bad in (0, -2):
            err = _refused(parse, {**base, "truncate_prompt_tokens": bad})
            assert err.param == "truncate_prompt_tokens" and str(bad) in err.message
        assert _refused(parse, {**base, "cache_salt": ""}).param == "cache_salt"
    args = parse_generate(
        frontend_pb2.GenerateRequest(
            text="hi", add_special_tokens=False, truncate_prompt_tokens=3, cache_salt="k"
        ),
        LIMITS,
    )
    assert args.prompt_options == PromptOptions(False, 3, "k")
    assert parse_generate(_generate(), LIMITS).prompt_options == PromptOptions()
    with pytest.raises(FrontendError) as info:
        parse_generate(frontend_pb2.GenerateRequest(text="hi", truncate_prompt_tokens=0), LIMITS)
    assert info.value.param == "truncate_prompt_tokens"


def test_chat_template_options_are_read_and_checked() -> None:
    plain = parse_chat(CHAT_BODY, LIMITS).template
    assert (plain.add_generation_prompt, plain.continue_final_message) == (True, False)
    assert dict(plain.kwargs) == {}
    body = {
        **CHAT_BODY,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    options = parse_chat(body, LIMITS).template
    assert (options.add_generation_prompt, options.continue_final_message) == (False, True)
    assert dict(options.kwargs) == {"enable_thinking": False}
    # Continuing the final message with the generation prompt added is contradictory.
    err = _refused(parse_chat, {**CHAT_BODY, "continue_final_message": True})
    assert err.param == "continue_final_message" and "add_generation_prompt" in err.message
    # The template's own arguments have fields of their own.
    err = _refused(parse_chat, {**CHAT_BODY, "chat_template_kwargs": {"tools": [], "x": 1}})
    assert err.param == "chat_template_kwargs" and "tools" in err.message


def test_tokenize_and_detokenize_bodies() -> None:
    text = parse_tokenize({"prompt": "hi"}, LIMITS)
    assert (text.prompt, text.messages, text.add_special_tokens) == ("hi", None, True)
    chat = parse_tokenize({**CHAT_BODY, "add_generation_prompt": False}, LIMITS)
    assert chat.prompt is None and chat.messages == CHAT_BODY["messages"]
    assert not chat.add_special_tokens and not chat.template.add_generation_prompt
    assert parse_tokenize({"prompt": "x", "return_token_strs": True}, LIMITS).return_token_strs
    for body in ({}, {"prompt": "x", **CHAT_BODY}):
        assert _refused(parse_tokenize, body).param == "prompt"
    assert _refused(parse_tokenize, {"prompt": None}).param == "prompt"
    assert _refused(parse_tokenize, {"prompt": 5}).param == "prompt"
    # A field of the other form, or of generation, is refused by name.
    err = _refused(parse_tokenize, {"prompt": "x", "add_generation_prompt": False})
    assert err.param == "add_generation_prompt"
    assert _refused(parse_tokenize, {"prompt": "x", "max_tokens": 5}).param == "max_tokens"
    assert _refused(parse_tokenize, {"messages": []}).param == "messages"
    assert parse_detokenize({"tokens": [1, 2]}, LIMITS).tokens == [1, 2]
    assert _refused(parse_detokenize, {}).param == "tokens"
    assert _refused(parse_detokenize, {"tokens": [1, 2**31]}).param == "tokens"


def test_fields_of_the_other_endpoint_are_refused_by_name() -> None:
    assert _refused(parse_completion, {**COMPLETION_BODY, "top_logprobs": 1}).param == (
        "top_logprobs"
    )
    assert _refused(parse_chat, {**CHAT_BODY, "prompt": "x"}).param == "prompt"


# Integers past their wire field's width (common.proto: int32, the seed int64) are refused by
# name before anything converts them to protobuf; the widths' edges pass and convert.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
PAST_WIDTH: dict[str, Any] = {
    "top_k": INT32_MAX + 1,
    "seed": INT64_MAX + 1,
    "priority": -(2**31) - 1,
    "min_tokens": INT32_MAX + 1,
    "max_tokens": INT32_MAX + 1,
    "stop_token_ids": [1, INT32_MAX + 1],
    "allowed_token_ids": [10**10],
}


@pytest.mark.parametrize(("name", "value"), sorted(PAST_WIDTH.items()))
def test_an_integer_past_its_wire_width_is_refused_by_name(name: str, value: Any) -> None:
    err = _refused(parse_completion, {**COMPLETION_BODY, name: value})
    assert err.param == name and "must" in err.message, err.message
    if name in CHAT.fields:
        assert _refused(parse_chat, {**CHAT_BODY, name: value}).param == name


def test_integers_at_their_wire_widths_edges_convert() -> None:
    for seed, top_k in ((INT64_MAX, INT32_MAX), (-(2**63), -1)):
        body = parse_completion(
            {
                **COMPLETION_BODY,
                "seed": seed,
                "top_k": top_k,
                "priority": INT32_MAX,
                "stop_token_ids": [INT32_MAX],
            },
            LIMITS,
        )
        msg = sampling_params_to_proto(body.params)
        assert (msg.seed, msg.top_k, list(msg.stop_token_ids)) == (seed, top_k, [INT32_MAX])
        assert body.priority == INT32_MAX


def test_prompt_logprobs_cross_the_wire() -> None:
    """SamplingParams.prompt_logprobs travels (0 is an ask, not unset) and comes back; an
    engine output's prompt logprobs ride its RequestOutput."""
    for k in (0, 4):
        msg = sampling_params_to_proto(SamplingParams(prompt_logprobs=k))
        assert msg.HasField("prompt_logprobs") and msg.prompt_logprobs == k
        assert sampling_params_from_proto(msg).prompt_logprobs == k
    assert not sampling_params_to_proto(SamplingParams()).HasField("prompt_logprobs")
    assert sampling_params_from_proto(common_pb2.SamplingParams()).prompt_logprobs is None
    lps = [
        Logprobs([5, 1, 5], [-0.5, -0.25, -0.5], 2),
        Logprobs([9, 1, 2], [-3.0, -0.125, -1.0], 4),
    ]
    out = output_to_proto(EngineCoreOutput("r", [3], prompt_logprobs=lps), 0)
    assert [logprobs_from_proto(m) for m in out.prompt_logprobs] == lps
    assert not output_to_proto(EngineCoreOutput("r", [3]), 0).prompt_logprobs


# ----------------------------------------------------------------------------- gRPC Generate


def _generate(**kwargs: Any) -> frontend_pb2.GenerateRequest:
    prompt = kwargs.pop("prompt", {"text": "hi"})
    return frontend_pb2.GenerateRequest(
        sampling_params=common_pb2.SamplingParams(**kwargs), **prompt
    )


def _chat(**options: Any) -> frontend_pb2.Chat:
    return frontend_pb2.Chat(
        messages=[frontend_pb2.ChatMessage(role="user", content="hi")], **options
    )


def test_generate_args() -> None:
    args = parse_generate(_generate(n=4, logprobs=5, stop=["a", "b"]), LIMITS)
    assert (args.prompt, args.text, args.max_tokens, args.params.n) == ("text", "hi", None, 4)
    ids = frontend_pb2.TokenIds(ids=[1, 2])
    args = parse_generate(_generate(max_tokens=3, prompt={"token_ids": ids}), LIMITS)
    assert (args.prompt, args.token_ids, args.max_tokens) == ("token_ids", [1, 2], 3)
    chat = frontend_pb2.Chat(messages=[frontend_pb2.ChatMessage(role="user", content="hi")])
    args = parse_generate(_generate(prompt={"chat": chat}), LIMITS)
    assert args.messages == [{"role": "user", "content": "hi"}]
    assert args.template.add_generation_prompt and not args.template.continue_final_message
    chat.add_generation_prompt = False
    chat.continue_final_message = True
    chat.chat_template_kwargs_json = '{"enable_thinking": false}'
    template = parse_generate(_generate(prompt={"chat": chat}), LIMITS).template
    assert (template.add_generation_prompt, template.continue_final_message) == (False, True)
    assert dict(template.kwargs) == {"enable_thinking": False}


@pytest.mark.parametrize(
    ("request_", "needle"),
    [
        (_generate(n=5), "--max-n"),
        (_generate(logprobs=6), "--max-logprobs"),
        (_generate(stop=["a", "b", "c"]), "--max-stop-sequences"),
        (_generate(temperature=-1), "temperature"),
        (
            _generate(structured_outputs=common_pb2.StructuredOutputs(json='{"type": 5}')),
            "not a valid JSON schema",
        ),
        (_generate(prompt={"chat": frontend_pb2.Chat()}), "chat.messages is empty"),
        (
            _generate(
                prompt={
                    "chat": frontend_pb2.Chat(messages=[frontend_pb2.ChatMessage(role="wizard")])
                }
            ),
            "wizard",
        ),
        (_generate(prompt={}), "a prompt"),
        (_generate(prompt={"chat": _chat(continue_final_message=True)}), "cannot both be true"),
        (_generate(prompt={"chat": _chat(chat_template_kwargs_json="[1]")}), "a JSON object"),
        (_generate(prompt={"chat": _chat(chat_template_kwargs_json="{")}), "not a JSON object"),
        (
            _generate(prompt={"chat": _chat(chat_template_kwargs_json='{"tokenize": true}')}),
            "may not set tokenize",
        ),
        # Nested too deeply for Python's JSON parser, or for the hand-off to the engine.
        (_generate(extra_args_json='{"a":' * 50_000 + "1" + "}" * 50_000), "nests too deeply"),
        (_generate(extra_args_json='{"a":' * 40 + "1" + "}" * 40), "extra_args nests"),
        (
            _generate(structured_outputs=common_pb2.StructuredOutputs(json="[" * 50_000)),
            "nests too deeply",
        ),
    ],
)
def test_generate_refusals_are_invalid_argument(
    request_: frontend_pb2.GenerateRequest, needle: str
) -> None:
    with pytest.raises(FrontendError) as info:
        parse_generate(request_, LIMITS)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in info.value.message
