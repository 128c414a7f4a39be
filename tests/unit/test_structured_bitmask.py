"""Structured outputs below the engine: the bitmask against a reference, the manager's
compiles (cache, errors, time limit), matchers that follow, roll back and rebuild from token
ids, and a logits width wider than the tokenizer's vocabulary."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.config import StructuredOutputsConfig
from tandem.core.structured import GrammarStatus
from tandem.layers.sampler_bitmask import apply_token_bitmask, unpack_bitmask
from tandem.request import Request
from tandem.sampling_params import SamplingParams, StructuredOutputsParams
from tandem.structured_output import StructuredOutputManager, spec_key
from tandem.structured_output.manager import unsupported_schema_feature
from tests.conftest import deep_schema

xgr = pytest.importorskip("xgrammar")

EOS = 2


def pack(allowed: list[list[bool]]) -> torch.Tensor:
    """The reference packing: bit j of word w <-> token 32 w + j."""
    words = -(-len(allowed[0]) // 32)
    out = torch.zeros((len(allowed), words), dtype=torch.int64)
    for r, row in enumerate(allowed):
        for t, ok in enumerate(row):
            if ok:
                out[r, t // 32] |= 1 << (t % 32)
    out = torch.where(out >= 1 << 31, out - (1 << 32), out)  # as int32 words
    return out.to(torch.int32)


# ---- the bitmask ------------------------------------------------------------------------


def test_unpack_matches_the_reference_on_crafted_rows() -> None:
    vocab = 70  # not a multiple of 32: the last word is partly padding
    rows = [
        [True] * vocab,
        [False] * vocab,
        [t % 3 == 0 for t in range(vocab)],
        [t in (0, 31, 32, 63, 69) for t in range(vocab)],  # word edges, sign bit
    ]
    bitmask = pack([r + [False] * (96 - vocab) for r in rows])
    assert unpack_bitmask(bitmask, vocab).tolist() == rows


def test_apply_masks_only_the_given_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 40)
    allowed = [[t in (1, 33, 39) for t in range(64)], [t == 31 for t in range(64)]]
    bitmask = pack(allowed)
    before = logits.clone()
    out = apply_token_bitmask(logits, bitmask, torch.tensor([2, 0]))
    assert torch.equal(out[1], logits[1]) and torch.equal(out[3], logits[3])
    for row, mask in ((2, allowed[0]), (0, allowed[1])):
        for t in range(40):
            if mask[t]:
                assert out[row, t] == logits[row, t]
            else:
                assert out[row, t] == float("-inf")
    assert out[2].argmax().item() in (1, 33, 39) and out[0].argmax().item() == 31
    assert torch.equal(logits, before)  # the input is untouched
    full = apply_token_bitmask(logits[[2, 0]], bitmask)
    assert torch.equal(full[0], out[2]) and torch.equal(full[1], out[0])


def test_a_bitmask_narrower_than_the_logits_is_refused() -> None:
    with pytest.raises(ValueError, match="covers 32 tokens"):
        unpack_bitmask(torch.zeros((1, 1), dtype=torch.int32), 33)


# ---- the manager ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def manager(smollm2_path: Path, smollm2_tokenizer: Any) -> StructuredOutputManager:
    # A logits width past the tokenizer's 49,152 ids: the extra ids are never allowed.
    mgr = StructuredOutputManager(
        StructuredOutputsConfig(compile_timeout_s=0),  # no limit: the machine may be loaded
        lambda: smollm2_tokenizer,
        vocab_size=49152 + 100,
        max_num_seqs=8,
        stop_token_ids=[EOS],
    )
    yield mgr
    mgr.shutdown()


def make_request(
    mgr: StructuredOutputManager, spec: StructuredOutputsParams, rid: str = "r"
) -> Request:
    params = SamplingParams(temperature=0.0, structured_outputs=spec)
    request = Request(rid, [1, 2, 3], params, eos_token_id=EOS)
    request.grammar = mgr.grammar_for(request)
    return request


def ready(request: Request, timeout_s: float = 600.0) -> GrammarStatus:
    assert request.grammar is not None
    deadline = time.monotonic() + timeout_s
    while (status := request.grammar.poll()) == GrammarStatus.COMPILING:
        assert time.monotonic() < deadline, "the grammar did not compile"
        time.sleep(0.01)
    return status


def allowed_ids(mgr: StructuredOutputManager, request: Request) -> list[int]:
    mask = mgr.fill_bitmask([request.request_id], {request.request_id: request}).bitmask
    return torch.nonzero(unpack_bitmask(mask, mgr.vocab_size)[0]).flatten().tolist()


def follow(mgr: StructuredOutputManager, request: Request, tokenizer: Any, text: str) -> list[int]:
    """Append `text`'s tokens one by one, checking each is allowed by the mask first."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    for t in ids:
        assert t in allowed_ids(mgr, request), (t, tokenizer.decode([t]))
        request.append_output_token_ids([t])
        assert request.grammar is not None and request.grammar.sync()
    return ids


