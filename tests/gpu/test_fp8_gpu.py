"""FP8 on the GPU at real sizes: `torch._scaled_mm` against its dequantize-then-matmul
reference at the 8B model's shapes, the FP8 KV write bit for bit and attention over an FP8
cache against the same cache dequantized, and the FP8 engine (weights, then KV cache) against
its bf16 self on the embedded SmolLM2 (real weights: random ones give near-flat
distributions, where the top-5 rule says nothing) with CUDA graphs on.

    pytest -q -s -m gpu tests/gpu/test_fp8_gpu.py     # -s prints the logprob gaps
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem_kernels import fp8 as fp8_ops

pytestmark = pytest.mark.gpu

MODEL = "default"  # the embedded SmolLM2-135M-Instruct
NUM_PROMPTS = 16
NEW_TOKENS = 24
# (N, K) of the 8B model's GEMMs: qkv, o, gate_up, down.
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def _fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.fixture(autouse=True)
def _needs_fp8() -> None:
    if not _fp8_capable():
        pytest.skip("needs a GPU of compute capability >= 8.9")


# ----------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("rowwise", [False, True], ids=["per_tensor", "rowwise"])
@pytest.mark.parametrize("m", [1, 16, 257, 4096])
def test_scaled_mm_at_8b_shapes(m: int, rowwise: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(m)
    for n, k in SHAPES_8B:
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        quant = fp8_ops.quantize_per_row if rowwise else fp8_ops.quantize_per_tensor
        (xq, xs), (wq, ws) = quant(x), quant(w)
        got = fp8_ops.fp8_scaled_mm(xq, wq, xs, ws).float()
        ref = fp8_ops.fp8_scaled_mm_ref(xq, wq, xs, ws, out_dtype=torch.float32)
        # Both sum the same fp8 products; the GEMM rounds its output to bf16 once.
        assert ((got - ref).norm() / ref.norm()).item() < 4e-3, (m, n, k)
        torch.testing.assert_close(got, ref, atol=ref.abs().max().item() * 1e-2, rtol=1e-2)


def test_fp8_kv_write_is_bit_exact() -> None:
    from tandem_kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.zeros(512, 4, 2, 16, 8, 128, device="cuda").to(torch.float8_e4m3fn)[:, 2]
    expected = cache.clone()
    slots = torch.randperm(512 * 16, device="cuda", generator=gen)[:3000]
    key = torch.randn(3000, 8, 128, device="cuda", generator=gen).to(torch.bfloat16) * 4
    value = torch.randn(3000, 8, 128, device="cuda", generator=gen).to(torch.bfloat16)
    reshape_and_cache(key, value, cache, slots, 0.03, 0.011)
    reshape_and_cache_ref(key, value, expected, slots, 0.03, 0.011)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


def _block_table(
    seq_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator
) -> torch.Tensor:
    """Distinct blocks for each request, dealt in a shuffled order (a pool after churn)."""
    per = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(per), dtype=torch.int32, device="cuda")
    used = 0
    for r, n in enumerate(per):
        table[r, :n] = perm[used : used + n]
        used += n
    return table


def test_attention_over_fp8_cache_at_real_sizes() -> None:
    from tandem_kernels import paged_attention as pa

    gen = torch.Generator(device="cuda").manual_seed(1)
    heads, kv_heads, head, bs, blocks = 32, 8, 128, 16, 1024
    ks, vs = 0.02, 0.004
    raw = torch.randn(blocks, 2, bs, kv_heads, head, device="cuda", generator=gen)
    raw[:, 0] /= ks * 8
    raw[:, 1] /= vs * 8
    cache = raw.to(torch.float8_e4m3fn)
    deq = cache.float()
    deq[:, 0] *= ks
    deq[:, 1] *= vs
    deq = deq.to(torch.bfloat16)
    seq_lens, q_lens = [2000, 1, 700, 1500], [2000, 1, 64, 1]
    table = _block_table(seq_lens, bs, blocks, gen)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    qsl = qsl.cuda()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    query = torch.randn(sum(q_lens), heads, head, device="cuda", generator=gen)
    query = query.to(torch.bfloat16)
    scale = head**-0.5
    ref = pa.paged_attention_ref(query, deq, qsl, lens, table, scale)
    out = pa.paged_prefill_attention(query, cache, qsl, lens, table, scale, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    dq = torch.randn(4, heads, head, device="cuda", generator=gen).to(torch.bfloat16)
    ones = torch.arange(5, dtype=torch.int32, device="cuda")
    dref = pa.paged_attention_ref(dq, deq, ones, lens, table, scale)
    for splits in (1, 8):
        got = pa.paged_decode_attention(
            dq, cache, lens, table, scale, max_seq_len=2000, num_splits=splits, k_scale=ks,
            v_scale=vs,
        )  # fmt: skip
        torch.testing.assert_close(got, dref, atol=2e-2, rtol=2e-2)


def test_fp8_decode_reads_the_cache_exactly_and_survives_large_queries() -> None:
    """The decode kernel reads an FP8 cache in fp16 (`widen_kv`: e4m3 is a subset of fp16, so
    the read is exact, as a bf16 read is; the probabilities are rounded to fp16, finer than
    bf16): against the fp32 reference over the same cache, every tuning candidate (register
    caps included) is within the output's bf16 rounding and the probabilities' fp16 rounding.
    A query past fp16's range is clamped into it: the output stays finite."""
    from tandem_kernels import paged_attention as pa

    gen = torch.Generator(device="cuda").manual_seed(5)
    heads, kv_heads, head, bs, blocks = 32, 8, 128, 16, 512
    cache = (torch.randn(blocks, 2, bs, kv_heads, head, device="cuda", generator=gen) * 8).to(
        torch.float8_e4m3fn
    )
    seq_lens = [1, 17, 300, 2048, 777, 4096]
    table = _block_table(seq_lens, bs, blocks, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    query = (torch.randn(len(seq_lens), heads, head, device="cuda", generator=gen) * 0.1).to(
        torch.bfloat16
    )
    rows = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device="cuda")
    scale = head**-0.5
    ref = pa.paged_attention_ref(query.float(), cache.float(), rows, lens, table, scale)
    for block_n, warps, stages, heads_first, cap in pa._DECODE_CANDIDATES:
        for splits in (1, 8):
            got = pa.paged_decode_attention(
                query, cache, lens, table, scale, max_seq_len=4096, num_splits=splits,
                block_n=block_n, num_warps=warps, num_stages=stages, heads_first=heads_first,
                max_registers=cap,
            )  # fmt: skip
            # |v| < 64 here: bf16 output rounding <= 0.13, fp16 probabilities <= 0.03.
            torch.testing.assert_close(got.float(), ref, atol=0.1, rtol=1e-2)
    big = query.clone()
    big[2, 5] = 1.0e6  # beyond fp16's 65,504
    out = pa.paged_decode_attention(big, cache, lens, table, scale, max_seq_len=4096)
    assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------- engine


