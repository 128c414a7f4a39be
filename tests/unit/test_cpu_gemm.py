"""The CPU step path's GEMMs (tandem.layers.cpu_gemm): every candidate equals `F.linear` at
the embedded model's shapes, the panel kernel's result does not depend on the thread count or
the batch, the choice is a fixed rule, and the CPU linear method routes each product to its
token class's kernel."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tandem.config import ConfigError, DeviceConfig
from tandem.layers import cpu_gemm
from tandem.layers.cpu_gemm import (
    CPU_GEMMS,
    TOKEN_CLASSES,
    CpuGemmPlan,
    onednn_bf16,
    rule_cpu_gemm,
    token_class_index,
)
from tandem_kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler for the extension")

# SmolLM2-135M's weights [out, in]: QKV (9 + 2 * 3 heads of 64), o_proj, gate_up, down, LM head.
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def cpu_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype, gemm: str):
    """A linear layer of the CPU step path: the CPU packed method behind the quant hook."""
    from tandem.layers.attention import get_attention_backend
    from tandem.layers.linear import ReplicatedLinear
    from tandem.layers.quantization import CpuPackedLinearMethod
    from tandem.models.interface import ModelContext

    single = ModelContext.single(dtype, torch.device("cpu"), get_attention_backend("cpu"))
    ctx = dataclasses.replace(single, cpu_gemm=gemm)
    layer = ReplicatedLinear(in_features, out_features, bias, ctx)
    assert isinstance(layer.quant_method, CpuPackedLinearMethod)
    return layer


@pytest.mark.parametrize("shape", MODEL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_gemm_equals_f_linear_at_model_shapes(shape: tuple[int, int]) -> None:
    n, k = shape
    gen = torch.Generator().manual_seed(7)
    weight = torch.empty(n, k).uniform_(-0.05, 0.05, generator=gen)
    bias = torch.empty(n).uniform_(-1, 1, generator=gen)
    kernels = [g for g in CPU_GEMMS.values() if g.supports(weight)]
    assert {"torch", "onednn"} <= {g.name for g in kernels}  # oneDNN is in torch's x86 wheels
    assert ("mkl" in {g.name for g in kernels}) == cpu.has_packed_sgemm()
    # A decode row, a decode batch, a prefill chunk (the LM head sees sampled rows only); the
    # bias on one of them.
    row_counts = (1, 64) if n > 10_000 else (1, 64, 300)
    cases = []
    for rows in row_counts:
        x = torch.empty(rows, k).uniform_(-1, 1, generator=gen)
        b = bias if rows == 64 else None
        cases.append((x, b, F.linear(x, weight, b)))
    for g in kernels:
        packed = g.pack(weight)
        for x, b, ref in cases:
            out = g.linear(x, weight, packed, b)
            assert out.dtype == torch.float32 and out.shape == ref.shape
            # float32 throughout: only the summation order differs from F.linear's
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-5)


@pytest.mark.skipif(not cpu.has_panel_gemm(), reason="no AVX-512 panel kernel on this CPU")
def test_panel_gemm_is_the_same_whatever_the_threads_and_the_batch() -> None:
    # Each output row depends on its own input row only (blocked k order, no split of k across
    # threads): a request's numbers do not change with what it is batched with.
    gen = torch.Generator().manual_seed(3)
    weight = torch.empty(96, 200).uniform_(-0.05, 0.05, generator=gen)
    bias = torch.empty(96).uniform_(-1, 1, generator=gen)
    packed = cpu.panel_pack_weight(weight)
    assert packed.shape == (3, 200, 32)
    x = torch.empty(67, 200).uniform_(-1, 1, generator=gen)
    full = cpu.panel_linear(x, packed, bias)
    torch.testing.assert_close(full, F.linear(x, weight, bias), rtol=1e-5, atol=2e-5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = cpu.panel_linear(x, packed, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, full)
    for lo, hi in ((0, 1), (5, 6), (3, 12), (40, 67)):
        assert torch.equal(cpu.panel_linear(x[lo:hi], packed, bias), full[lo:hi])
    strided = torch.empty(67, 400).uniform_(-1, 1, generator=gen)[:, :200]
    torch.testing.assert_close(
        cpu.panel_linear(strided, packed, None), F.linear(strided, weight), rtol=1e-5, atol=2e-5
    )
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu.panel_pack_weight(torch.randn(90, 200))


@pytest.mark.skipif(not cpu.has_panel_gemm(), reason="no AVX-512 panel kernel on this CPU")
@pytest.mark.parametrize(
    ("rows", "d", "k", "bias"),
    [(1, 32, 40, True), (64, 1536, 576, False), (13, 96, 577, True), (300, 64, 4096, False)],
)
def test_panel_gate_up_with_silu_mul_is_the_two_ops_bit_for_bit(
    rows: int, d: int, k: int, bias: bool
) -> None:
    # The fused form stores silu(gate) * up from the same sums the plain product writes: the
    # same bits, so a process that fuses and one that does not agree (300 rows over k = 4096:
    # more than one row block; 64 x 1536 x 576: SmolLM2's MLP at a decode step).
    gen = torch.Generator().manual_seed(rows + d)
    weight = torch.empty(2 * d, k).uniform_(-0.05, 0.05, generator=gen)
    b = torch.empty(2 * d).uniform_(-1, 1, generator=gen) if bias else None
    x = torch.empty(rows, k).uniform_(-1, 1, generator=gen)
    packed = cpu.panel_pack_weight(weight)
    fused = cpu.panel_linear_silu_mul(x, packed, b)
    assert fused.shape == (rows, d)
    assert torch.equal(fused, cpu.silu_and_mul(cpu.panel_linear(x, packed, b)))
    ref = F.linear(x, weight, b)
    torch.testing.assert_close(fused, F.silu(ref[:, :d]) * ref[:, d:], rtol=1e-5, atol=2e-5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu.panel_linear_silu_mul(x, packed, b), fused)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(cpu.panel_linear_silu_mul(x[rows // 2 :], packed, b), fused[rows // 2 :])
    with pytest.raises(RuntimeError, match="gate \\| up"):
        cpu.panel_linear_silu_mul(x, cpu.panel_pack_weight(torch.randn(96, k)), None)


def test_gate_up_layer_fuses_the_activation_where_its_kernel_can(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tandem.layers.activation import SiluAndMul
    from tandem.layers.attention import get_attention_backend
    from tandem.layers.linear import MergedColumnParallelLinear
    from tandem.models.interface import ModelContext

    calls: list[str] = []
    real = cpu.panel_linear_silu_mul
    monkeypatch.setattr(cpu, "panel_linear_silu_mul", lambda *a: calls.append("fused") or real(*a))
    gen = torch.Generator().manual_seed(5)
    for gemm in ("auto", "onednn"):
        single = ModelContext.single(
            torch.float32, torch.device("cpu"), get_attention_backend("cpu")
        )
        ctx = dataclasses.replace(single, cpu_gemm=gemm)
        gate_up = MergedColumnParallelLinear(40, [64, 64], False, ctx)
        with torch.no_grad():
            gate_up.weight.uniform_(-0.1, 0.1, generator=gen)
        act = SiluAndMul(cpu_kernels=True)
        x = torch.empty(7, 40).uniform_(-1, 1, generator=gen)
        plain = F.linear(x, gate_up.weight)
        expected = F.silu(plain[:, :64]) * plain[:, 64:]
        torch.testing.assert_close(act.of(gate_up, x), expected)  # before loading: no plan
        gate_up.quant_method.process_weights_after_loading(gate_up)
        calls.clear()
        out = act.of(gate_up, x)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-5)
        fuses = gemm == "auto" and cpu.has_panel_gemm()
        assert calls == (["fused"] if fuses else [])
        assert torch.equal(out, act(gate_up(x)))  # the same bits as the two steps
        # Without the CPU kernels the activation runs after the projection, as before.
        calls.clear()
        torch.testing.assert_close(SiluAndMul().of(gate_up, x), expected, rtol=1e-5, atol=2e-5)
        assert calls == []


def test_rule_is_a_fixed_function_of_dtype_shape_and_cpu() -> None:
    fp32 = torch.randn(96, 40)
    small = "panel" if cpu.has_panel_gemm() else "onednn"
    assert rule_cpu_gemm(fp32) == (small,) * len(TOKEN_CLASSES)  # batch-invariant rows
    # A weight past the panel's size (a large LM head) stays on oneDNN.
    assert rule_cpu_gemm(torch.empty(32 * 1024, 640)) == ("onednn",) * len(TOKEN_CLASSES)
    assert CpuGemmPlan(fp32, has_bias=False).kernel_names == rule_cpu_gemm(torch.randn(96, 40))
    # No panel for a weight whose outputs are not whole panels of 32.
    assert rule_cpu_gemm(torch.randn(90, 40)) == ("onednn",) * len(TOKEN_CLASSES)
    bf16 = "onednn" if onednn_bf16() else "torch"
    assert rule_cpu_gemm(torch.randn(96, 40).bfloat16()) == (bf16,) * len(TOKEN_CLASSES)
    assert rule_cpu_gemm(torch.randn(96, 40).half()) == ("torch",) * len(TOKEN_CLASSES)


def test_plan_routes_each_token_class_to_its_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [token_class_index(r) for r in (0, 1, 2, 64, 128, 129, 4096)] == [0, 0, 1, 1, 1, 2, 2]
    names = ("mkl", "onednn", "torch") if cpu.has_packed_sgemm() else ("onednn", "torch", "torch")
    monkeypatch.setattr(cpu_gemm, "rule_cpu_gemm", lambda weight: names)
    gen = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(96, 40, generator=gen), torch.randn(96, generator=gen)
    plan = CpuGemmPlan(weight, has_bias=True)
    assert [plan.kernel_for(r).name for r in (1, 64, 1000)] == list(names)
    assert set(plan.packed) == set(names)  # only the chosen kernels' copies
    calls: list[str] = []
    for g in CPU_GEMMS.values():
        monkeypatch.setattr(
            g, "linear", lambda *a, _g=g, _f=g.linear: calls.append(_g.name) or _f(*a)
        )
    for rows, name in ((1, names[0]), (64, names[1]), (1000, names[2])):
        calls.clear()
        x = torch.randn(rows, 40, generator=gen)
        torch.testing.assert_close(plan.linear(x, weight, bias), F.linear(x, weight, bias))
        assert calls == [name]
    # Inputs a kernel cannot read (a strided view for oneDNN, 3-D rows) take F.linear.
    wide = torch.randn(64, 80, generator=gen)[:, :40]
    torch.testing.assert_close(plan.linear(wide, weight, bias), F.linear(wide, weight, bias))
    x3 = torch.randn(2, 3, 40, generator=gen)
    torch.testing.assert_close(plan.linear(x3, weight, None), F.linear(x3, weight))


@pytest.mark.parametrize("gemm", ["auto", "torch", "mkl", "onednn", "panel"])
def test_cpu_linear_method_equals_f_linear(gemm: str) -> None:
    layer = cpu_linear(40, 96, True, torch.float32, gemm)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(5, 40)
    before = layer(x)  # before loading finishes: no plan, F.linear
    torch.testing.assert_close(before, F.linear(x, layer.weight, layer.bias))
    layer.quant_method.process_weights_after_loading(layer)
    plan = layer.cpu_gemm_plan
    if gemm != "auto":
        missing = (gemm == "mkl" and not cpu.has_packed_sgemm()) or (
            gemm == "panel" and not cpu.has_panel_gemm()
        )
        expected = "torch" if missing else gemm
        assert plan.kernel_names == (expected,) * len(TOKEN_CLASSES)
    for rows in (0, 1, 15, 16, 100, 300):
        x = torch.randn(rows, 40)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_cpu_linear_method_keeps_half_on_f_linear() -> None:
    # No packed kernel takes float16 weights: every class falls to F.linear.
    half = cpu_linear(40, 96, False, torch.float16, "mkl")
    half.quant_method.process_weights_after_loading(half)
    assert half.cpu_gemm_plan.kernel_names == ("torch",) * len(TOKEN_CLASSES)
    assert half.cpu_gemm_plan.packed == {"torch": None}


@pytest.mark.skipif(not onednn_bf16(), reason="oneDNN has no bf16 on this CPU")
def test_cpu_linear_method_bf16_through_onednn() -> None:
    gen = torch.Generator().manual_seed(4)
    layer = cpu_linear(64, 96, True, torch.bfloat16, "onednn")
    layer.weight.data.copy_(torch.randn(96, 64, generator=gen))
    layer.bias.data.copy_(torch.randn(96, generator=gen))  # type: ignore[union-attr]
    layer.quant_method.process_weights_after_loading(layer)
    packed = layer.cpu_gemm_plan.packed["onednn"]
    assert packed is not None and packed.layout == torch._mkldnn
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        out = layer(x)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
        # Both accumulate in float32 and round once; only the summation order may differ.
        ref = x.float() @ layer.weight.float().T + layer.bias.float()  # type: ignore[union-attr]
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=2e-2)
    # Rows the packed path does not take (none; a strided view) still give F.linear's answer.
    assert layer(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 96)
    wide = torch.randn(5, 128, generator=gen).bfloat16()
    torch.testing.assert_close(
        layer(wide[:, :64]), F.linear(wide[:, :64], layer.weight, layer.bias)
    )


def test_cpu_gemm_flag_is_checked() -> None:
    assert DeviceConfig(cpu_gemm="onednn").cpu_gemm == "onednn"
    with pytest.raises(ConfigError, match="cpu_gemm"):
        DeviceConfig(cpu_gemm="blas")  # type: ignore[arg-type]
