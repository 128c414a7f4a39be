"""How the W8A16 tuner times its candidates (tandem_kernels.fp8_w8a16.tune_w8a16), on the CPU
with the kernels and the clock replaced: with PDL each call is timed after the short kernel a
decode step runs before it (`chain_lead`), the scaled-GEMM baseline too, and the lead alone;
without PDL, or with TANDEM_W8A16_TIMING=alone, the calls run back to back."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from tandem_kernels import fp8_w8a16 as w8

N, K = 1024, 1024  # 1 MiB of e4m3: the smallest weight the tuner measures


def _tune(monkeypatch: pytest.MonkeyPatch, pdl: bool) -> tuple[list[list[Any]], dict[str, Any]]:
    """Run the tuner at one bucket (one row) with fakes; returns each timed graph's launches
    and the log entry. A GEMV config's fake time is its index among the candidates (the first
    wins), the baseline's 1,000 us."""
    launches: list[Any] = []
    graphs: list[list[Any]] = []
    order = {c: i for i, c in enumerate(w8.candidates(1))}

    def fake_time_in_graph(runs: list[Any], reps: int = 8) -> float:
        start = len(launches)
        for run in runs:
            run()
        graphs.append(launches[start:])
        kinds = [event[0] for event in launches[start:]]
        if "gemv" in kinds:
            return float(order[launches[start + kinds.index("gemv")][1]])
        return 1000.0

    monkeypatch.setattr(w8, "M_BUCKETS", (1,))
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
    weight = torch.zeros(N, K, dtype=torch.float8_e4m3fn)
    scale = torch.ones((), dtype=torch.float32)
    choices = w8.tune_w8a16(
        weight, scale, torch.bfloat16, "test/chain", lambda x, w: launches.append(("base",))
    )
    assert choices == {1: w8.candidates(1)[0]}
    return graphs, w8.tuning_log[-1]


def test_with_pdl_every_call_is_timed_after_the_chain_lead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TANDEM_W8A16_TIMING", raising=False)
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


@pytest.mark.parametrize(("pdl", "flag"), [(False, ""), (True, "alone")])
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
