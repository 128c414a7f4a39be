"""Request bounds and bad input at a real frontend (issue 15, "Bounds"): a unified deployment
whose frontend runs with small limits; the official openai client, raw HTTP and gRPC.

Every limit at its value is served (200) and one above it is a 400 / INVALID_ARGUMENT naming
the field, the value and the limit; the bad-input corpus (roles, content types, bad
response_format, structured-output and tool specs) is a 4xx within a second, the next request
a 200; refused requests never reach a worker; the block pools whole afterwards.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import openai
import pytest

from tandem_protos.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tandem_services.launcher import Deployment
from tests.service.conftest import (
    GRACE_S,
    PROMPTS,
    assert_pools_whole,
    launch,
    worker_names,
    worker_stats,
)

MAX_N = 3
MAX_LOGPROBS = 4
MAX_STOP = 2
MAX_STOP_LEN = 5
MAX_TOOLS = 1
MAX_TOOL_BYTES = 300
MAX_PROMPT_X_N = 60
FRONTEND_ARGS = (
    *("--max-n", str(MAX_N), "--max-best-of", str(MAX_N)),
    *("--max-logprobs", str(MAX_LOGPROBS)),
    *("--max-stop-sequences", str(MAX_STOP), "--max-stop-sequence-len", str(MAX_STOP_LEN)),
    *("--max-tools", str(MAX_TOOLS), "--max-tool-schema-bytes", str(MAX_TOOL_BYTES)),
    *("--max-prompt-tokens-times-n", str(MAX_PROMPT_X_N)),
)
GOOD: dict[str, Any] = {"model": "default", "prompt": PROMPTS[1], "max_tokens": 2, "temperature": 0}
CHAT: dict[str, Any] = {
    "model": "default",
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 2,
    "temperature": 0,
}
# Token ids: 20 of them x n=3 is exactly MAX_PROMPT_X_N.
IDS_20 = [1] * 20


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    dep = launch(tmp_path_factory.mktemp("logs-bounds"), unified=True, frontend_args=FRONTEND_ARGS)
    try:
        yield dep
    finally:
        dep.stop(timeout_s=GRACE_S + 10)


def _client(dep: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{dep.http_address}/v1", api_key="x", max_retries=0)


def _tool(pad: int = 0) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "description": "d" * pad}}


_TOOL_BASE = len('{"type":"function","function":{"name":"f","description":""}}')

# (endpoint, body at the limit, body above it, field, value above, limit)
LIMIT_CASES: list[tuple[str, dict[str, Any], dict[str, Any], str, int, int]] = [
    ("completions", {**GOOD, "n": MAX_N}, {**GOOD, "n": MAX_N + 1}, "n", MAX_N + 1, MAX_N),
    (
        "completions",
        {**GOOD, "n": MAX_N, "best_of": MAX_N},
        {**GOOD, "n": MAX_N, "best_of": MAX_N + 1},
        "best_of",
        MAX_N + 1,
        MAX_N,
    ),
    (
        "completions",
        {**GOOD, "logprobs": MAX_LOGPROBS},
        {**GOOD, "logprobs": MAX_LOGPROBS + 1},
        "logprobs",
        MAX_LOGPROBS + 1,
        MAX_LOGPROBS,
    ),
    (
        "chat/completions",
        {**CHAT, "logprobs": True, "top_logprobs": MAX_LOGPROBS},
        {**CHAT, "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1},
        "top_logprobs",
        MAX_LOGPROBS + 1,
        MAX_LOGPROBS,
    ),
    (
        "chat/completions",
        {**CHAT, "prompt_logprobs": MAX_LOGPROBS},
        {**CHAT, "prompt_logprobs": MAX_LOGPROBS + 1},
        "prompt_logprobs",
        MAX_LOGPROBS + 1,
        MAX_LOGPROBS,
    ),
    (
        "completions",
        {**GOOD, "stop": ["zq"] * MAX_STOP},
        {**GOOD, "stop": ["zq"] * (MAX_STOP + 1)},
        "stop",
        MAX_STOP + 1,
        MAX_STOP,
    ),
    (
        "chat/completions",
        {**CHAT, "stop": "z" * MAX_STOP_LEN},
        {**CHAT, "stop": "z" * (MAX_STOP_LEN + 1)},
        "stop",
        MAX_STOP_LEN + 1,
        MAX_STOP_LEN,
    ),
    (
        "completions",
        {**GOOD, "prompt": IDS_20, "n": MAX_N},
        {**GOOD, "prompt": [*IDS_20, 1], "n": MAX_N},
        "n",
        (len(IDS_20) + 1) * MAX_N,
        MAX_PROMPT_X_N,
    ),
    (
        "completions",
        {**GOOD, "prompt": [IDS_20[:10], IDS_20[:10]], "n": MAX_N},
        {**GOOD, "prompt": [IDS_20[:10], IDS_20[:11]], "n": MAX_N},
        "n",
        21 * MAX_N,
        MAX_PROMPT_X_N,
    ),
]


def _is_over(err: dict[str, Any], field: str, value: int, limit: int) -> None:
    assert err["param"] == field, err
    assert err["type"] == "invalid_request_error", err
    assert field in err["message"], err
    assert f"is {value};" in err["message"] and f"limit is {limit}" in err["message"], err


@pytest.mark.parametrize("case", LIMIT_CASES, ids=lambda c: f"{c[0]}-{c[3]}-{c[4]}")
def test_limit_at_and_over_raw_http(
    bounded: Deployment, case: tuple[str, dict[str, Any], dict[str, Any], str, int, int]
) -> None:
    path, at, over, field, value, limit = case
    url = f"http://{bounded.http_address}/v1/{path}"
    with httpx.Client(timeout=120) as http:
        ok = http.post(url, json=at)
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"]
        t0 = time.monotonic()
        r = http.post(url, json=over)
        assert r.status_code == 400, r.text
        assert time.monotonic() - t0 < 1.0
        _is_over(r.json()["error"], field, value, limit)


def test_limits_with_the_openai_client(bounded: Deployment) -> None:
    client = _client(bounded)
    out = client.completions.create(model="default", prompt=PROMPTS[0], max_tokens=2, n=MAX_N)
    assert len(out.choices) == MAX_N
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="default", prompt=PROMPTS[0], max_tokens=2, n=MAX_N + 1)
    assert info.value.status_code == 400
    body: Any = info.value.body
    _is_over(body, "n", MAX_N + 1, MAX_N)

    chat = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        logprobs=True,
        top_logprobs=MAX_LOGPROBS,
    )
    assert chat.choices[0].logprobs is not None
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == MAX_LOGPROBS
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            logprobs=True,
            top_logprobs=MAX_LOGPROBS + 1,
        )
    _is_over(info.value.body, "top_logprobs", MAX_LOGPROBS + 1, MAX_LOGPROBS)  # type: ignore[arg-type]

    # tools: over the count or size limit, refused for it; within, tool_choice "auto" (the
    # default) is refused: this frontend runs without --enable-auto-tool-choice.
    for tools, param, needle in [
        ([_tool()] * (MAX_TOOLS + 1), "tools", "--max-tools"),
        ([_tool(MAX_TOOL_BYTES + 1 - _TOOL_BASE)], "tools", "--max-tool-schema-bytes"),
        ([_tool(MAX_TOOL_BYTES - _TOOL_BASE)], "tool_choice", "--enable-auto-tool-choice"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=2,
                tools=tools,  # type: ignore[arg-type]
            )
        err: Any = info.value.body
        assert err["param"] == param and needle in err["message"], err

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            response_format={"type": "xml"},  # type: ignore[arg-type, typeddict-item]
        )
    assert info.value.body["param"] == "response_format"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            extra_body={"structured_outputs": {"json": {"type": "objekt"}}},
        )
    assert info.value.body["param"] == "structured_outputs"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="default",
            messages=[{"role": "wizard", "content": "Hi"}],  # type: ignore[list-item, misc]
            max_tokens=2,
        )
    ok = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        response_format={"type": "text"},
    )
    assert ok.choices[0].message.content is not None
    assert_pools_whole(bounded)


def test_n_100000_is_refused_at_once_and_the_server_keeps_serving(bounded: Deployment) -> None:
    url = f"http://{bounded.http_address}/v1"
    with httpx.Client(timeout=120) as http:
        for path, body in [
            ("completions", {**GOOD, "n": 100000}),
            ("chat/completions", {**CHAT, "n": 100000}),
        ]:
            t0 = time.monotonic()
            r = http.post(f"{url}/{path}", json=body)
            assert time.monotonic() - t0 < 1.0
            assert r.status_code == 400, r.text
            _is_over(r.json()["error"], "n", 100000, MAX_N)
            ok = http.post(f"{url}/completions", json=GOOD)
            assert ok.status_code == 200, ok.text
            assert ok.json()["choices"][0]["text"]
    assert_pools_whole(bounded)


_PART = {"type": "text", "text": "Hi"}
# (endpoint, body, the field in `param`, a word of the message)
CORPUS: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "chat/completions",
        {**CHAT, "messages": [{"role": "wizard", "content": "Hi"}]},
        "messages",
        "wizard",
    ),
    (
        "chat/completions",
        {**CHAT, "messages": [{"role": "tool", "content": "42"}]},
        "messages",
        "tool_call_id",
    ),
    ("chat/completions", {**CHAT, "messages": [{"role": "user"}]}, "messages", "content"),
    (
        "chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": None}]},
        "messages",
        "content",
    ),
    (
        "chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": 7}]},
        "messages",
        "content",
    ),
    (
        "chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{**_PART, "text": 7}]}]},
        "messages",
        "text",
    ),
    (
        "chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "pdf"}]}]},
        "messages",
        "pdf",
    ),
    (
        "chat/completions",
        {
            **CHAT,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ],
        },
        "messages",
        "image_url",
    ),
    (
        "chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "Hi", "x": 1}]},
        "messages",
        "'x'",
    ),
    (
        "chat/completions",
        {**CHAT, "response_format": {"type": "json_objekt"}},
        "response_format",
        "response_format",
    ),
    (
        "chat/completions",
        {
            **CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"schema": {}}},
        },
        "response_format",
        "name",
    ),
    (
        "completions",
        {
            **GOOD,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"type": 3}},
            },
        },
        "response_format",
        "not a valid JSON schema",
    ),
    (
        "chat/completions",
        {**CHAT, "structured_outputs": {"choice": []}},
        "structured_outputs",
        "structured_outputs",
    ),
    (
        "completions",
        {**GOOD, "structured_outputs": {"regex": "a+", "grammar": "root ::= 'a'"}},
        "structured_outputs",
        "exactly one",
    ),
    ("chat/completions", {**CHAT, "guided_json": {"type": "object"}}, "guided_json", "guided_json"),
    ("completions", {**GOOD, "guided_regex": "a+"}, "guided_regex", "guided_regex"),
    ("chat/completions", {**CHAT, "guided_choice": ["a", "b"]}, "guided_choice", "guided_choice"),
    ("completions", {**GOOD, "guided_grammar": "root ::= 'a'"}, "guided_grammar", "guided_grammar"),
    ("chat/completions", {**CHAT, "tools": [_tool()]}, "tool_choice", "tool_choice"),
    ("chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice", "needs tools"),
    (
        "chat/completions",
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f g"}}]},
        "tools",
        "'f g'",
    ),
    ("completions", {**GOOD, "tools": [_tool()]}, "tools", "chat/completions only"),
    ("chat/completions", {**CHAT, "logit_bias": {"1": 500}}, "logit_bias", "[-100, 100]"),
    ("completions", {**GOOD, "logit_bias": {"99999999": 5}}, "logit_bias", "vocabulary"),
    ("completions", {**GOOD, "allowed_token_ids": [99999999]}, "allowed_token_ids", "vocab"),
    (
        "completions",
        {**GOOD, "prompt_logprobs": 1, "stream": True},
        "prompt_logprobs",
        "stream",
    ),
    (
        "completions",
        {**GOOD, "use_beam_search": True, "stream": True},
        "stream",
        "use_beam_search",
    ),
    ("completions", {**GOOD, "frobnicate": 1}, "frobnicate", "frobnicate"),
    ("chat/completions", {**CHAT, "max_tokens": 2048}, "max_tokens", "context"),
]


def test_bad_input_corpus_is_4xx_and_never_reaches_a_worker(bounded: Deployment) -> None:
    url = f"http://{bounded.http_address}/v1"

    def queries() -> list[int]:
        return [
            worker_stats(bounded.address(n)).prefix_cache_queries for n in worker_names(bounded)
        ]

    with httpx.Client(timeout=120) as http:
        before = queries()
        for path, body, param, needle in CORPUS:
            case = queries()
            t0 = time.monotonic()
            r = http.post(f"{url}/{path}", json=body)
            assert time.monotonic() - t0 < 1.0, (path, body)
            assert r.status_code == 400, (path, body, r.text)
            err = r.json()["error"]
            assert err["param"] == param, (body, err)
            assert needle in err["message"], (body, err)
            # Nothing refused reached a worker (the counter moves for every admitted
            # request), and the next request is served.
            assert queries() == case, (path, body)
            ok = http.post(f"{url}/completions", json=GOOD)
            assert ok.status_code == 200, (path, body, ok.text)
            assert ok.json()["choices"][0]["text"]
        assert queries() != before
    assert_pools_whole(bounded)


def test_grpc_limits_are_invalid_argument(bounded: Deployment) -> None:
    def req(**kwargs: Any) -> frontend_pb2.GenerateRequest:
        prompt = kwargs.pop("prompt", None)
        params = common_pb2.SamplingParams(temperature=0, max_tokens=2, **kwargs)
        if prompt is not None:
            return frontend_pb2.GenerateRequest(
                token_ids=frontend_pb2.TokenIds(ids=prompt), sampling_params=params
            )
        return frontend_pb2.GenerateRequest(text=PROMPTS[1], sampling_params=params)

    cases = [
        (req(n=MAX_N), req(n=MAX_N + 1), "n"),
        (req(logprobs=MAX_LOGPROBS), req(logprobs=MAX_LOGPROBS + 1), "logprobs"),
        (req(stop=["zq"] * MAX_STOP), req(stop=["zq"] * (MAX_STOP + 1)), "stop"),
        (req(stop=["z" * MAX_STOP_LEN]), req(stop=["z" * (MAX_STOP_LEN + 1)]), "stop"),
        (req(prompt=IDS_20, n=MAX_N), req(prompt=[*IDS_20, 1], n=MAX_N), "prompt tokens x n"),
    ]

    async def run() -> None:
        async with grpc.aio.insecure_channel(bounded.grpc_address) as channel:
            stub = frontend_pb2_grpc.FrontendStub(channel)
            for at, over, needle in cases:
                responses = [r async for r in stub.Generate(at)]
                assert responses and responses[-1].HasField("usage")
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    _ = [r async for r in stub.Generate(over)]
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert needle in (info.value.details() or ""), info.value.details()
                assert "limit is" in (info.value.details() or "")
            wizard = frontend_pb2.GenerateRequest(
                chat=frontend_pb2.Chat(messages=[frontend_pb2.ChatMessage(role="wizard")]),
                sampling_params=common_pb2.SamplingParams(max_tokens=2),
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                _ = [r async for r in stub.Generate(wizard)]
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "wizard" in (info.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Tokenize(frontend_pb2.TokenizeRequest(chat=wizard.chat))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "wizard" in (info.value.details() or "")

    asyncio.run(run())
    assert_pools_whole(bounded)
