"""Logits processors through a served deployment (issue 29): one disaggregated deployment of
the embedded model whose workers load a custom processor (`--logits-processors
tests.logits_procs:ForceTokenProcessor`), the official openai client and gRPC Generate.

Every field crosses every hop (frontend -> scheduler -> prefill worker -> decode worker ->
their engine processes): `logit_bias` +100 forces its token on both endpoints and -100 bans
it; `allowed_token_ids` and a two-token `bad_words` entry (extra body) hold; the custom
processor acts on the requests that ask (`vllm_xargs`); processors compose with structured
outputs; bad values are 400s naming the field, from the frontend (range, vocabulary) and from
the engine (a processor refusing the request's arguments), and the next request is served.
The block pools are whole after every test. The module runs twice: without speculation and
with n-gram speculation on the workers (the decode worker verifies drafts under every
processor; its /metrics count accepted drafts).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest

from tandem_protos.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tandem_services.launcher import Deployment
from tests.service.conftest import (
    GRACE_S,
    WORKER_ARGS,
    assert_pools_whole,
    launch,
    wait_until,
)

PROMPT = "The capital of France is"
BANANA = " banana"


# Drafts from single-token lookups: a forced or biased output repeats its token. Every step
# takes its drafts (the measured rule could pass over a short request's steps).
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "speculation_rule": "always",
}


@pytest.fixture(scope="module", params=["plain", "ngram"])
def dep(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    logs = tmp_path_factory.mktemp(f"logs-logits-{request.param}")
    worker_args = (*WORKER_ARGS, "--logits-processors", "tests.logits_procs:ForceTokenProcessor")
    if request.param == "ngram":
        worker_args += ("--speculative-config", json.dumps(NGRAM), "--metrics-port", "0")
    d = launch(logs, unified=False, worker_args=worker_args)
    try:
        yield d
    finally:
        d.stop(timeout_s=GRACE_S + 10)


@pytest.fixture
def client(dep: Deployment) -> Iterator[openai.OpenAI]:
    yield openai.OpenAI(base_url=f"http://{dep.http_address}/v1", api_key="x", max_retries=0)
    assert_pools_whole(dep)


def accepted_drafts(dep: Deployment) -> float | None:
    """The decode worker's accepted draft tokens (None: not in its /metrics)."""
    url = f"http://{dep.services['decode'].info['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith("tandem_worker_spec_decode_num_accepted_tokens_total"):
            return float(line.rpartition(" ")[2])
    return None


def one_token(tokenizer: Any, text: str) -> int:
    (token,) = tokenizer.encode(text, add_special_tokens=False)
    return token


def complete(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[str]]:
    """Greedy completion of PROMPT: its text and its tokens (as strings)."""
    args: dict[str, Any] = {"model": "default", "prompt": PROMPT, "max_tokens": 8}
    args.update(temperature=0, logprobs=0)
    args.update(kwargs)
    r = client.completions.create(**args)
    choice = r.choices[0]
    return choice.text, list(choice.logprobs.tokens)


def test_logit_bias_allowed_token_ids_and_bad_words(
    client: openai.OpenAI, smollm2_tokenizer: Any
) -> None:
    banana = one_token(smollm2_tokenizer, BANANA)
    text, _ = complete(client, max_tokens=4, logit_bias={str(banana): 100})
    assert text == BANANA * 4
    chat = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Name a fruit."}],
        max_tokens=3,
        temperature=0,
        logit_bias={str(banana): 100},
    )
    assert chat.choices[0].message.content == BANANA * 3

    _, ref_tokens = complete(client)
    first = one_token(smollm2_tokenizer, ref_tokens[0])
    _, tokens = complete(client, logit_bias={str(first): -100})
    assert ref_tokens[0] not in tokens and tokens != ref_tokens

    yes, no = one_token(smollm2_tokenizer, " yes"), one_token(smollm2_tokenizer, " no")
    text, _ = complete(client, temperature=1.0, seed=0, extra_body={"allowed_token_ids": [yes, no]})
    assert re.fullmatch(r"( yes| no){8}", text), text

    # A two-token bad word: the reference's first two tokens never follow each other.
    word = ref_tokens[0] + ref_tokens[1]
    pair = (ref_tokens[0], ref_tokens[1])
    _, tokens = complete(client, extra_body={"bad_words": [word.strip()]})
    assert pair not in itertools.pairwise(tokens), tokens
    assert tokens != ref_tokens


