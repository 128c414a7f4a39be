"""Sliding-window attention on CUDA: the Triton prefill and decode kernels at Gemma-3-4B's
attention shape (8 query heads, 4 KV heads, head 256, block 16) with a 4096-token window over
8k contexts, in bf16 and fp16, against the torch reference; the blocks left of each window are
replaced by a null block full of NaN (a kernel that read one would answer NaN). Then the tiny
Gemma 3 greedy through the whole engine on CUDA equals transformers, and the Gemma-3-4B shape
(random weights) serves 6k-token prompts.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from tandem import LLM, SamplingParams  # noqa: E402
from tandem_kernels.paged_attention import (  # noqa: E402
    paged_attention_ref,
    paged_decode_attention,
    paged_prefill_attention,
)
from tests.parity.test_engine_parity import assert_matches, hf_greedy, make_prompts  # noqa: E402

DEV = torch.device("cuda")
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 4, 256, 16
WINDOW = 4096
SCALE = 256**-0.5
DTYPES = [torch.bfloat16, torch.float16]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return (
        {"atol": 1.5e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 3e-3, "rtol": 5e-3}
    )


def _scene(
    seq_lens: list[int], query_lens: list[int], dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cache, block table, the same table with the blocks wholly left of each request's first
    query's window pointing at block 0, seq_lens). Block 0 is no request's; it holds NaN."""
    gen = torch.Generator().manual_seed(seed)
    per_req = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(per_req) + 1
    cache = torch.randn(
        num_blocks, 2, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype, device=DEV
    )[:, 1]
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    table = torch.zeros(len(seq_lens), max(per_req), dtype=torch.int32)
    used = 0
    for r, n in enumerate(per_req):
        table[r, :n] = perm[used : used + n]
        used += n
    nulled = table.clone()
    for r, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        nulled[r, : max(s - q - WINDOW + 1, 0) // BLOCK_SIZE] = 0
    cache[0] = float("nan")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    return cache, table.to(DEV), nulled.to(DEV), lens


@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_prefill_8k(dtype: torch.dtype) -> None:
    # A fresh 8k prompt, a 2k chunk over 6k of cached context, a decode row in the batch.
    seq_lens, query_lens = [8192, 8192, 7000], [8192, 2048, 1]
    cache, table, nulled, lens = _scene(seq_lens, query_lens, dtype, seed=1)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEV)
    query = torch.randn(starts[-1], NUM_HEADS, HEAD_SIZE, dtype=dtype, device=DEV)
    out = paged_prefill_attention(query, cache, qsl, lens, nulled, SCALE, sliding_window=WINDOW)
    assert torch.isfinite(out).all()
    for r in range(len(seq_lens)):  # one request at a time keeps the reference's memory low
        rows = slice(starts[r], starts[r + 1])
        one = torch.tensor([0, query_lens[r]], dtype=torch.int32, device=DEV)
        ref = paged_attention_ref(
            query[rows], cache, one, lens[r : r + 1], table[r : r + 1], SCALE,
            sliding_window=WINDOW,
        )  # fmt: skip
        torch.testing.assert_close(out[rows], ref, **_tol(dtype))


@pytest.mark.parametrize("num_splits", [None, 1, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_decode_8k(dtype: torch.dtype, num_splits: int | None) -> None:
    seq_lens = [8192, 8000, 4096, 4097, 3000, 130, 1, 6001]
    cache, table, nulled, lens = _scene(seq_lens, [1] * len(seq_lens), dtype, seed=2)
    query = torch.randn(len(seq_lens), NUM_HEADS, HEAD_SIZE, dtype=dtype, device=DEV)
    out = paged_decode_attention(
        query, cache, lens, nulled, SCALE, max_seq_len=8192, num_splits=num_splits,
        sliding_window=WINDOW,
    )  # fmt: skip
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEV)
    ref = paged_attention_ref(query, cache, qsl, lens, table, SCALE, sliding_window=WINDOW)
    torch.testing.assert_close(out, ref, **_tol(dtype))


def test_gemma3_tiny_greedy_matches_hf_on_cuda(tiny_model_path) -> None:
    """The whole engine (Triton attention with an 8-token window on layer 0, CUDA graphs) on
    prompts far longer than the window."""
    path = tiny_model_path("gemma3")
    prompts = make_prompts(512, seed=3)[:8]
    reference = hf_greedy(path, prompts, 16)
    llm = LLM(model=str(path), dtype="float32", device="cuda", gpu_memory_utilization=0.3)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.kv_cache_manager.block_pool.is_whole
    llm.shutdown()
    assert_matches(outs, reference)


def test_gemma3_4b_shape_serves_long_prompts() -> None:
    with LLM(
        model="random:gemma-3-4b",
        dtype="bfloat16",
        device="cuda",
        max_model_len=8192,
        gpu_memory_utilization=0.5,
        max_num_seqs=8,
    ) as llm:
        model = llm.engine.executor.model_runner.model  # type: ignore[attr-defined]
        windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
        assert windows.count(None) == 5 and windows.count(1024) == 29
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        gen = torch.Generator().manual_seed(5)
        prompts = [torch.randint(10, 262208, (6000,), generator=gen).tolist() for _ in range(2)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
        assert llm.engine.scheduler.kv_cache_manager.block_pool.is_whole
    torch.cuda.empty_cache()
