"""Speculative decoding with proposers that run a model (issue 29): the draft model and EAGLE.

- Draft model: greedy output with a tiny random Llama drafting for a different tiny random
  Llama is the output without speculation, with chunked prefill, forced preemption, prefix
  hits and async scheduling asked for (the n-gram tests' cases); a model drafting for itself
  has every draft accepted (tiny Llama: exactly; SmolLM2: > 0.9); seeded sampling reproduces;
  the pool is whole after each run (`_run`).
- Bad input: a draft of another vocabulary (both sizes named), another TP, k out of range.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tandem import LLM, SamplingParams
from tandem.config import ConfigError, EngineArgs
from tests.conftest import write_tiny_model
from tests.unit.test_spec_decode import PARITY_CASES, _repetitive_prompts, _run


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama of the fixture's shape and vocabulary, other weights."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama-draft"), "llama", seed=7)


def _draft(model: Path | str, k: int = 3) -> dict[str, object]:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


_REFS: dict[str, list] = {}


def _prompts() -> list[list[int]]:
    prompts = _repetitive_prompts(512)
    prompts.append([*prompts[-1][:20], 5, 6, 7])  # a prefix hit on the last prompt's blocks
    return prompts


@pytest.mark.parametrize("case", sorted(PARITY_CASES))
def test_greedy_with_a_draft_model_is_greedy_without(
    tiny_model_path, other_llama: Path, case: str
) -> None:
    path = tiny_model_path("llama")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    if "ref" not in _REFS:
        _REFS["ref"] = _run(path, _prompts(), params)[0]
    ref = _REFS["ref"]
    extra = PARITY_CASES[case]
    got, stats = _run(path, _prompts(), params, speculative_config=_draft(other_llama), **extra)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    spec = stats.spec_decoding
    assert spec is not None and spec.num_draft_tokens > 0 and not stats.async_scheduling
    assert stats.prefix_cache_hits > 0
    if case == "preemption":
        assert stats.num_preemptions > 0
    # The same model drafting for itself: every draft is the target's own greedy token.
    if case == "chunked":
        got, stats = _run(path, _prompts(), params, speculative_config=_draft(path), **extra)
        assert [o.token_ids for o in got] == [o.token_ids for o in ref]
        spec = stats.spec_decoding
        assert spec is not None and spec.num_draft_tokens > 100
        assert spec.num_accepted_tokens == spec.num_draft_tokens


def test_seeded_sampling_with_a_draft_model_reproduces(tiny_model_path, other_llama) -> None:
    """Sampling requests verify greedy drafts (q one-hot: the rejection sampler's exact
    rule for them) and reproduce run to run with their seeds."""
    path = tiny_model_path("llama")
    prompts = _repetitive_prompts(512, 4)
    params = [
        SamplingParams(temperature=0.2, seed=i, max_tokens=24, ignore_eos=True) for i in range(4)
    ]
    a, stats = _run(path, prompts, params, speculative_config=_draft(path, 2))
    b, _ = _run(path, prompts, params, speculative_config=_draft(path, 2))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 24 for o in a)
    spec = stats.spec_decoding
    assert spec is not None and spec.num_accepted_tokens > 0


def test_smollm2_drafting_for_itself_accepts_nearly_every_draft(smollm2_path) -> None:
    text = (
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "Rewrite the code above with type hints.\n"
    )
    params = SamplingParams(temperature=0.0, max_tokens=32)
    kwargs = dict(max_num_batched_tokens=256, num_gpu_blocks=64, max_model_len=512)
    ref, _ = _run(smollm2_path, [text], params, **kwargs)
    spec = _draft(smollm2_path, 4)
    got, stats = _run(smollm2_path, [text], params, speculative_config=spec, **kwargs)
    assert got[0].token_ids == ref[0].token_ids
    s = stats.spec_decoding
    assert s is not None and s.num_draft_tokens > 0
    assert s.acceptance_rate > 0.9


def test_bad_draft_models_are_refused(tiny_model_path, smollm2_path) -> None:
    path = tiny_model_path("llama")
    with pytest.raises(ConfigError, match="vocabulary of 49152 tokens, the target's has 512"):
        EngineArgs(model=str(path), speculative_config=_draft(smollm2_path)).create_engine_config()
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineArgs(model=str(path), speculative_config=_draft(path, 17)).create_engine_config()
    other_tp = {**_draft(path), "draft_tensor_parallel_size": 2}
    with pytest.raises(ConfigError, match="draft_tensor_parallel_size 2 differs"):
        LLM(model=str(path), device="cpu", num_gpu_blocks=16, speculative_config=other_tp)
    # The flag takes the same JSON.
    args = EngineArgs(model=str(path), speculative_config=json.dumps(_draft(path)))
    assert args.create_engine_config().speculative.method == "draft_model"


def test_draft_kv_cache_shares_the_block_budget(tiny_model_path, other_llama) -> None:
    """The draft's KV is sized from the same memory budget: a block id costs the target's
    bytes plus the draft's, so the pool holds fewer blocks than without a draft."""
    path = tiny_model_path("llama")
    kwargs = dict(device="cpu", dtype="float32", kv_cache_memory_gb=0.01, max_model_len=256)
    with LLM(model=str(path), **kwargs) as llm:
        plain = llm.engine.scheduler.kv_cache_manager.num_blocks
    with LLM(model=str(path), speculative_config=_draft(other_llama), **kwargs) as llm:
        shared = llm.engine.scheduler.kv_cache_manager.num_blocks
    assert shared == pytest.approx(plain / 2, abs=1)  # same shape: half the blocks each
    assert np.isfinite(shared)