def test_custom_processor_and_structured_outputs(
    client: openai.OpenAI,
    dep: Deployment,
    smollm2_tokenizer: Any,
    request: pytest.FixtureRequest,
) -> None:
    banana = one_token(smollm2_tokenizer, BANANA)
    speculative = request.node.callspec.params["dep"] == "ngram"
    before = accepted_drafts(dep) if speculative else None
    text, _ = complete(client, max_tokens=5, extra_body={"vllm_xargs": {"force_token_id": banana}})
    assert text == BANANA * 5
    if speculative:
        # The forced tokens were drafted, verified under the processor and accepted.
        assert before is not None
        wait_until(
            lambda: (accepted_drafts(dep) or 0) > before, 20.0, "accepted drafts in /metrics"
        )
    # Not forced: the same as without the processor's arguments.
    assert complete(client)[0] == complete(client, extra_body={"vllm_xargs": {"other": 1}})[0]

    yes, no = one_token(smollm2_tokenizer, "yes"), one_token(smollm2_tokenizer, "no")
    for banned, expected in ((yes, "no"), (no, "yes")):
        r = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Is the sky blue?"}],
            max_tokens=5,
            temperature=0,
            logit_bias={str(banned): -100},
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        )
        assert r.choices[0].message.content == expected


def test_bad_values_are_400s_naming_the_field(client: openai.OpenAI) -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"49152": 1}}, "logit_bias", "vocabulary"),
        ({"extra_body": {"allowed_token_ids": [70000]}}, "allowed_token_ids", "vocabulary"),
        ({"extra_body": {"bad_words": "word"}}, "bad_words", "list of strings"),
        # Refused by the worker's engine (the processor's validate_params), still a 400.
        ({"extra_body": {"vllm_xargs": {"force_token_id": "x"}}}, "", "force_token_id"),
    ]
    for kwargs, param, needle in cases:
        with pytest.raises(openai.BadRequestError) as info:
            complete(client, **kwargs)
        body = info.value.body
        assert isinstance(body, dict) and needle in body["message"], (kwargs, body)
        if param:
            assert body["param"] == param, (kwargs, body)
    assert complete(client, max_tokens=2)[0]


def test_grpc_generate_carries_the_fields(dep: Deployment, smollm2_tokenizer: Any) -> None:
    banana = one_token(smollm2_tokenizer, BANANA)

    async def generate(**fields: Any) -> list[int]:
        async with grpc.aio.insecure_channel(dep.grpc_address) as channel:
            stub = frontend_pb2_grpc.FrontendStub(channel)
            params = common_pb2.SamplingParams(temperature=0, max_tokens=6, **fields)
            request = frontend_pb2.GenerateRequest(
                text=PROMPT,
                sampling_params=params,
                output_kind=frontend_pb2.OUTPUT_KIND_FINAL_ONLY,
            )
            ids: list[int] = []
            async for response in stub.Generate(request):
                for c in response.choices:
                    ids += list(c.token_ids)
            return ids

    async def run() -> None:
        assert await generate(logit_bias={banana: 100.0}) == [banana] * 6
        assert await generate(allowed_token_ids=[banana]) == [banana] * 6
        forced = json.dumps({"force_token_id": banana})
        assert await generate(extra_args_json=forced) == [banana] * 6
        ref = await generate()
        out = await generate(bad_words=[smollm2_tokenizer.decode(ref[:2]).strip()])
        assert (ref[0], ref[1]) not in itertools.pairwise(out)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(logit_bias={banana: 500.0})
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "logit_bias" in (info.value.details() or "")

    asyncio.run(run())
    assert_pools_whole(dep)
