"""The KV cache group per attention kind on the GPU: the tiny Gemma 3 through decode and whole
mixed-step CUDA graphs with per-group static tables equals transformers, and the Gemma 3 4B
shape at 8k prompts reports its block savings against one group keeping every block."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from tandem import LLM, SamplingParams  # noqa: E402
from tests.parity.test_engine_parity import assert_matches, hf_greedy, make_prompts  # noqa: E402


@pytest.mark.parametrize("cudagraph_mode", ["full", "full_decode_only"])
def test_gemma3_tiny_hybrid_cache_in_cuda_graphs(tiny_model_path, cudagraph_mode: str) -> None:
    path = tiny_model_path("gemma3")
    prompts = make_prompts(512, seed=3)[:8]
    reference = hf_greedy(path, prompts, 16)
    llm = LLM(
        model=str(path),
        dtype="float32",
        device="cuda",
        gpu_memory_utilization=0.3,
        cudagraph_mode=cudagraph_mode,
    )
    runner = llm.engine.executor.model_runner  # type: ignore[attr-defined]
    assert llm.engine.kv_cache_spec.num_groups == 2
    assert runner.cuda_graphs.graphs, "decode graphs were not captured"
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.is_whole
    if cudagraph_mode == "full":
        assert runner.mixed_graphs.num_replays > 0
    llm.shutdown()
    assert_matches(outs, reference)


def _engine_figures(**kwargs: object) -> tuple[int, float, int]:
    """(KV blocks, maximum concurrency at 8192 tokens, peak blocks in use) of the 4B shape
    generating 16 tokens after two 8000-token prompts."""
    with LLM(
        model="random:gemma-3-4b",
        dtype="bfloat16",
        device="cuda",
        max_model_len=8192,
        gpu_memory_utilization=0.5,
        max_num_seqs=8,
        **kwargs,
    ) as llm:
        sched = llm.engine.scheduler
        kv = sched.kv_cache_manager
        peak = [0]
        schedule = sched.schedule

        def observed(*args, **kwargs):  # type: ignore[no-untyped-def]
            out = schedule(*args, **kwargs)
            peak[0] = max(peak[0], kv.num_blocks - kv.num_free_blocks)
            return out

        sched.schedule = observed  # type: ignore[method-assign]
        gen = torch.Generator().manual_seed(5)
        prompts = [torch.randint(10, 262208, (8000,), generator=gen).tolist() for _ in range(2)]
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
        assert kv.block_pool.is_whole
        figures = (llm.engine.num_blocks, llm.engine.max_concurrency, peak[0])
    torch.cuda.empty_cache()
    return figures


def test_gemma3_4b_shape_8k_block_savings() -> None:
    blocks, concurrency, peak = _engine_figures()
    plain_blocks, plain_concurrency, plain_peak = _engine_figures(
        disable_hybrid_kv_cache_manager=True
    )
    # 34 layers: 5 global, 29 with a 1024 window -> 7 groups of 5 layers; a block holds 5
    # layers instead of 34. Per 8k request: 512 blocks in the full group, 65 in each of the
    # 6 sliding ones.
    print(
        f"gemma-3-4b shape, 8k prompts: hybrid {blocks} blocks of 5 layers, max concurrency "
        f"{concurrency:.2f}, peak {peak} blocks ({peak * 5} layer-blocks); every block kept: "
        f"{plain_blocks} blocks of 34 layers, max concurrency {plain_concurrency:.2f}, peak "
        f"{plain_peak} blocks ({plain_peak * 34} layer-blocks)"
    )
    # Decoding 8k requests: 902 blocks of 5 layers (4510 layer-blocks) against 512 of 34
    # (17408). The peak also counts prefill chunks, whose KV every layer writes, and so does
    # the reported concurrency (`KVCacheSpec.max_blocks_per_request` at the 2,048-token
    # budget): a sliding group holds its window and a chunk, at most cdiv(1023 + 2048, 16) + 1
    # = 193 blocks when the chunk starts mid-block, so 512 + 6 * 193 = 1,670 a request.
    assert concurrency == pytest.approx(blocks / (512 + 6 * 193))
    assert plain_concurrency == pytest.approx(plain_blocks / 512)
    assert concurrency > 2 * plain_concurrency
    assert peak * 5 < plain_peak * 34 / 2
