"""The W8A16 small-batch GEMM (tandem_kernels.fp8_w8a16) on the GPU at the 8B model's shapes:
every tuning candidate for 1..16 rows (GEMV and tensor-core forms, split along K and not)
against the dequantize-then-matmul reference in bf16 and fp16, per-tensor and per-channel
scales; split-K calls replayed in a CUDA graph on one lock buffer (same bits every replay,
locks back at zero); the load-time tuner's pick serving its bucket; the SiLU-and-mul computed
inside the GEMM (`gated`) against the unfused path, alone and as an FP8 model's down_proj;
16-bit weights through the same kernels (W16A16) against cuBLAS, and the unquantized layer
taking the tuner's pick.

    pytest -q -s -m gpu tests/gpu/test_fp8_w8a16_gpu.py     # -s prints the tuner's picks
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem_kernels import fp8 as fp8_ops
from tandem_kernels import fp8_w8a16 as w8a16

pytestmark = pytest.mark.gpu

# (N, K) of the 8B model's GEMMs: qkv, o, gate_up, down.
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.fixture(autouse=True)
def _needs_fp8() -> None:
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
        pytest.skip("needs a GPU of compute capability >= 8.9")


def _weight(n: int, k: int, per_channel: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    w *= torch.rand(n, 1, device="cuda", generator=gen) + 0.5
    quant = fp8_ops.quantize_per_row if per_channel else fp8_ops.quantize_per_tensor
    return quant(w.to(torch.bfloat16))


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_every_candidate_matches_the_reference(dtype: torch.dtype) -> None:
    shapes = SHAPES_8B if dtype == torch.bfloat16 else SHAPES_8B[1::2]  # fp16: o and down
    gen = torch.Generator(device="cuda").manual_seed(0)
    for s, (n, k) in enumerate(shapes):
        locks = w8a16.w8a16_locks(n, "cuda")
        schemes = (_weight(n, k, False, s), _weight(n, k, True, s))
        for b in (1, 2, 4, 8, 16):
            for i, config in enumerate(w8a16.candidates(b)):
                m = b - (i % 2) * (b // 2)  # the full bucket, or a part of it
                wq, scale = schemes[(i // 2) % 2]
                x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
                out = w8a16.w8a16_gemm(x, wq, scale, config, locks)
                ref = w8a16.w8a16_gemm_ref(x, wq, scale)
                # Both sum fp32 products of the same values; each rounds its output once.
                assert _rel_err(out, ref) < 5e-3, (n, k, m, config)
                assert not locks.any(), (n, k, m, config)


def test_split_k_replays_in_a_cuda_graph() -> None:
    n, k = 4096, 14336
    wq, scale = _weight(n, k, True, 7)
    locks = w8a16.w8a16_locks(n, "cuda")
    configs = [
        w8a16.Config(1, 16, 512, 4, 4, 1),
        w8a16.Config(4, 8, 1024, 4, 4, 1),  # K = 14 chunks of 1024: a short last slice
        w8a16.Config(16, 32, 256, 4, 4, 4),
        w8a16.Config(16, 64, 256, 4, 4, 3, True),
    ]
    x = torch.zeros(4, k, device="cuda", dtype=torch.bfloat16)
    for config in configs:  # compile outside the capture
        w8a16.w8a16_gemm(x[:1], wq, scale, config, locks)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [w8a16.w8a16_gemm(x[: c.block_m if c.block_m < 16 else 3], wq, scale, c, locks)
                for c in configs]  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(8)
    for _ in range(20):
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        assert not locks.any()
        for c, out in zip(configs, outs, strict=True):
            rows = out.shape[0]
            eager = w8a16.w8a16_gemm(x[:rows], wq, scale, c, locks)
            assert torch.equal(out, eager), c  # the slices summed in one order
            assert _rel_err(out, w8a16.w8a16_gemm_ref(x[:rows], wq, scale)) < 5e-3, c


def test_the_tuners_pick_serves_its_bucket() -> None:
    n, k = 4096, 4096
    wq, scale = _weight(n, k, False, 3)

    def baseline(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xq, xs = fp8_ops.dynamic_quant_per_tensor(x)
        return fp8_ops.fp8_scaled_mm(xq, w, xs, scale, None, x.dtype)

    choices = w8a16.tune_w8a16(wq, scale, torch.bfloat16, "test/tensor", baseline)
    assert set(choices) == set(w8a16.M_BUCKETS)
    record = w8a16.tuning_log[-1]
    print("tuned", n, k, f"in {record['tune_s']:.1f} s")
    for b in (1, 2, 4, 8, 16):
        entry = record["us"][str(b)]  # type: ignore[index]
        assert len(entry["candidates"]) == len(w8a16.candidates(b))
        print(b, entry["best"], entry["best_us"], "baseline", entry["baseline"])
        config = w8a16.choose(b, n, k, torch.bfloat16, "test/tensor")
        assert config == choices[b]
        if config is not None:
            x = torch.randn(b, k, device="cuda").to(torch.bfloat16)
            out = w8a16.w8a16_gemm(x, wq, scale, config, w8a16.w8a16_locks(n, "cuda"))
            assert _rel_err(out, w8a16.w8a16_gemm_ref(x, wq, scale)) < 5e-3


def test_gated_input_is_the_unfused_path_bit_for_bit() -> None:
    """down_proj's shape, every candidate of 1..4 rows: the GEMM computing SiLU-and-mul as it
    reads `gate_up` gives the bits of the SiLU-and-mul kernel followed by the GEMM."""
    from tandem_kernels.activation import silu_and_mul

    n, k = 4096, 14336
    wq, scale = _weight(n, k, True, 9)
    locks = w8a16.w8a16_locks(n, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(10)
    for b in (1, 2, 4):
        gate_up = (torch.randn(b, 2 * k, device="cuda", generator=gen) * 2).to(torch.bfloat16)
        for config in w8a16.candidates(b):
            gated = w8a16.w8a16_gemm(gate_up, wq, scale, config, locks, gated=True)
            unfused = w8a16.w8a16_gemm(silu_and_mul(gate_up), wq, scale, config, locks)
            assert torch.equal(gated, unfused), (b, config)


def test_fp8_model_down_proj_takes_its_input_gated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """random:llama-3.2-1b in FP8 with one W8A16 config for every linear: every down_proj
    takes its input as a `GatedActivation` (the SiLU-and-mul kernel skipped), and the logits
    are those of the same model with the activation run on its own, bit for bit."""
    from tandem.distributed import single_rank_state
    from tandem.layers.attention import get_attention_backend
    from tandem.layers.linear import LinearBase
    from tandem.layers.quantization import resolve_quant_config
    from tandem.layers.quantization.input_quant import GatedActivation
    from tandem.loader import build_model, load_hf_config
    from tandem.models import ModelContext
    from tandem.models.presets import write_random_model_folder
    from tests.unit.test_fp8 import _logits

    monkeypatch.setenv("TANDEM_TUNE_KERNELS", "0")  # no tuning at load: `choose` is fixed
    config = w8a16.Config(16, 32, 256, 2, 4, 4)
    monkeypatch.setattr(w8a16, "choose", lambda *args: config)
    monkeypatch.setattr(w8a16, "GATED_MAX_M", 16)  # the 14-token forward of _logits
    folder = write_random_model_folder("random:llama-3.2-1b", tmp_path)
    hf = load_hf_config(folder)
    device = torch.device("cuda")
    quant = resolve_quant_config("fp8", hf, device)
    ctx = ModelContext(
        torch.bfloat16, device, get_attention_backend("torch"), single_rank_state(device), quant
    )
    model = build_model(folder, ctx, hf_config=hf)
    gated_layers: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            module.register_forward_pre_hook(
                lambda mod, args, name=name: (
                    gated_layers.add(name) if isinstance(args[0], GatedActivation) else None
                )
            )
    gated = _logits(model, device)
    assert len(gated_layers) == hf.num_hidden_layers
    assert all(name.endswith("down_proj") for name in gated_layers)
    gated_layers.clear()
    monkeypatch.setattr(w8a16, "GATED_MAX_M", 0)
    unfused = _logits(model, device)
    assert not gated_layers
    assert torch.equal(gated, unfused)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_w16a16_every_candidate_matches_linear(dtype: torch.dtype) -> None:
    """16-bit weights through the same kernels (W16A16), every candidate of 1..16 rows at the
    o and down shapes, against `F.linear` (cuBLAS) on the same weight."""
    gen = torch.Generator(device="cuda").manual_seed(20)
    scale = w8a16.unit_scale("cuda")
    for n, k in SHAPES_8B[1::2]:
        w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(dtype)
        locks = w8a16.w8a16_locks(n, "cuda")
        for b in (1, 2, 4, 8, 16):
            for i, config in enumerate(w8a16.candidates(b)):
                m = b - (i % 2) * (b // 2)
                x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
                try:
                    out = w8a16.w8a16_gemm(x, w, scale, config, locks)
                except Exception as exc:  # a tile too large for 16-bit weights: never picked
                    assert "resources" in str(exc).lower(), (n, k, config, exc)
                    continue
                ref = torch.nn.functional.linear(x.float(), w.float())
                assert _rel_err(out, ref) < 5e-3, (n, k, m, config)
                assert not locks.any(), (n, k, m, config)


def test_the_unquantized_layer_takes_the_w16a16_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    """TANDEM_W16A16=tuned: the unquantized method tunes a bf16 weight at load against
    `F.linear`, serves each measured bucket with its pick (the same bits as the kernel called
    with that config), every batch within rounding of `F.linear`, eager and replayed from a
    CUDA graph; an input embedding is never tuned."""
    from torch import nn

    from tandem.layers.quantization.unquantized import UnquantizedLinearMethod

    monkeypatch.setenv("TANDEM_W16A16", "tuned")
    n, k = 4096, 4096
    method = UnquantizedLinearMethod()
    layer = nn.Module()
    method.create_weights(layer, k, [n], k, n, torch.bfloat16, device=torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(21)
    layer.weight.data.copy_(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
    method.process_weights_after_loading(layer)
    assert layer.w16a16 is not None
    record = w8a16.tuning_log[-1]
    assert record["baseline"] == w8a16.W16A16_BASELINE and (record["n"], record["k"]) == (n, k)
    print("W16A16 picks:", {b: v["use"] for b, v in record["us"].items()})  # type: ignore[union-attr]
    scale, locks = layer.w16a16
    for m in (1, 2, 3, 8, 16, 64, 300):
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        out = method.apply(layer, x)
        ref = torch.nn.functional.linear(x, layer.weight)
        assert _rel_err(out, ref) < 5e-3, m
        config = w8a16.choose_w16a16(m, n, k, torch.bfloat16)
        if config is not None:
            assert torch.equal(out, w8a16.w8a16_gemm(x, layer.weight, scale, config, locks)), m
    x = torch.zeros(1, k, device="cuda", dtype=torch.bfloat16)
    method.apply(layer, x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = method.apply(layer, x)
    for _ in range(5):
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, method.apply(layer, x))
        assert not locks.any()

    from tandem.layers.vocab import VocabParallelEmbedding

    embedding = VocabParallelEmbedding.__new__(VocabParallelEmbedding)
    nn.Module.__init__(embedding)
    embedding.weight = nn.Parameter(torch.zeros(4096, 4096, device="cuda", dtype=torch.bfloat16))
    logged = len(w8a16.tuning_log)
    method.process_weights_after_loading(embedding)
    assert embedding.w16a16 is None and len(w8a16.tuning_log) == logged
