"""How the W8A16 tuner times its candidates (tandem_kernels.fp8_w8a16.tune_w8a16), on the CPU
with the kernels and the clock replaced: with PDL and TANDEM_W8A16_TIMING=chain each call is
timed after the short kernel a decode step runs before it (`chain_lead`), the scaled-GEMM
baseline too, and the lead alone; without PDL, or by default ("alone"), the calls run back to
back. The 16-bit weights' tuning (W16A16) and its setting."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from tandem_kernels import fp8_w8a16 as w8

N, K = 1024, 1024  # 1 MiB of e4m3: the smallest weight the tuner measures


def _fakes(
    monkeypatch: pytest.MonkeyPatch, pdl: bool, buckets: tuple[int, ...]
) -> tuple[list[Any], list[list[Any]]]:
    """The tuner's clock and kernels replaced: every GEMV config takes 1 us (the first
    candidate wins), the baseline 1,000. Returns the launch list and each timed graph's
    launches, filled as the tuner runs."""
    launches: list[Any] = []
    graphs: list[list[Any]] = []

    def fake_time_in_graph(runs: list[Any], reps: int = 8) -> float:
        start = len(launches)
        for run in runs:
            run()
        graphs.append(launches[start:])
        return 1.0 if any(event[0] == "gemv" for event in launches[start:]) else 1000.0

    monkeypatch.setattr(w8, "M_BUCKETS", buckets)
    monkeypatch.setattr(w8, "_choices", {})
    monkeypatch.setattr(w8, "tuning_log", [])
    monkeypatch.setattr(w8, "_may_tune", lambda weight: True)
    monkeypatch.setattr(w8, "pdl_launch", lambda device: pdl)
    monkeypatch.setattr(w8, "weight_copies", lambda weight: [weight, weight])
    monkeypatch.setattr(w8, "time_in_graph", fake_time_in_graph)
    monkeypatch.setattr(
        w8, "chain_lead", lambda m, k, dtype, device: lambda: launches.append(("lead", m, k))
    )
    monkeypatch.setattr(
        w8, "w8a16_gemm", lambda x, w, s, config, locks: launches.append(("gemv", config))
    )
    return launches, graphs


def _tune(
    monkeypatch: pytest.MonkeyPatch,
    pdl: bool,
    buckets: tuple[int, ...] = (1,),
    gated_input: bool = False,
) -> tuple[list[list[Any]], dict[str, Any]]:
    """Run the tuner at `buckets` with fakes (`_fakes`); returns each timed graph's launches
    and the log entry."""
    launches, graphs = _fakes(monkeypatch, pdl, buckets)
    weight = torch.zeros(N, K, dtype=torch.float8_e4m3fn)
    scale = torch.ones((), dtype=torch.float32)
    choices = w8.tune_w8a16(
        weight,
        scale,
        torch.bfloat16,
        "test/chain",
        lambda x, w: launches.append(("base",)),
        gated_input=gated_input,
    )
    assert choices == {b: w8.candidates(b)[0] for b in buckets}
    return graphs, w8.tuning_log[-1]


def test_with_pdl_every_call_is_timed_after_the_chain_lead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TANDEM_W8A16_TIMING", "chain")
    graphs, log = _tune(monkeypatch, pdl=True)
    assert log["chain"] is True
    lead = ("lead", 1, K)
    base, *timed, lead_alone = graphs
    assert base == [lead, ("base",)] * 2
    assert len(timed) == len(w8.candidates(1))
    for config, launched in zip(w8.candidates(1), timed, strict=True):
        assert launched == [lead, ("gemv", config)] * 2
    assert lead_alone == [lead, lead]
    assert log["us"]["1"]["lead_us"] == 1000.0


@pytest.mark.parametrize(("pdl", "flag"), [(False, "chain"), (True, ""), (True, "alone")])
def test_without_pdl_or_asked_alone_the_calls_run_back_to_back(
    monkeypatch: pytest.MonkeyPatch, pdl: bool, flag: str
) -> None:
    if flag:
        monkeypatch.setenv("TANDEM_W8A16_TIMING", flag)
    else:
        monkeypatch.delenv("TANDEM_W8A16_TIMING", raising=False)
    graphs, log = _tune(monkeypatch, pdl=pdl)
    assert log["chain"] is False and log["us"]["1"]["lead_us"] is None
    assert all(event[0] != "lead" for launched in graphs for event in launched)
    assert graphs[0] == [("base",)] * 2


def test_a_gated_input_layer_follows_the_projection_at_the_gated_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Down_proj folds the SiLU-and-mul into its loads up to GATED_MAX_M rows, so in a step it
    follows gate_up, a GEMV: those buckets are timed back to back, the others after the lead."""
    monkeypatch.setenv("TANDEM_W8A16_TIMING", "chain")
    assert w8.GATED_MAX_M == 1
    graphs, log = _tune(monkeypatch, pdl=True, buckets=(1, 2), gated_input=True)
    one_row = graphs[: 1 + len(w8.candidates(1))]
    two_rows = graphs[len(one_row) :]
    assert all(event[0] != "lead" for launched in one_row for event in launched)
    assert log["us"]["1"]["lead_us"] is None
    base, *timed, lead_alone = two_rows
    assert base == [("lead", 2, K), ("base",)] * 2 and lead_alone == [("lead", 2, K)] * 2
    assert all(launched[0] == ("lead", 2, K) for launched in timed)
    assert log["us"]["2"]["lead_us"] == 1000.0