_TOPICS = [
    "the history of the printing press",
    "how a refrigerator works",
    "the rules of chess",
    "why the sky is blue",
    "a recipe for bread",
    "the water cycle",
    "how vaccines work",
    "the French revolution",
    "photosynthesis",
    "how to learn a language",
    "black holes",
    "the life of bees",
    "how the internet routes packets",
    "the Roman empire",
    "how batteries store energy",
    "the causes of earthquakes",
]


def _prompts(n: int = NUM_PROMPTS) -> list[str]:
    return [f"Write a short explanation of {topic}." for topic in _TOPICS[:n]]


def _run(**kwargs: Any) -> tuple[list[Any], int]:
    """Greedy outputs (top-20 logprobs, for `_in_top5`'s ties) of the 16 prompts, and the
    engine's KV block count."""
    with LLM(
        model=MODEL,
        dtype="bfloat16",
        device="cuda",
        max_model_len=1024,
        gpu_memory_utilization=0.4,
        **kwargs,
    ) as llm:
        assert llm.engine.model_runner.cuda_graphs.graphs, "CUDA graphs were not captured"
        params = SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=20
        )
        outs = llm.generate(_prompts(), params, use_tqdm=False)
        assert llm.engine.scheduler.kv_cache_manager.block_pool.is_whole
        return [o.outputs[0] for o in outs], llm.engine.num_blocks


@pytest.fixture(scope="module")
def bf16_run() -> Iterator[tuple[list[Any], int]]:
    yield _run()


def _in_top5(token: int, logprobs: dict[int, Any]) -> bool:
    """`token` among the 5 most likely of `logprobs` (a step's top 20), ties counted as in:
    fewer than 5 tokens strictly more likely. bf16 logits are coarse (a step of 1/16 at 10),
    so a flat distribution has several tokens at one value, of which a plain top 5 keeps an
    arbitrary few."""
    if token not in logprobs:
        return False
    value = logprobs[token].logprob
    return sum(1 for lp in logprobs.values() if lp.logprob > value) < 5


