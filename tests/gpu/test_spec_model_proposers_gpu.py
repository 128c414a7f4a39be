"""Draft-model and EAGLE speculation on CUDA, with CUDA graphs on for the target's steps (fp32,
so batch shapes do not flip near-ties): SmolLM2 drafting for itself keeps the greedy tokens
and has nearly every draft accepted; a tiny EAGLE head drafts what its CPU reference drafts
and keeps the greedy tokens; the random 8B target with the random 1B draft and the random
EAGLE head of its shape runs (bf16), draft steps replayed as CUDA graphs, with the pool whole
after."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tests.unit.test_spec_model_proposers import check_eagle_drafts

pytestmark = pytest.mark.gpu

TEXT = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "Rewrite the code above with type hints, keeping the names.\n"
)


def test_smollm2_drafting_for_itself_with_cuda_graphs() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=64)
    kwargs = dict(device="cuda", dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3)
    prompts = [TEXT, TEXT.replace("add", "plus"), TEXT.replace("sub", "minus")] * 3
    with LLM(**kwargs) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    spec = {"method": "draft_model", "model": "default", "num_speculative_tokens": 4}
    with LLM(speculative_config=spec, **kwargs) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.stats()
        assert llm.engine.scheduler.kv_cache_manager.block_pool.is_whole
        proposer = llm.engine.executor.driver_worker.model_runner.proposer
        # The draft steps and the catch-up passes ran as CUDA graphs.
        assert proposer.graphs.decode.graphs and proposer.graphs.mixed.num_replays > 0
    assert got == ref
    s = stats.spec_decoding
    assert s is not None and s.num_draft_tokens > 0
    assert s.acceptance_rate > 0.9
    print("spec stats:", s)


def test_eagle_head_on_cuda_drafts_as_its_reference(
    tiny_model_path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_model_path("llama")
    matched = check_eagle_drafts(
        path, tmp_path, monkeypatch, device="cuda", gpu_memory_utilization=0.2
    )
    assert matched >= 0.9  # the reference runs on the CPU: a near-tie may flip a draft


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "draft_model", "model": "random:llama-3.2-1b", "num_speculative_tokens": 4},
        {"method": "eagle", "model": "random:eagle-llama-3.1-8b", "num_speculative_tokens": 4},
    ],
)
def test_random_8b_with_model_proposers_runs(spec: dict) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    kwargs = dict(
        model="random:llama-3.1-8b", device="cuda", max_model_len=2048, gpu_memory_utilization=0.5
    )
    prompts = [[100 + i + j for j in range(40)] for i in range(8)]
    with LLM(speculative_config=spec, **kwargs) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
        assert llm.engine.scheduler.kv_cache_manager.block_pool.is_whole
        proposer = llm.engine.executor.driver_worker.model_runner.proposer
        # Both proposers' draft steps replay decode graphs (8 requests: a captured size).
        assert proposer.graphs.decode.graphs and proposer.graphs.mixed.num_replays > 0
        if spec["method"] == "eagle":
            assert proposer.num_graph_draft_steps > 0 and proposer.num_eager_draft_steps == 0
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
    s = stats.spec_decoding
    assert s is not None and s.num_draft_tokens > 0