def test_choice_masks_follow_the_tokens_and_end_with_eos(
    manager: StructuredOutputManager, smollm2_tokenizer: Any
) -> None:
    req = make_request(manager, StructuredOutputsParams(choice=["yes", "no"]))
    assert ready(req) == GrammarStatus.READY
    first = allowed_ids(manager, req)
    assert set(first) >= {
        smollm2_tokenizer.encode(w, add_special_tokens=False)[0] for w in ["yes", "no"]
    }
    assert all(t < 49152 for t in first) and EOS not in first
    follow(manager, req, smollm2_tokenizer, "yes")
    assert allowed_ids(manager, req) == [EOS]
    req.append_output_token_ids([EOS])
    assert req.grammar is not None and req.grammar.sync() and req.grammar.is_terminated()


def test_regex_matcher_rolls_back_and_rebuilds_from_token_ids(
    manager: StructuredOutputManager, smollm2_tokenizer: Any
) -> None:
    req = make_request(manager, StructuredOutputsParams(regex=r"[a-c]{2}-[0-9]{3}"))
    assert ready(req) == GrammarStatus.READY
    ids = follow(manager, req, smollm2_tokenizer, "ab-1")
    at_end = allowed_ids(manager, req)
    # Roll back: the tokens are dropped from the request, the matcher follows.
    dropped = req.output_token_ids[-1]
    del req.output_token_ids[-1], req.all_token_ids[-1]
    assert req.grammar is not None and req.grammar.sync()
    assert dropped in allowed_ids(manager, req)
    req.append_output_token_ids([dropped])
    req.grammar.sync()
    assert allowed_ids(manager, req) == at_end
    # Rebuilt from scratch (preemption): the same mask from the same token ids.
    req.grammar.reset()
    assert req.grammar.poll() == GrammarStatus.READY
    assert allowed_ids(manager, req) == at_end
    assert req.output_token_ids == ids
    # A token off the grammar is rejected.
    letter = smollm2_tokenizer.encode("z", add_special_tokens=False)[0]
    req.append_output_token_ids([letter])
    assert not req.grammar.sync()


def test_json_schema_compiles_once_per_spec(manager: StructuredOutputManager) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    a = manager.submit(StructuredOutputsParams(json=schema))
    b = manager.submit(StructuredOutputsParams(json=json.dumps(schema, indent=2)))
    assert a is b
    assert spec_key(StructuredOutputsParams(json=schema))[0] == "json"
    c = manager.submit(StructuredOutputsParams(json_object=True))
    assert c is not a


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        (
            StructuredOutputsParams(regex="(abc"),
            r"structured_outputs\.regex: invalid .*parenthesis",
        ),
        (StructuredOutputsParams(grammar="root ::= foo"), r"structured_outputs\.grammar: .*foo"),
        (StructuredOutputsParams(json="{not json"), r"structured_outputs\.json: .*not valid JSON"),
        (
            StructuredOutputsParams(json={"type": "strin"}),
            r"structured_outputs\.json: invalid JSON schema: .*strin",
        ),
        (
            StructuredOutputsParams(
                json={"type": "object", "properties": {"n": {"type": "integer", "not": {}}}}
            ),
            r"unsupported JSON schema feature 'not' at /properties/n",
        ),
        (
            StructuredOutputsParams(json={"$ref": "http://example.com/s.json"}),
            r"unsupported JSON schema feature a \$ref outside the schema",
        ),
    ],
)
def test_bad_specs_fail_naming_the_problem(
    manager: StructuredOutputManager, spec: StructuredOutputsParams, pattern: str
) -> None:
    req = make_request(manager, spec)
    assert ready(req) == GrammarStatus.FAILED
    assert req.grammar is not None and req.grammar.error is not None
    assert re.search(pattern, req.grammar.error), req.grammar.error


def test_unsupported_features_are_found_where_they_are() -> None:
    assert unsupported_schema_feature({"type": "object", "properties": {"not": {}}}) is None
    assert unsupported_schema_feature({"items": {"uniqueItems": True}}) == "'uniqueItems' at /items"
    assert unsupported_schema_feature({"anyOf": [{}, {"multipleOf": 2}]}) == (
        "'multipleOf' at /anyOf/1"
    )
    assert unsupported_schema_feature({"$defs": {"x": {}}, "$ref": "#/$defs/x"}) is None


def test_a_compile_past_the_time_limit_fails_and_so_does_its_spec_later(
    smollm2_tokenizer: Any,
) -> None:
    mgr = StructuredOutputManager(
        StructuredOutputsConfig(compile_timeout_s=0.05),
        lambda: smollm2_tokenizer,
        vocab_size=49152,
        max_num_seqs=4,
    )
    try:
        spec = StructuredOutputsParams(json=deep_schema(6))
        req = make_request(mgr, spec)
        t0 = time.monotonic()
        assert ready(req) == GrammarStatus.FAILED
        assert time.monotonic() - t0 < 30
        assert req.grammar is not None and req.grammar.error is not None
        assert "did not compile within 0.05 s" in req.grammar.error
        again = make_request(mgr, spec, "again")
        assert again.grammar is not None
        assert again.grammar.poll() == GrammarStatus.FAILED  # at once
    finally:
        mgr.shutdown()
