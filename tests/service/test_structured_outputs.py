"""Structured outputs through the deployed system (real processes, gRPC on 127.0.0.1), unified
and disaggregated: greedy outputs identical to the offline engine's (on the disaggregated
deployment the prefill worker samples the first token under the grammar and the decode
worker's matcher starts from it: only the spec crosses the wire), every output valid, and a
spec that does not compile ends its request with an error naming the problem while the
workers keep serving, their pools whole."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import grpc
import jsonschema
import pytest

from tandem.sampling_params import SamplingParams, StructuredOutputsParams
from tandem_protos.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tandem_services.common.convert import (
    sampling_params_from_proto,
    sampling_params_to_proto,
)
from tandem_services.launcher import Deployment
from tests.service.conftest import ENGINE_ARGS, assert_pools_whole

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.timeout(600)

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "tags": {
            "type": "array",
            "items": {"enum": ["a", "b", "c"]},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "tags"],
}
REGEX = r"[0-9]{3}-[a-z]{3}"
CHOICES = ["yes", "no", "it depends"]
CASES: list[tuple[str, StructuredOutputsParams, int]] = [
    ("Describe a person as JSON:", StructuredOutputsParams(json=SCHEMA), 100),
    ("A code:", StructuredOutputsParams(regex=REGEX), 20),
    ("Is the sky green? Answer:", StructuredOutputsParams(choice=CHOICES), 10),
    ("A JSON object about a dog:", StructuredOutputsParams(json_object=True), 60),
]


def params_of(spec: StructuredOutputsParams, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=spec)


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    else:
        assert isinstance(json.loads(text), dict)


@pytest.fixture(scope="module")
def offline() -> list[list[int]]:
    from tandem import LLM

    llm = LLM(model="default", **ENGINE_ARGS)
    try:
        outs = llm.generate(
            [c[0] for c in CASES], [params_of(c[1], c[2]) for c in CASES], use_tqdm=False
        )
        for (_, spec, _), out in zip(CASES, outs, strict=True):
            assert out.outputs[0].finish_reason == "stop"
            check(spec.kind, out.outputs[0].text)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def test_specs_survive_the_proto_round_trip() -> None:
    for _, spec, n in [*CASES, ("", StructuredOutputsParams(grammar='root ::= "x"'), 1)]:
        params = params_of(spec, n)
        back = sampling_params_from_proto(sampling_params_to_proto(params))
        assert back.structured_outputs is not None
        assert back.structured_outputs.kind == spec.kind
        if spec.kind == "json":
            assert json.loads(back.structured_outputs.json) == SCHEMA  # type: ignore[arg-type]
        else:
            assert back.structured_outputs == spec
    assert sampling_params_from_proto(common_pb2.SamplingParams()).structured_outputs is None


async def _generate(address: str, text: str, params: SamplingParams) -> tuple[str, list[int], Any]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = frontend_pb2_grpc.FrontendStub(channel)
        request = frontend_pb2.GenerateRequest(
            text=text, sampling_params=sampling_params_to_proto(params)
        )
        responses = [r async for r in stub.Generate(request)]
    text_out = "".join(c.text for r in responses for c in r.choices)
    ids = [t for r in responses for c in r.choices for t in c.token_ids]
    finish = responses[-1].choices[-1].finish_reason
    return text_out, ids, finish


def test_greedy_structured_outputs_match_offline(
    deployment: Deployment, offline: list[list[int]]
) -> None:
    async def run() -> list[tuple[str, list[int], Any]]:
        return await asyncio.gather(
            *(_generate(deployment.grpc_address, p, params_of(s, n)) for p, s, n in CASES)
        )

    for (prompt, spec, _), expected, (text, ids, finish) in zip(
        CASES, offline, asyncio.run(run()), strict=True
    ):
        assert ids == expected, prompt
        assert finish == common_pb2.FINISH_REASON_STOP
        check(spec.kind, text)
    assert_pools_whole(deployment)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputsParams(regex="(abc"), "structured_outputs.regex: invalid"),
        (
            StructuredOutputsParams(json={"type": "object", "not": {"required": ["a"]}}),
            "unsupported JSON schema feature 'not'",
        ),
    ],
)
def test_a_bad_spec_ends_with_an_error_naming_it(
    deployment: Deployment, spec: StructuredOutputsParams, message: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(_generate(deployment.grpc_address, "Hello", params_of(spec, 8)))
    assert message in (info.value.details() or ""), info.value.details()
    assert info.value.code() != grpc.StatusCode.OK
    # The workers keep serving.
    text, _, finish = asyncio.run(
        _generate(
            deployment.grpc_address, "Hello", params_of(StructuredOutputsParams(choice=CHOICES), 8)
        )
    )
    assert text in CHOICES and finish == common_pb2.FINISH_REASON_STOP
    assert_pools_whole(deployment)