def _top(logprobs: dict[int, Any]) -> list[tuple[float, int]]:
    """A step's six most likely tokens, (logprob to 2 places, token id), best first."""
    return sorted(((round(v.logprob, 2), t) for t, v in logprobs.items()), reverse=True)[:6]


def _compare(name: str, ref: list[Any], test: list[Any]) -> float:
    """Greedy identical, or at the first difference each side's token is in the other's
    top 5 (`_in_top5`). Prints every first difference with both sides' top 6 (those outside
    the rule fail the test, all named). Returns (and prints) the mean |logprob gap| of the
    chosen tokens where both chose the same one."""
    identical, gaps, outside = 0, [], []
    for i, (a, b) in enumerate(zip(ref, test, strict=True)):
        diff = next(
            (j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y),
            None,
        )
        upto = len(a.token_ids) if diff is None else diff
        for j in range(upto):
            tok = a.token_ids[j]
            gaps.append(abs(a.logprobs[j][tok].logprob - b.logprobs[j][tok].logprob))
        if diff is None:
            identical += 1
            continue
        ok = _in_top5(a.token_ids[diff], b.logprobs[diff]) and _in_top5(
            b.token_ids[diff], a.logprobs[diff]
        )
        where = (
            f"{name} prompt {i} step {diff}: bf16 {a.token_ids[diff]}, it {b.token_ids[diff]}"
            f" ({'in' if ok else 'OUTSIDE'} the top 5)\n  bf16 top {_top(a.logprobs[diff])}"
            f"\n  it   top {_top(b.logprobs[diff])}"
        )
        print(where)
        if not ok:
            outside.append(where)
    mean_gap = sum(gaps) / max(len(gaps), 1)
    print(
        f"\n{name}: {identical}/{len(ref)} prompts identical to bf16 for {NEW_TOKENS} tokens; "
        f"mean chosen-token logprob gap {mean_gap:.4f} over {len(gaps)} tokens"
    )
    assert not outside, "\n".join(outside)
    return mean_gap


@pytest.mark.parametrize("quantization", ["fp8", "ptpc_fp8"])
def test_fp8_weights_against_bf16_self(bf16_run, quantization: str) -> None:
    ref, _ = bf16_run
    outs, _ = _run(quantization=quantization)
    assert _compare(f"--quantization {quantization}", ref, outs) < 0.5


def test_fp8_kv_cache_against_bf16_self(bf16_run) -> None:
    ref, bf16_blocks = bf16_run
    outs, fp8_blocks = _run(kv_cache_dtype="fp8")
    assert _compare("--kv-cache-dtype fp8", ref, outs) < 0.5
    # Half the bytes per block: about twice the blocks in the same memory.
    print(f"KV blocks: bf16 {bf16_blocks}, fp8 {fp8_blocks}")
    assert fp8_blocks >= 1.9 * bf16_blocks


def test_fp8_weights_and_kv_cache_together(bf16_run) -> None:
    ref, _ = bf16_run
    outs, _ = _run(quantization="fp8", kv_cache_dtype="fp8_e4m3")
    assert _compare("--quantization fp8 --kv-cache-dtype fp8", ref, outs) < 0.7


