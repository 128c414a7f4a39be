"""Structured outputs through the offline engine on the CPU with the embedded SmolLM2: every
output parses and validates, regex and choice outputs match, seeded samples are valid, greedy
outputs do not depend on chunked prefill, preemption or async scheduling, bad specs fail
naming the problem while the engine keeps serving, and a request waiting for its grammar does
not hold up the others. The block pool is whole after every test."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from tandem.core.structured import GrammarStatus
from tandem.engine.llm import LLM
from tandem.request import EngineCoreRequest
from tandem.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from tests.conftest import deep_schema

pytest.importorskip("xgrammar")

SCHEMAS: list[dict[str, Any]] = [
    {  # nested objects, required fields, string lengths, integer range
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 2, "maxLength": 12},
                    "age": {"type": "integer", "minimum": 18, "maximum": 99},
                },
                "required": ["name", "age"],
            },
            "city": {"type": "string", "maxLength": 16},
        },
        "required": ["person", "city"],
    },
    {  # an array with min/max items
        "type": "object",
        "properties": {
            "primes": {
                "type": "array",
                "items": {"type": "integer", "minimum": 2, "maximum": 97},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["primes"],
    },
    {  # enums
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
        },
        "required": ["color", "size"],
    },
    {  # numbers with ranges, a boolean
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 5},
            "ok": {"type": "boolean"},
        },
        "required": ["score", "count", "ok"],
    },
    {  # strings with patterns and lengths
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "note": {"type": "string", "minLength": 3, "maxLength": 10},
        },
        "required": ["code", "note"],
    },
]
PROMPTS = [
    "Describe a person who lives in a city, as JSON:",
    "List a few prime numbers as JSON:",
    "Pick a color and a T-shirt size, as JSON:",
    "Rate this movie as JSON:",
    "Give a product code and a short note, as JSON:",
]
REGEXES = [
    r"[0-9]{3}-[a-z]{3}",
    r"(red|green|blue) [0-9]{1,2}",
    r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8})?",
]
CHOICES = ["yes", "no", "it depends"]

# A generous compile limit: a loaded machine must not fail the tests' grammars.
BASE: dict[str, Any] = dict(
    device="cpu", dtype="float32", max_num_seqs=8, max_model_len=256, compile_timeout_s=600
)


def greedy(spec: StructuredOutputsParams, max_tokens: int = 120) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=spec)


def workload() -> tuple[list[str], list[SamplingParams]]:
    prompts = list(PROMPTS)
    params = [greedy(StructuredOutputsParams(json=s)) for s in SCHEMAS]
    prompts += ["A code:", "A color and a number:", "A name:"]
    params += [greedy(StructuredOutputsParams(regex=r), 30) for r in REGEXES]
    prompts += ["Is the sky green? Answer:"]
    params += [greedy(StructuredOutputsParams(choice=CHOICES), 10)]
    prompts += ["A JSON object about a cat:", "Say hello."]
    params += [
        greedy(StructuredOutputsParams(json_object=True), 80),
        SamplingParams(temperature=0.0, max_tokens=12),
    ]
    return prompts, params


def assert_pool_whole(llm: LLM) -> None:
    # Under async scheduling a request that stopped on EOS leaves one launched step whose
    # tokens are dropped; the next step applies it.
    for _ in range(2):
        if llm.engine.has_unfinished_requests():
            llm.engine.step()
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.is_whole
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.scheduler.held


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = LLM("default", **BASE)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def baseline(llm: LLM) -> list[list[int]]:
    prompts, params = workload()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_pool_whole(llm)
    return [o.outputs[0].token_ids for o in outs]


def check_workload_outputs(texts: list[str], finish: list[str | None]) -> None:
    for i, schema in enumerate(SCHEMAS):
        assert finish[i] == "stop", (i, texts[i])
        jsonschema.validate(json.loads(texts[i]), schema)
    for j, regex in enumerate(REGEXES):
        k = len(SCHEMAS) + j
        assert finish[k] == "stop" and re.fullmatch(regex, texts[k]), (regex, texts[k])
    k = len(SCHEMAS) + len(REGEXES)
    assert texts[k] in CHOICES and finish[k] == "stop"
    assert finish[k + 1] == "stop" and isinstance(json.loads(texts[k + 1]), dict)


def test_every_output_follows_its_spec(llm: LLM, baseline: list[list[int]]) -> None:
    prompts, params = workload()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == baseline
    check_workload_outputs(
        [o.outputs[0].text for o in outs], [o.outputs[0].finish_reason for o in outs]
    )
    assert_pool_whole(llm)


def test_seeded_samples_are_each_valid_and_reproducible(llm: LLM) -> None:
    schema = SCHEMAS[0]
    params = SamplingParams(
        n=4,
        temperature=1.0,
        top_p=0.95,
        seed=11,
        max_tokens=120,
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    first = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert len(first.outputs) == 4
    for c in first.outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)
    again = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1, "the samples should differ"
    assert_pool_whole(llm)


@pytest.mark.parametrize(
    "engine_args",
    [
        # Chunks of at most 8 tokens, and a pool of 104 slots (the least that holds one
        # request of max_model_len 100) for 8 running of the 11 requests, 243 tokens in all
        # (the longest 40): both forced in one run (6 preemptions when written).
        pytest.param(
            dict(max_num_batched_tokens=8, block_size=4, num_gpu_blocks=26, max_model_len=100),
            id="chunked-prefill-and-preemption",
        ),
        pytest.param(dict(async_scheduling="on", max_num_batched_tokens=16), id="async"),
    ],
)
def test_greedy_outputs_do_not_depend_on_the_schedule(
    baseline: list[list[int]], engine_args: dict[str, Any]
) -> None:
    llm = LLM("default", **{**BASE, **engine_args})
    try:
        prompts, params = workload()
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == baseline
        if "num_gpu_blocks" in engine_args:
            # Some prompts are longer than one chunk.
            assert max(len(llm.tokenizer(p).input_ids) for p in prompts) > 8
            assert llm.engine.stats().num_preemptions > 0, "the small pool was meant to preempt"
        if engine_args.get("async_scheduling") == "on":
            assert llm.engine.async_scheduling
        assert_pool_whole(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputsParams(json={"type": "objekt"}), "structured_outputs.json: invalid"),
        (StructuredOutputsParams(regex="[a-"), "structured_outputs.regex: invalid"),
        (StructuredOutputsParams(grammar='root ::= "a" rest'), "structured_outputs.grammar"),
        (
            StructuredOutputsParams(json={"type": "array", "uniqueItems": True}),
            "unsupported JSON schema feature 'uniqueItems'",
        ),
    ],
)
def test_a_bad_spec_fails_the_call_and_the_engine_keeps_serving(
    llm: LLM, spec: StructuredOutputsParams, message: str
) -> None:
    good = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(SamplingParamsError, match=re.escape(message)):
        llm.generate(["Hello", "Hi there"], [good, greedy(spec)], use_tqdm=False)
    assert_pool_whole(llm)
    out = llm.generate(["Hello"], good, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert_pool_whole(llm)


def test_a_spec_past_the_compile_limit_fails_and_others_run() -> None:
    llm = LLM("default", **{**BASE, "compile_timeout_s": 0.05})
    try:
        slow = greedy(StructuredOutputsParams(json=deep_schema(6)))
        with pytest.raises(SamplingParamsError, match=r"did not compile within 0\.05 s"):
            llm.generate(["Hello"], slow, use_tqdm=False)
        assert_pool_whole(llm)
        out = llm.generate(["Hello"], greedy(StructuredOutputsParams(choice=["a", "b"])), False)[0]
        assert out.outputs[0].text in ("a", "b")
        assert_pool_whole(llm)
    finally:
        llm.shutdown()


def test_a_request_waiting_for_its_grammar_does_not_hold_up_the_step(llm: LLM) -> None:
    engine = llm.engine
    tok = llm.tokenizer
    slow = greedy(StructuredOutputsParams(json=deep_schema(7)), 4)  # compiles for seconds
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    ids = list(tok("Hello there").input_ids)
    engine.add_request(EngineCoreRequest("slow", ids, slow, eos_token_id=tok.eos_token_id))
    engine.add_request(EngineCoreRequest("plain", ids, plain, eos_token_id=tok.eos_token_id))
    grammar = engine.scheduler.requests["slow"].grammar
    assert grammar is not None
    plain_done_while_compiling = False
    finished: set[str] = set()
    deadline = time.monotonic() + 300
    while len(finished) < 2:
        assert time.monotonic() < deadline
        compiling = "slow" in engine.scheduler.requests and (
            grammar.poll() == GrammarStatus.COMPILING
        )
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
                if out.request_id == "plain" and compiling:
                    plain_done_while_compiling = True
    assert plain_done_while_compiling
    assert_pool_whole(llm)
