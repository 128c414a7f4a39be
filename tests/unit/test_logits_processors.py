"""Logits processors (issue 29): logit_bias, allowed_token_ids, bad_words and custom batch-level
processors, through the sampler and through `LLM` on a tiny random model.

- the row bookkeeping (`BatchUpdateBuilder`) keeps a processor's per-row state exact over
  random joins, leaves and reorders;
- the built-in rules equal a per-row loop reference on random logits;
- through `LLM`: +100 forces its token and -100 bans it (greedy and sampled), the sampled
  tokens stay in allowed_token_ids under penalties and top-k/p/min-p, a two-token bad word
  never appears as a sequence (sync and async scheduling), a custom processor loaded by
  `module:Class` (and as a class) forces the rows that ask while the others are untouched,
  processors compose with structured outputs, and bad input is a clear error (ConfigError
  for a processor that does not load, InvalidRequestError for a token id outside the
  vocabulary or a bad `extra_args`) after which the engine keeps serving.

The block pool is whole after every engine test.
"""

from __future__ import annotations

import itertools
import json
import pickle
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.config import ConfigError
from tandem.engine.core import InvalidRequestError
from tandem.engine.llm import LLM
from tandem.layers.logits_processors import (
    BatchUpdateBuilder,
    LogitsProcessors,
    MoveDirectionality,
    apply_logits_rules,
)
from tandem.sampling_params import (
    MAX_EXTRA_ARGS_DEPTH,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)
from tests.logits_procs import ForceTokenProcessor

PROCESSOR = "tests.logits_procs:ForceTokenProcessor"
ENGINE_ARGS: dict[str, Any] = dict(
    device="cpu", dtype="float32", max_num_seqs=8, max_model_len=256, num_gpu_blocks=64
)
PROMPTS = [[1, 50, 60, 70], [1, 80, 81], [1, 90, 91, 92, 93], [1, 100]]


@dataclass
class Row:
    """A stand-in for the runner's request state."""

    req_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)


# ----------------------------------------------------------------------------- no model


def test_batch_updates_keep_per_row_state_exact() -> None:
    """A processor keeping one value per row index, updated only through the BatchUpdates,
    always holds exactly the step's rows' values, over random joins, leaves and reorders."""
    rng = random.Random(0)
    pool = [Row(f"r{i}", SamplingParams(extra_args={"v": i})) for i in range(12)]
    builder = BatchUpdateBuilder()
    state: dict[int, int] = {}
    num_moves = 0
    for _ in range(300):
        rows = rng.sample(pool, rng.randint(0, 8))
        update = builder.update(rows)
        if update is None:
            continue
        assert update.batch_size == len(rows)
        for i in update.removed:
            state.pop(i, None)
        for i, params, _, _ in update.added:
            state[i] = params.extra_args["v"]
        for a, b, how in update.moved:
            num_moves += 1
            va, vb = state.pop(a, None), state.pop(b, None)
            assert va is not None
            state[b] = va
            if how is MoveDirectionality.SWAP:
                assert vb is not None
                state[a] = vb
            else:
                assert vb is None
        assert state == {i: r.sampling_params.extra_args["v"] for i, r in enumerate(rows)}
    assert num_moves > 0
    same = [pool[0], pool[1]]
    builder.update(same)
    assert builder.update(list(same)) is None
    # A state object replaced (a resumed request) is removed and added again.
    again = Row("r0", pool[0].sampling_params)
    update = builder.update([again, pool[1]])
    assert update is not None and update.removed == [0] and [a[0] for a in update.added] == [0]


def reference_rules(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """A per-row, per-token loop: allowed_token_ids, then bad words, then logit_bias."""
    out = logits.clone()
    for i, r in enumerate(rows):
        p = r.sampling_params
        if p.allowed_token_ids:
            for t in range(out.shape[1]):
                if t not in p.allowed_token_ids:
                    out[i, t] = float("-inf")
        for seq in p.bad_words_token_ids or ():
            prefix = seq[:-1]
            if not prefix or r.output_token_ids[-len(prefix) :] == prefix:
                out[i, seq[-1]] = float("-inf")
        for t, b in (p.logit_bias or {}).items():
            out[i, t] += b
    return out


def test_built_in_rules_match_a_loop_reference() -> None:
    vocab = 40
    rows = [
        Row("plain", SamplingParams()),
        Row("bias", SamplingParams(logit_bias={3: 100.0, 7: -100.0, 9: 0.5})),
        Row("allowed", SamplingParams(allowed_token_ids=[1, 5, 6], logit_bias={5: 2.0})),
        # Bad words: one token (4), and two that end the output (8 after 2, 3) or do not.
        Row(
            "bad",
            SamplingParams(bad_words_token_ids=[[4], [2, 3, 8], [2, 9, 10], [3, 11]]),
            output_token_ids=[5, 2, 3],
        ),
        Row("all", SamplingParams(allowed_token_ids=[1, 2, 4], bad_words_token_ids=[[4]])),
    ]
    procs = LogitsProcessors((), None, torch.device("cpu"), vocab)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):  # the second step reuses each request's rules
        logits = torch.randn(len(rows), vocab, generator=gen)
        before = logits.clone()
        inputs = procs.prepare(rows)
        assert inputs.rules is not None and inputs.processors == ()
        out = apply_logits_rules(logits, inputs.rules)
        assert torch.equal(logits, before), "the input logits must not be written"
        assert torch.equal(out, reference_rules(logits, rows))
    assert out[3, 8] == float("-inf") and out[3, 11] == float("-inf")
    assert out[3, 10] != float("-inf")
    assert procs.prepare([rows[0]]).rules is None


