"""FP8 activation quantization fused into RMSNorm and SiLU-and-mul (tandem_kernels.fp8_fused)
on the GPU at the 8B model's sizes: every scale and e4m3 byte equal to the unfused path's
(the bf16 Triton op, then the Triton quantizer), the kernels inside a CUDA graph, and a
random-weight llama-3.2-1b in FP8 whose norms and activations hand its linears e4m3 input
giving the logits of the same model with every linear quantizing its own input.

    pytest -q -m gpu tests/gpu/test_fp8_fused_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem_kernels import fp8 as fp8_ops
from tandem_kernels.activation import silu_and_mul
from tandem_kernels.fp8_fused import QuantStrategy, rms_norm_fp8, silu_and_mul_fp8
from tandem_kernels.rms_norm import fused_add_rms_norm, rms_norm

pytestmark = pytest.mark.gpu

HIDDEN = 4096
INTERMEDIATE = [14336, 7168]  # TP 1 and TP 2 ranks of llama-3.1-8b
STRATEGIES: list[QuantStrategy] = ["token", "tensor", "static"]
STATIC_SCALE = 0.0123


@pytest.fixture(autouse=True)
def _needs_fp8() -> None:
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
        pytest.skip("needs a GPU of compute capability >= 8.9")


def _unfused_quant(x: torch.Tensor, strategy: QuantStrategy) -> tuple[torch.Tensor, torch.Tensor]:
    """What an FP8 linear does to its bf16 input on its own."""
    if strategy == "token":
        return fp8_ops.dynamic_quant_per_token(x)
    if strategy == "tensor":
        return fp8_ops.dynamic_quant_per_tensor(x)
    return fp8_ops.quantize_per_tensor(x, torch.tensor(STATIC_SCALE, device=x.device))


def _static(strategy: QuantStrategy) -> torch.Tensor | None:
    return torch.tensor(STATIC_SCALE, device="cuda") if strategy == "static" else None


def _assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, ...]) -> None:
    (q, s), (q_ref, s_ref) = got, want[:2]
    assert s.shape == s_ref.shape and torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("m", [1, 16, 257, 4096])
def test_rms_norm_fp8_is_the_unfused_path_bit_for_bit(m: int, strategy: QuantStrategy) -> None:
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = (torch.randn(m, HIDDEN, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    residual = torch.randn(m, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=gen)).to(torch.bfloat16)
    x[m // 2] = 0
    q, s, none = rms_norm_fp8(x, None, weight, 1e-5, strategy, _static(strategy))
    assert none is None
    _assert_same((q, s), _unfused_quant(rms_norm(x, weight, 1e-5), strategy))
    q, s, residual_out = rms_norm_fp8(x, residual, weight, 1e-5, strategy, _static(strategy))
    normed, summed = fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual_out, summed)
    _assert_same((q, s), _unfused_quant(normed, strategy))


@pytest.mark.parametrize("inter", INTERMEDIATE)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("m", [1, 16, 257, 4096])
def test_silu_and_mul_fp8_is_the_unfused_path_bit_for_bit(
    m: int, strategy: QuantStrategy, inter: int
) -> None:
    gen = torch.Generator(device="cuda").manual_seed(m + inter)
    x = (torch.randn(m, 2 * inter, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    x[m // 2] = 0
    got = silu_and_mul_fp8(x, strategy, _static(strategy))
    _assert_same(got, _unfused_quant(silu_and_mul(x), strategy))


@pytest.mark.parametrize("inter", [768, 1100])
@pytest.mark.parametrize("m", [1, 257, 4096])
def test_silu_and_mul_fp8_per_token_group_is_the_unfused_path_bit_for_bit(
    m: int, inter: int
) -> None:
    """Groups of 128 (block-scaled FP8 experts' act; I 768: Qwen3-30B-A3B's, 1100: a shorter
    last group) against silu_and_mul then the per-token-group quantizer."""
    gen = torch.Generator(device="cuda").manual_seed(m + inter)
    x = (torch.randn(m, 2 * inter, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    x[m // 2] = 0
    got = silu_and_mul_fp8(x, "group", group=128)
    assert got[1].shape == (m, -(-inter // 128))
    _assert_same(got, fp8_ops.dynamic_quant_per_token_group(silu_and_mul(x), 128))


def test_fused_kernels_replay_in_a_cuda_graph() -> None:
    """Captured once (per-tensor: two passes and the zeroed max inside the graph), replayed
    over new inputs: the eager kernels' results each time (no host value read at capture)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.empty(64, HIDDEN, device="cuda", dtype=torch.bfloat16)
    residual = torch.empty_like(x)
    gate_up = torch.empty(64, 2 * 7168, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)

    def fill() -> None:
        for t in (x, residual, gate_up):
            t.copy_(torch.randn(t.shape, device="cuda", generator=gen) * 3)

    fill()
    outs: dict[str, tuple[torch.Tensor, ...]] = {}

    def step() -> None:
        outs["norm"] = rms_norm_fp8(x, residual, weight, 1e-5, "tensor")[:2]
        outs["act"] = silu_and_mul_fp8(gate_up, "token")

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        fill()
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(outs["norm"], rms_norm_fp8(x, residual, weight, 1e-5, "tensor"))
        _assert_same(outs["act"], silu_and_mul_fp8(gate_up, "token"))