def test_silu_and_mul_marks_the_linear_it_feeds() -> None:
    """The tuner learns a layer's input is gated from the activation that feeds it."""
    from tandem.layers.activation import SiluAndMul
    from tandem.layers.attention import get_attention_backend
    from tandem.layers.linear import RowParallelLinear
    from tandem.models import ModelContext
    from tests.parallel_groups import CPU, fake_parallel_state

    ctx = ModelContext(torch.float32, CPU, get_attention_backend("torch"), fake_parallel_state())
    down = RowParallelLinear(8, 4, False, ctx, prefix="mlp.down_proj")
    assert down.gated_input is False
    SiluAndMul(quant_consumer=down)
    assert down.gated_input is True


def test_a_bad_timing_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_W8A16_TIMING", "1")
    with pytest.raises(ValueError, match="TANDEM_W8A16_TIMING"):
        w8.timing_setting()


def test_one_row_candidates_read_a_whole_k_slice_in_one_chunk() -> None:
    """The configs whose K slice of a 4,096-wide input is one chunk, so that with PDL the
    whole slice is read before the wait: plain and reducing each chunk."""
    whole = [c for c in w8.candidates(1) if c.block_m == 1 and c.block_k * c.split_k == 4096]
    assert {(c.block_n, c.block_k, c.split_k, c.reduce_each) for c in whole} >= {
        (16, 512, 8, False),
        (16, 512, 8, True),
        (8, 1024, 4, True),
    }


def test_16_bit_weights_are_tuned_against_the_16_bit_gemm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """W16A16: `tune_w16a16` times the same candidates against `F.linear` on the weight in
    its own dtype, under its own baseline name; `choose_w16a16` serves only measured shapes
    and buckets (no untuned default, unlike the FP8 path's `choose`)."""
    _, graphs = _fakes(monkeypatch, pdl=False, buckets=(1, 2))
    linear_calls: list[tuple[torch.dtype, torch.dtype]] = []

    def fake_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        linear_calls.append((x.dtype, w.dtype))
        return x[:, :1]

    monkeypatch.setattr(w8.F, "linear", fake_linear)
    weight = torch.zeros(N, K, dtype=torch.bfloat16)
    choices = w8.tune_w16a16(weight, w8.unit_scale("cpu"))
    assert choices == {1: w8.candidates(1)[0], 2: w8.candidates(2)[0]}
    assert linear_calls and set(linear_calls) == {(torch.bfloat16, torch.bfloat16)}
    assert len(graphs) == 2 + len(w8.candidates(1)) + len(w8.candidates(2))  # baseline + each
    assert w8.tuning_log[-1]["baseline"] == w8.W16A16_BASELINE
    assert w8.choose_w16a16(1, N, K, torch.bfloat16) == w8.candidates(1)[0]
    assert w8.choose_w16a16(2, N, K, torch.bfloat16) == w8.candidates(2)[0]
    assert w8.choose_w16a16(3, N, K, torch.bfloat16) is None  # bucket 4: not measured
    assert w8.choose_w16a16(1, N, K, torch.float16) is None
    assert w8.choose_w16a16(1, 2 * N, K, torch.bfloat16) is None
    assert w8.choose(1, 2 * N, K, torch.bfloat16, "any") is not None  # FP8's untuned default
    assert w8.unit_scale("cpu").tolist() == [1.0]


def test_the_w16a16_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_W16A16", raising=False)
    assert w8.w16a16_setting() is True
    monkeypatch.setenv("TANDEM_W16A16", "off")
    assert w8.w16a16_setting() is False
    monkeypatch.setenv("TANDEM_W16A16", "tuned")
    assert w8.w16a16_setting() is True
    monkeypatch.setenv("TANDEM_W16A16", "on")
    with pytest.raises(ValueError, match="TANDEM_W16A16"):
        w8.w16a16_setting()


def test_the_unquantized_method_tunes_nothing_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the unquantized method keeps `F.linear` whatever the setting: no tuning, no
    lock buffer (`layer.w16a16` None)."""
    from torch import nn

    from tandem.layers.quantization.unquantized import UnquantizedLinearMethod

    monkeypatch.setenv("TANDEM_W16A16", "tuned")
    monkeypatch.setattr(w8, "tune_w16a16", lambda *a: pytest.fail("tuned on the CPU"))
    method = UnquantizedLinearMethod()
    layer = nn.Module()
    method.create_weights(layer, 8, [4], 8, 4, torch.bfloat16)
    layer.weight.data.normal_()
    method.process_weights_after_loading(layer)
    assert layer.w16a16 is None
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(method.apply(layer, x), torch.nn.functional.linear(x, layer.weight))
