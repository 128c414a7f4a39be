"""Programmatic dependent launch (tandem_kernels.pdl, `--enable-pdl`) on Hopper: the decode
chain's kernels launched with PDL inside a CUDA graph give the same bits as launched plainly,
replay after replay with new inputs (a kernel that read its input before the wait would race
with the kernel before it and differ), and the FP8 engine's greedy tokens are the same with
PDL on and off.

    pytest -q -m gpu tests/gpu/test_pdl_gpu.py
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem_kernels import fp8, pdl
from tandem_kernels import fp8_w8a16 as w8a16
from tandem_kernels.paged_attention import FP8_KV_DTYPE, paged_decode_attention
from tandem_kernels.reshape_and_cache import reshape_and_cache
from tandem_kernels.rms_norm import fused_add_rms_norm
from tandem_kernels.rotary import rotary_embedding

pytestmark = pytest.mark.gpu

HIDDEN, HEADS, KV_HEADS, HEAD, INTER = 4096, 32, 8, 128, 14336
BLOCK, NUM_BLOCKS, LAYERS = 16, 64, 4


@pytest.fixture(autouse=True)
def _needs_hopper() -> Iterator[None]:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs a GPU of compute capability >= 9.0")
    yield
    pdl.enable_pdl(False)


def _chain(seed: int) -> tuple[Callable[[dict[str, torch.Tensor]], torch.Tensor], dict]:
    """`LAYERS` decode layers of the 8B shape at batch 1 (FP8 weights through the W8A16
    GEMV with split-K, an FP8 KV cache), as the decode graph runs them; returns the step and
    its state (weights, the cache)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        wq, scale = fp8.quantize_per_row(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
        return wq, scale, w8a16.w8a16_locks(n, "cuda")

    qkv_n = (HEADS + 2 * KV_HEADS) * HEAD
    state = {
        "norm": torch.rand(HIDDEN, device="cuda", generator=gen).to(torch.bfloat16) + 0.5,
        "qkv": weight(qkv_n, HIDDEN),
        "o": weight(HIDDEN, HIDDEN),
        "gate_up": weight(2 * INTER, HIDDEN),
        "down": weight(HIDDEN, INTER),
        "cos": torch.rand(4096, HEAD // 2, device="cuda", generator=gen),
        "sin": torch.rand(4096, HEAD // 2, device="cuda", generator=gen),
    }
    gemv = {  # split-K GEMV configs, as the tuner picks them at batch 1
        "qkv": w8a16.Config(1, 16, 512, 4, 4, 1),
        "o": w8a16.Config(1, 16, 256, 8, 4, 1),
        "gate_up": w8a16.Config(1, 32, 512, 1, 8, 1),
        "down": w8a16.Config(1, 16, 512, 4, 4, 1),
    }

    def linear(name: str, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        wq, scale, locks = state[name]
        return w8a16.w8a16_gemm(x, wq, scale, gemv[name], locks, gated=gated)

    def step(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        x, residual = inputs["x"], inputs["residual"]
        for layer in range(LAYERS):
            h, residual = fused_add_rms_norm(x, residual, state["norm"], 1e-5)
            qkv = linear("qkv", h).view(1, HEADS + 2 * KV_HEADS, HEAD)
            q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
            rotary_embedding(inputs["positions"], q, k, state["cos"], state["sin"])
            cache = inputs["caches"][layer]
            reshape_and_cache(k, v, cache, inputs["slots"], 0.05, 0.02)
            attn = paged_decode_attention(
                q, cache, inputs["seq_lens"], inputs["block_table"], HEAD**-0.5,
                max_seq_len=NUM_BLOCKS * BLOCK, num_splits=4, k_scale=0.05, v_scale=0.02,
            )  # fmt: skip
            h, residual = fused_add_rms_norm(
                linear("o", attn.view(1, HIDDEN)), residual, state["norm"], 1e-5
            )
            x = linear("down", linear("gate_up", h), gated=True)
        return torch.cat([x, residual], dim=1)

    return step, state


def _inputs(pos: int, caches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(1000 + pos)
    return {
        "x": torch.randn(1, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16),
        "residual": torch.randn(1, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16),
        "positions": torch.tensor([pos], device="cuda"),
        "slots": torch.tensor([pos], device="cuda"),
        "seq_lens": torch.tensor([pos + 1], dtype=torch.int32, device="cuda"),
        "block_table": torch.arange(NUM_BLOCKS, dtype=torch.int32, device="cuda")[None],
        "caches": caches,
    }


def _caches() -> list[torch.Tensor]:
    shape = (NUM_BLOCKS, 2, BLOCK, KV_HEADS, HEAD)
    return [torch.zeros(shape, device="cuda").to(FP8_KV_DTYPE) for _ in range(LAYERS)]


def _copy_into(static: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    for name, value in new.items():
        if name != "caches":
            static[name].copy_(value)


def test_pdl_chain_in_a_graph_matches_plain_launches_bit_for_bit() -> None:
    step, _ = _chain(seed=3)
    plain_caches, graph_caches = _caches(), _caches()
    # Warm (compile both variants) on throwaway caches, then capture with PDL on.
    for use_pdl in (False, True):
        pdl.enable_pdl(use_pdl)
        step(_inputs(0, _caches()))
    assert pdl.pdl_launch(torch.device("cuda"))
    static = _inputs(0, graph_caches)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static)
    for layer_cache in graph_caches:  # capture wrote nothing; start both from zeros
        layer_cache.zero_()
    for pos in range(0, 200, 7):
        _copy_into(static, _inputs(pos, graph_caches))
        graph.replay()
        pdl.enable_pdl(False)
        plain = step(_inputs(pos, plain_caches))
        pdl.enable_pdl(True)
        torch.cuda.synchronize()
        assert torch.equal(static_out, plain), pos
        for got, want in zip(graph_caches, plain_caches, strict=True):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), pos


def test_fp8_engine_greedy_tokens_same_with_pdl_on_and_off() -> None:
    """random:llama-3.2-1b with FP8 weights and KV cache, CUDA graphs on, batch 1 and 8: the
    second engine (PDL on) reuses the first's tuned kernel configs (kept per process), so the
    two run the same kernels and differ only in how they launch."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [
        {"prompt_token_ids": [100 + 37 * i + j for j in range(40 + 9 * i)]} for i in range(8)
    ]
    results = []
    for enable_pdl in (False, True):
        with LLM(
            model="random:llama-3.2-1b", dtype="bfloat16", device="cuda", max_model_len=512,
            gpu_memory_utilization=0.4, quantization="fp8", kv_cache_dtype="fp8",
            enable_pdl=enable_pdl,
        ) as llm:  # fmt: skip
            one = llm.generate(prompts[:1], params, use_tqdm=False)
            many = llm.generate(prompts, params, use_tqdm=False)
            assert llm.engine.scheduler.kv_cache_manager.block_pool.is_whole
        assert pdl.pdl_requested() == enable_pdl
        results.append(
            [o.outputs[0].token_ids for o in one] + [o.outputs[0].token_ids for o in many]
        )
    assert results[0] == results[1]