def test_dynamic_activation_quant_is_bit_exact() -> None:
    """The Triton activation quantizers against the torch ones (weights' and references'),
    per token with FBGEMM's amax bound (binding on the scaled-up rows), per token group too
    (groups of 128, and of 100: a shorter last group; a zero group)."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(3000, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    x[7] = 0
    x[9, 256:384] = 0
    x[::5] *= 8  # amax ~40 over the bound of 20
    for kernel, ref in (
        (fp8_ops.dynamic_quant_per_token, fp8_ops.quantize_per_row),
        (
            functools.partial(fp8_ops.dynamic_quant_per_token, scale_ub=20.0),
            functools.partial(fp8_ops.quantize_per_row, scale_ub=20.0),
        ),
        (fp8_ops.dynamic_quant_per_tensor, fp8_ops.quantize_per_tensor),
        *(
            (
                functools.partial(fp8_ops.dynamic_quant_per_token_group, group=group),
                functools.partial(fp8_ops.quantize_per_token_group, group=group),
            )
            for group in (128, 100)
        ),
    ):
        (q, scale), (q_ref, scale_ref) = kernel(x), ref(x)
        assert torch.equal(scale, scale_ref)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("m", [1, 64, 1000])
def test_block_gemm_at_8b_shapes(m: int) -> None:
    from tandem_kernels.fp8_block_gemm import fp8_block_gemm, fp8_block_gemm_ref

    gen = torch.Generator(device="cuda").manual_seed(m)
    for n, k in SHAPES_8B:
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        wq, tiles = fp8_ops.quantize_per_block(w, (128, 128))
        scale = tiles.repeat_interleave(128, 0)[:n].contiguous()
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        got = fp8_block_gemm(x, wq, scale, 128).float()
        ref = fp8_block_gemm_ref(x.float(), wq, scale, 128)
        assert ((got - ref).norm() / ref.norm()).item() < 4e-3, (m, n, k)


def checkpoint_on_both_devices(src: Path, folder: Path, kind: str) -> dict[str, Any]:
    """`src` saved as an FP8 checkpoint of `kind` (tests/unit/test_fp8.py writes it) in
    `folder`, then loaded as stored on the CPU and on CUDA, fp32: device name -> model."""
    from tandem.distributed import single_rank_state
    from tandem.layers.attention import get_attention_backend
    from tandem.layers.quantization import resolve_quant_config
    from tandem.loader import build_model, load_hf_config
    from tandem.models import ModelContext
    from tests.unit.test_fp8 import _write_fp8_checkpoint

    _write_fp8_checkpoint(src, folder, kind)
    hf = load_hf_config(folder)
    models = {}
    for dev in ("cpu", "cuda"):
        device = torch.device(dev)
        quant = resolve_quant_config("auto", hf, device, check_device=dev == "cuda")
        ctx = ModelContext(
            torch.float32, device, get_attention_backend("torch"), single_rank_state(device),
            quant,
        )  # fmt: skip
        models[dev] = build_model(folder, ctx, hf_config=hf)
    return models


@pytest.mark.parametrize(
    "kind",
    [
        *("ct_tensor", "ct_channel", "ct_static", "fp8_block128"),
        *("modelopt_fp8", "modelopt_pcpt", "modelopt_pb_wo", "fbgemm"),
    ],
)
def test_fp8_checkpoint_on_the_gpu_matches_the_cpu_reference(kind, tiny_model_path, tmp_path):
    """A saved FP8 checkpoint (tests/unit/test_fp8.py writes it: compressed-tensors, HF fp8
    blocks, ModelOpt's three, FBGEMM's) through the GPU paths (`_scaled_mm` per tensor / rowwise /
    static, the block GEMM) against the same checkpoint
    through the CPU's dequantize-then-matmul references, fp32 activations both.

    Layer by layer: every quantized linear gets the same input on both devices. Both quantize
    it to the same e4m3 values (the scales are bit-exact), so only the GEMM's summation order
    and the rowwise GEMM's bf16 output differ. A whole model would not compare this way: one
    activation that rounds to the other e4m3 neighbour moves every later layer."""
    from tests.unit.test_fp8 import _logits

    models = checkpoint_on_both_devices(tiny_model_path("llama"), tmp_path / kind, kind)
    logits = {dev: _logits(model, torch.device(dev)).cpu() for dev, model in models.items()}
    cpu_layers = dict(models["cpu"].named_modules())
    checked = 0
    gen = torch.Generator().manual_seed(9)
    for name, layer in models["cuda"].named_modules():
        method = getattr(layer, "quant_method", None)
        if method is None or type(method).__name__ != "Fp8LinearMethod":
            continue
        x = torch.randn(37, layer.input_size_per_partition, generator=gen)
        with torch.inference_mode():
            got = layer(x.cuda()).float().cpu()
            ref = cpu_layers[name](x).float()
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel < 6e-3, (name, rel)
        checked += 1
    assert checked >= (6 if kind == "modelopt_fp8" else 7), checked  # (its layer-1 MLP excluded)
    # The whole model: the same logits up to the drift of activations re-rounded to e4m3.
    cos = torch.nn.functional.cosine_similarity(logits["cuda"], logits["cpu"], dim=-1)
    print(f"\n{kind}: {checked} layers; logits cosine min {cos.min().item():.5f}")
    assert cos.min().item() > 0.98
