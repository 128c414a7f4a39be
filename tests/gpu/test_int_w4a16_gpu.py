"""The integer-weight GEMM (tandem_kernels.int_w4a16) on the GPU at the 8B model's shapes, and
GPTQ kept quantized through the engine.

Every tuning candidate of every batch bucket against the dequantize-then-matmul reference
(4 bits in groups of 128 in bf16 and fp16; 8 bits in one group); split-K calls replayed in a
CUDA graph on one lock buffer (the same bits every replay, the locks back at zero); the
load-time tuner's pick serving its bucket; then a tiny random Llama stored as GPTQ run by the
engine, its linear layers kept 4-bit (uint8 weights, a third of the 16-bit bytes), against
the same weights dequantized into a plain checkpoint: the same greedy tokens and logprobs in
fp32, the same first tokens in bf16 with CUDA graphs.

    pytest -q -s -m gpu tests/gpu/test_int_w4a16_gpu.py     # -s prints the tuner's picks
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tandem_kernels import int_w4a16

pytestmark = pytest.mark.gpu

# (N, K) of the 8B model's GEMMs: qkv, o, gate_up, down.
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _weight(
    n: int, k: int, bits: int, group_size: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random `(qweight, scale [N, G] as the layer passes it: a transposed [G, N], zero)` on
    the GPU, scales in `dtype`."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    groups = 1 if group_size == -1 else k // group_size
    q = torch.randint(0, 1 << bits, (n, k), device="cuda", generator=gen)
    zero = torch.randint(0, (1 << bits) + 1, (groups, n), device="cuda", generator=gen)
    scale = 0.0005 + 0.002 * torch.rand(groups, n, device="cuda", generator=gen)
    qweight = int_w4a16.pack_int_weight(q, bits)
    return qweight, scale.to(dtype).t(), zero.to(dtype).t()


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_every_candidate_matches_the_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = [(n, k, 4, 128) for n, k in SHAPES_8B] + [(4096, 4096, 8, -1)]
    for s, (n, k, bits, group_size) in enumerate(cases):
        qweight, scale, zero = _weight(n, k, bits, group_size, dtype, s)
        locks = int_w4a16.w4a16_locks(n, "cuda")
        for b in int_w4a16.M_BUCKETS:
            for i, config in enumerate(int_w4a16.candidates(b, k, group_size)):
                m = b - (i % 2) * (b // 2)  # the full bucket, or a part of it
                x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
                out = int_w4a16.w4a16_gemm(x, qweight, scale, zero, bits, group_size, config, locks)
                ref = int_w4a16.w4a16_gemm_ref(x, qweight, scale, zero, bits, group_size)
                # Both sum fp32 products of the same values; each rounds its output once.
                assert _rel_err(out, ref) < 5e-3, (n, k, bits, m, config)
                assert not locks.any(), (n, k, m, config)


def test_split_k_replays_in_a_cuda_graph() -> None:
    n, k, bits, group_size = 4096, 14336, 4, 128
    qweight, scale, zero = _weight(n, k, bits, group_size, torch.bfloat16, 7)
    locks = int_w4a16.w4a16_locks(n, "cuda")
    cfg = int_w4a16.Config
    configs = [
        cfg(1, 32, 128, 4, 4, 1),
        cfg(4, 64, 128, 8, 4, 1),  # 112 chunks over 8 slices
        cfg(16, 32, 128, 4, 4, 3),
        cfg(16, 64, 64, 4, 4, 4),
    ]
    x = torch.zeros(4, k, device="cuda", dtype=torch.bfloat16)
    for config in configs:  # compile outside the capture
        int_w4a16.w4a16_gemm(x[:1], qweight, scale, zero, bits, group_size, config, locks)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [
            int_w4a16.w4a16_gemm(
                x[: min(c.block_m, 3)], qweight, scale, zero, bits, group_size, c, locks
            )
            for c in configs
        ]
    gen = torch.Generator(device="cuda").manual_seed(8)
    for _ in range(20):
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        assert not locks.any()
        for c, out in zip(configs, outs, strict=True):
            rows = out.shape[0]
            eager = int_w4a16.w4a16_gemm(x[:rows], qweight, scale, zero, bits, group_size, c, locks)
            assert torch.equal(out, eager), c  # the slices summed in one order
            ref = int_w4a16.w4a16_gemm_ref(x[:rows], qweight, scale, zero, bits, group_size)
            assert _rel_err(out, ref) < 5e-3, c


def test_the_tuners_pick_serves_its_bucket() -> None:
    n, k, bits, group_size = 6144, 4096, 4, 128
    qweight, scale, zero = _weight(n, k, bits, group_size, torch.bfloat16, 3)
    choices = int_w4a16.tune_w4a16(qweight, scale, zero, bits, group_size, torch.bfloat16)
    assert set(choices) == set(int_w4a16.M_BUCKETS)
    record = int_w4a16.tuning_log[-1]
    print("tuned", n, k, f"in {record['tune_s']:.1f} s")
    locks = int_w4a16.w4a16_locks(n, "cuda")
    for b in int_w4a16.M_BUCKETS:
        entry = record["us"][str(b)]  # type: ignore[index]
        print(b, entry["best"], entry[entry["best"]])
        assert entry["best"] == choices[b].name and entry[entry["best"]] is not None
        for m in {b, max(1, b // 2 + 1)}:
            assert int_w4a16.choose(m, n, k, bits, group_size, torch.bfloat16) == choices[b]
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            out = int_w4a16.w4a16_gemm(x, qweight, scale, zero, bits, group_size, locks=locks)
            ref = int_w4a16.w4a16_gemm_ref(x, qweight, scale, zero, bits, group_size)
            assert _rel_err(out, ref) < 5e-3, (m, choices[b])


def _generate(folder: Path, dtype: str) -> tuple[list[Any], int]:
    """Greedy completions (5 logprobs a step) of 8 random prompts on CUDA, and the bytes of
    the model's linear layers' parameters."""
    from tandem import LLM, SamplingParams
    from tandem.layers.linear import LinearBase

    prompts = [[(7 * i + 13 * j) % 500 + 3 for j in range(5 + 9 * i)] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    with LLM(
        model=str(folder), dtype=dtype, device="cuda", max_model_len=256,
        gpu_memory_utilization=0.3,
    ) as llm:  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.scheduler.kv_cache_manager.block_pool.is_whole
        model = llm.engine.model_runner.model
        linear_bytes = sum(
            p.numel() * p.element_size()
            for m in model.modules()
            if isinstance(m, LinearBase)
            for p in m.parameters(recurse=False)
        )
    return [o.outputs[0] for o in outs], linear_bytes


@pytest.mark.parametrize("fmt", ["gptq_runs", "gptq"])
def test_tiny_gptq_llama_kept_quantized_matches_its_dequantized_weights(
    tiny_model_path, tmp_path: Path, fmt: str
) -> None:
    """The engine on a GPTQ checkpoint (4 bits, groups of 32; gptq: with `desc_act`, each
    layer gathering its input in its act order) keeps its layers quantized (uint8 weights:
    about a third of the bytes of the same layers in bf16) and generates the tokens of the
    plain checkpoint of its dequantized weights: fp32 the same tokens and logprobs; bf16
    (CUDA graphs, the kernels' bf16 rounding against cuBLAS') the same first token for at
    least 7 of the 8 prompts."""
    from tests.int_checkpoints import quantized_folder

    quant, plain = quantized_folder(tiny_model_path("llama"), tmp_path, fmt, group=32)
    kept, kept_bytes = _generate(quant, "float32")
    ref, ref_bytes = _generate(plain, "float32")
    print(f"linear bytes fp32: kept {kept_bytes}, dequantized {ref_bytes}")
    assert kept_bytes < 0.2 * ref_bytes  # 0.5 + 2 * 2 / 32 bytes a weight against 4
    for ours, theirs in zip(kept, ref, strict=True):
        assert ours.token_ids == theirs.token_ids
        for step_ours, step_ref, token in zip(
            ours.logprobs, theirs.logprobs, ours.token_ids, strict=True
        ):
            assert step_ours[token].logprob == pytest.approx(step_ref[token].logprob, abs=2e-3)
    kept16, kept16_bytes = _generate(quant, "bfloat16")
    ref16, ref16_bytes = _generate(plain, "bfloat16")
    assert kept16_bytes < 0.35 * ref16_bytes
    same_first = sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(kept16, ref16, strict=True))
    assert same_first >= 7, same_first