def _nested(levels: int) -> dict[str, Any]:
    """A map `levels` levels deep: maps and lists alternating, the map outermost."""
    value: Any = 1
    for level in range(levels - 1):
        value = [value] if level % 2 == 0 else {"k": value}
    return {"k": value}


def test_sampling_params_checks_name_the_field() -> None:
    bad: list[tuple[dict[str, Any], str]] = [
        ({"logit_bias": {5: 100.5}}, "logit_bias[5] must be in [-100, 100]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias keys"),
        ({"logit_bias": {5: "x"}}, "logit_bias[5] must be a number"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"bad_words": "word"}, "bad_words must be a list"),
        ({"bad_words": ["ok", " "]}, "bad_words must not contain empty"),
        ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
        ({"extra_args": [1]}, "extra_args"),
        ({"seed": 2**63}, "seed must be in"),
        ({"seed": -(2**63) - 1}, "seed must be in"),
        ({"seed": True}, "seed must be an integer"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be in [0, "),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs must be in [0, "),
        ({"prompt_logprobs": True}, "prompt_logprobs must be in [0, "),
        ({"logprobs": 2.0}, "logprobs must be in [0, "),
        ({"extra_args": _nested(MAX_EXTRA_ARGS_DEPTH + 1)}, "extra_args nests"),
        ({"extra_args": _nested(10_000)}, "extra_args nests"),
    ]
    for kwargs, needle in bad:
        with pytest.raises(SamplingParamsError) as info:
            SamplingParams(**kwargs)
        assert needle in str(info.value), (kwargs, info.value)
    with pytest.raises(SamplingParamsError, match="allowed_token_ids: token id 40 is outside"):
        SamplingParams(allowed_token_ids=[1, 40]).check_vocab(40)
    SamplingParams(logit_bias={39: -100}, bad_words_token_ids=[[39, 0]]).check_vocab(40)
    # As deep as allowed: it pickles (the engine's process hand-off) and round-trips as JSON.
    deepest = SamplingParams(extra_args=_nested(MAX_EXTRA_ARGS_DEPTH))
    assert pickle.loads(pickle.dumps(deepest)).extra_args == deepest.extra_args
    assert json.loads(json.dumps(deepest.extra_args)) == deepest.extra_args

    class Words:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            assert not add_special_tokens
            return [ord(c) for c in text]

    p = SamplingParams(bad_words=["ab", "  c"])
    p.update_from_tokenizer(Words())
    assert p.bad_words_token_ids == [[97, 98], [32, 97, 98], [99], [32, 99]]
    assert p.needs_output_history


# ----------------------------------------------------------------------------- LLM


def assert_pool_whole(llm: LLM) -> None:
    for _ in range(2):
        if llm.engine.has_unfinished_requests():
            llm.engine.step()
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.is_whole
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def tiny(tiny_model_path: Callable[[str], Path]) -> Path:
    return tiny_model_path("llama")


@pytest.fixture(scope="module")
def llm(tiny: Path) -> Iterator[LLM]:
    engine = LLM(str(tiny), logits_processors=[PROCESSOR], **ENGINE_ARGS)
    yield engine
    engine.shutdown()


def token_ids(llm: LLM, prompts: list[list[int]], params: Any) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_pool_whole(llm)
    return [list(o.outputs[0].token_ids) for o in outs]


def byte_token(llm: LLM, char: str) -> int:
    (token,) = llm.tokenizer.encode(char, add_special_tokens=False)
    return token