@pytest.mark.parametrize("quantization", ["fp8", "ptpc_fp8"])
def test_fp8_model_with_fused_inputs_matches_unfused(
    quantization: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """random:llama-3.2-1b in bf16 on the GPU: with the fused producers, every qkv / gate_up
    / down input arrives quantized, and the logits are those of the model whose linears
    quantize their own input. (The small-batch W8A16 GEMM, which takes plain input, is held
    off: this step's few tokens would otherwise take it.)"""
    from tandem_kernels import fp8_w8a16

    monkeypatch.setattr(fp8_w8a16, "choose", lambda *args: None)
    from tandem.distributed import single_rank_state
    from tandem.layers.activation import SiluAndMul
    from tandem.layers.attention import get_attention_backend
    from tandem.layers.norm import RMSNorm
    from tandem.layers.quantization import resolve_quant_config
    from tandem.loader import build_model, load_hf_config
    from tandem.models import ModelContext
    from tandem.models.presets import write_random_model_folder
    from tests.unit.test_fp8 import _fused_inputs

    folder = write_random_model_folder("random:llama-3.2-1b", tmp_path)
    hf = load_hf_config(folder)
    device = torch.device("cuda")
    quant = resolve_quant_config(quantization, hf, device)
    ctx = ModelContext(
        torch.bfloat16, device, get_attention_backend("torch"), single_rank_state(device), quant
    )
    model = build_model(folder, ctx, hf_config=hf)
    fused, kinds = _fused_inputs(model, device)
    quantized = {n for n, k in kinds.items() if k == "quantized"}
    assert len(quantized) == 3 * hf.num_hidden_layers, sorted(kinds)
    for module in model.modules():
        if isinstance(module, (RMSNorm, SiluAndMul)):
            module.input_quant = None
    unfused, kinds = _fused_inputs(model, device)
    assert set(kinds.values()) == {"plain"}
    rel = ((fused - unfused).norm() / unfused.norm()).item()
    print(f"\n{quantization}: fused vs unfused logits, relative difference {rel:.2e}")
    # The kernels are bit for bit the unfused path (above), so this is 0 but for the
    # GEMMs' own run-to-run order; an e4m3 step off anywhere would show as about 1e-2.
    assert rel < 1e-3
    assert (fused.argmax(-1) == unfused.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("strategy", ["token", "tensor"])
def test_padding_rows_of_nan_and_inf_leave_the_real_rows_as_unfused(
    strategy: QuantStrategy,
) -> None:
    """A CUDA graph's padding rows hold whatever their buffers held (NaN, inf). The fused
    producers take their maxima as the unfused quantizers do (NaN lanes dropped), so a
    per-tensor scale is not poisoned and the real rows' bytes equal the unfused path's. At
    SmolLM2's sizes (hidden 576, intermediate 1536: partial blocks) and the 8B's."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    for hidden, inter, m in ((576, 1536, 48), (HIDDEN, INTERMEDIATE[0], 8)):
        x = (torch.randn(m, hidden, device="cuda", generator=gen) * 3).to(torch.bfloat16)
        residual = torch.randn(m, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(torch.bfloat16)
        y = (torch.randn(m, 2 * inter, device="cuda", generator=gen) * 4).to(torch.bfloat16)
        x[-1], x[-2], residual[-2], y[-1] = float("nan"), float("inf"), float("inf"), float("nan")
        real = m - 2
        normed, _ = fused_add_rms_norm(x, residual, weight, 1e-5)
        for (q, s), (q_ref, s_ref) in (
            (
                rms_norm_fp8(x, residual, weight, 1e-5, strategy)[:2],
                _unfused_quant(normed, strategy),
            ),
            (silu_and_mul_fp8(y, strategy), _unfused_quant(silu_and_mul(y), strategy)),
        ):
            if strategy == "tensor":
                assert torch.isfinite(s) and torch.equal(s, s_ref), (hidden, s, s_ref)
            else:
                assert torch.equal(s[:real], s_ref[:real])
            assert torch.equal(q[:real].view(torch.uint8), q_ref[:real].view(torch.uint8))