def test_logit_bias_forces_and_bans(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    base = token_ids(llm, PROMPTS, greedy)
    target = 77
    assert all(target not in ids for ids in base)
    for params in (greedy, SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)):
        forced = token_ids(llm, PROMPTS, params.clone(logit_bias={target: 100}))
        assert forced == [[target] * 8] * len(PROMPTS)
        banned = {t for ids in base for t in ids}
        out = token_ids(llm, PROMPTS, params.clone(logit_bias=dict.fromkeys(banned, -100)))
        assert all(not banned & set(ids) for ids in out), out
    # A zero bias changes nothing.
    assert token_ids(llm, PROMPTS, greedy.clone(logit_bias={target: 0})) == base


def test_allowed_token_ids_hold_under_every_sampling_stage(llm: LLM) -> None:
    allowed = [5, 6, 7, 300]
    params = [
        SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=allowed),
        SamplingParams(
            temperature=1.5,
            seed=1,
            max_tokens=12,
            top_k=3,
            top_p=0.9,
            min_p=0.05,
            presence_penalty=1.0,
            repetition_penalty=1.3,
            allowed_token_ids=allowed,
        ),
        SamplingParams(temperature=1.0, seed=2, max_tokens=12, allowed_token_ids=[9]),
        SamplingParams(temperature=0, max_tokens=12),  # a free row in the same batch
    ]
    outs = token_ids(llm, PROMPTS, params)
    assert all(set(ids) <= set(allowed) for ids in outs[:2]), outs
    assert outs[2] == [9] * 12
    assert not set(outs[3]) <= set(allowed)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_a_two_token_bad_word_never_appears(llm: LLM, tiny: Path, mode: str) -> None:
    """Only x and y may be sampled (near uniformly): without the bad word "xy" an x is soon
    followed by a y; with it, never (each sequence is all y's, then all x's)."""
    engine = llm
    if mode == "on":
        # The class itself (not a string), under async scheduling.
        engine = LLM(
            str(tiny), logits_processors=[ForceTokenProcessor], async_scheduling="on", **ENGINE_ARGS
        )
    try:
        x, y = byte_token(engine, "x"), byte_token(engine, "y")
        params = SamplingParams(
            temperature=20.0, seed=7, max_tokens=40, ignore_eos=True, allowed_token_ids=[x, y]
        )
        free = token_ids(engine, PROMPTS, params)
        assert any((x, y) in itertools.pairwise(ids) for ids in free)
        outs = token_ids(engine, PROMPTS, params.clone(bad_words=["xy"]))
        for ids in outs:
            assert (x, y) not in itertools.pairwise(ids), ids
            assert len(ids) == 40
        assert any(x in ids for ids in outs) and any(y in ids for ids in outs)
        # A one-token bad word is banned everywhere.
        assert token_ids(engine, PROMPTS, params.clone(bad_words=["y"])) == [[x] * 40] * 4
        if mode == "on":
            # The custom processor, given as a class, works here too.
            forced = params.clone(allowed_token_ids=None, extra_args={"force_token_id": 42})
            assert token_ids(engine, PROMPTS[:1], forced) == [[42] * 40]
    finally:
        if engine is not llm:
            engine.shutdown()


def test_custom_processor_forces_only_the_rows_that_ask(llm: LLM) -> None:
    """Requests of different lengths join and leave the batch at different steps: the
    processor's rows follow (BatchUpdates), forced rows give their token, free rows give
    what they give alone."""
    prompts = PROMPTS * 2
    lengths = [3, 9, 5, 12, 7, 4, 10, 6]
    free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    alone = token_ids(llm, prompts, free)
    mixed = [
        p.clone(extra_args={"force_token_id": 100 + i}) if i % 2 else p for i, p in enumerate(free)
    ]
    outs = token_ids(llm, prompts, mixed)
    for i, ids in enumerate(outs):
        assert ids == ([100 + i] * lengths[i] if i % 2 else alone[i]), i
    runner = llm.engine.model_runner
    (proc,) = runner.sampler.logits_processors.custom
    assert isinstance(proc, ForceTokenProcessor) and proc.num_updates > 0


def test_processors_compose_with_structured_outputs(llm: LLM) -> None:
    pytest.importorskip("xgrammar")
    a, c, d = (byte_token(llm, ch) for ch in "acd")
    choice = StructuredOutputsParams(choice=("ab", "cd"))
    base = SamplingParams(temperature=0, max_tokens=6, structured_outputs=choice)
    prompt = [{"prompt_token_ids": p} for p in PROMPTS[:1]]

    def text(params: SamplingParams) -> str:
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
        assert_pool_whole(llm)
        return out

    assert text(base) in ("ab", "cd")
    assert text(base.clone(logit_bias={a: -100})) == "cd"
    assert text(base.clone(logit_bias={c: -100})) == "ab"
    # A bias cannot bring back what the grammar removed.
    assert text(base.clone(logit_bias={d: 100})) in ("ab", "cd")
    assert text(base.clone(bad_words=["a"])) == "cd"
    # A custom processor after the grammar: c, then c again ("cc" is a choice).
    forced = base.clone(
        structured_outputs=StructuredOutputsParams(choice=("ab", "cc")),
        extra_args={"force_token_id": c},
        max_tokens=2,
    )
    assert text(forced) == "cc"


def test_bad_input_is_a_clear_error_and_the_engine_keeps_serving(llm: LLM, tiny: Path) -> None:
    vocab = llm.engine.vocab_size
    for params, needle in [
        (SamplingParams(logit_bias={vocab: 1.0}), f"logit_bias: token id {vocab} is outside"),
        (SamplingParams(allowed_token_ids=[1, vocab + 3]), "allowed_token_ids: token id"),
        (SamplingParams(extra_args={"force_token_id": "x"}), "ForceTokenProcessor"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
        assert needle in str(info.value)
    # Prompt ids past either end of the vocabulary (a negative one failed in the detokenizer
    # with an OverflowError), and a lone surrogate in a text prompt (the tokenizer's TypeError).
    two = SamplingParams(max_tokens=2)
    for prompt in ({"prompt_token_ids": [5, -1]}, {"prompt_token_ids": [vocab]}):
        with pytest.raises(InvalidRequestError, match=r"prompt token ids must be in \[0, "):
            llm.generate([prompt], two, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="prompt holds a lone UTF-16 surrogate"):
        llm.generate(["a\ud800"], two, use_tqdm=False)
    # Chat template options that cannot render (vLLM's names), refused before the template.
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequestError, match="cannot both be true"):
        llm.chat(hi, two, use_tqdm=False, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="may not set tokenize"):
        llm.chat(hi, two, use_tqdm=False, chat_template_kwargs={"tokenize": True})
    assert token_ids(llm, PROMPTS[:1], SamplingParams(max_tokens=2))[0]
    for spec, needle in [
        ("tests.logits_procs:Missing", "has no 'Missing'"),
        ("tests.no_such_module:P", "cannot import module 'tests.no_such_module'"),
        ("tests.logits_procs:NotAProcessor", "is not a subclass"),
        ("NoColon", "expected module:Class"),
    ]:
        with pytest.raises(ConfigError) as info:
            LLM(str(tiny), logits_processors=[spec], **ENGINE_ARGS)
        assert needle in str(info.value) and "logits processor" in str(info.value)
    with pytest.raises(ConfigError, match="neither a class"):
        LLM(str(tiny), logits_processors=[3], **ENGINE_ARGS)


def test_forced_replay_pins_the_record_and_makes_p_the_acceptance(
    tiny: Path, tmp_path: Path
) -> None:
    """benchmarks/forced_replay.py: each request samples its record, at every verified row of
    a speculative step too; so a replay proposer at p = 1 is accepted in full and at p = 0 in
    nothing, and the outputs are the records."""
    import json

    from benchmarks.forced_replay import ForceRecorded, forced_params

    rng = random.Random(3)
    records = [[rng.randrange(200, 400) for _ in range(12)] for _ in PROMPTS]
    replay = tmp_path / "replay.json"
    replay.write_text(
        json.dumps(
            [
                {"prompt_token_ids": p, "output_token_ids": r}
                for p, r in zip(PROMPTS, records, strict=True)
            ]
        )
    )
    params = forced_params(SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), records)
    plain = LLM(str(tiny), logits_processors=[ForceRecorded], **ENGINE_ARGS)
    try:
        assert token_ids(plain, PROMPTS, params) == records
    finally:
        plain.shutdown()
    for p, expected in ((1.0, 1.0), (0.0, 0.0)):
        spec = {
            "method": "replay",
            "num_speculative_tokens": 3,
            "replay_path": str(replay),
            "replay_acceptance": p,
            "speculation_rule": "always",
        }
        engine = LLM(
            str(tiny),
            logits_processors=[ForceRecorded],
            speculative_config=spec,
            async_scheduling="off",
            **ENGINE_ARGS,
        )
        try:
            assert token_ids(engine, PROMPTS, params) == records
            stats = engine.engine.stats().spec_decoding
            assert stats is not None and stats.num_draft_tokens > 0
            assert stats.num_accepted_tokens / stats.num_draft_tokens == expected
        finally:
            engine.shutdown()
