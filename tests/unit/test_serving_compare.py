"""benchmarks.serving compare: goodput recomputed from per-request latencies, limits taken
from the unified run at its lowest rate."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks.serving import _round_up, auto_goodput_limits, compare, compare_main


def _run(rate: float, lat: list[list[float]], duration_s: float) -> dict[str, Any]:
    stats = {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    return {
        "system": "x",
        "rate": rate,
        "request_latencies_ms": lat,
        "summary": {
            "num_ok": len(lat),
            "duration_s": duration_s,
            "output_token_throughput": 100.0 * len(lat) / duration_s,
            "goodput": len(lat) / duration_s,
            "ttft_ms": stats,
            "tpot_ms": stats,
            "e2e_ms": stats,
        },
    }


def _report(runs: list[dict[str, Any]], **args: Any) -> dict[str, Any]:
    return {"workload": {"num_prompts": 4}, "args": {"model": "m", **args}, "runs": runs}


UNIFIED = _report(
    [
        _run(2.0, [[100.0, 8.0], [120.0, 8.5], [180.0, 9.0], [150.0, 8.2]], 2.0),
        _run(math.inf, [[900.0, 20.0], [100.0, 8.0], [150.0, 15.0], [170.0, 9.0]], 1.0),
    ],
    num_unified_workers=2,
    gpus=[0, 1],
)
DISAGG = _report(
    [
        _run(2.0, [[130.0, 7.0], [140.0, 7.0], [160.0, 7.1], [170.0, 7.2]], 2.0),
        _run(math.inf, [[300.0, 7.5], [175.0, 7.0], [150.0, 9.5], [185.0, 9.1]], 1.0),
    ],
    gpus=[0, 1],
)


def test_round_up_two_significant_digits() -> None:
    assert _round_up(437.2) == 440.0
    assert _round_up(8.13) == 8.2
    assert _round_up(180.0) == 180.0
    assert _round_up(0.0) == 0.0


def test_auto_limits_from_the_lowest_rate() -> None:
    limits = auto_goodput_limits(UNIFIED)
    # p99 of 4 samples: 3% of the way from the 3rd to the 4th sorted value.
    assert limits["ttft_ms"] == _round_up(150.0 + 0.97 * 30.0) == 180.0
    assert limits["tpot_ms"] == _round_up(8.5 + 0.97 * 0.5) == 9.0
    assert "2.0 req/s" in limits["source"]


def test_compare_recomputes_goodput_under_the_limits() -> None:
    limits = {"ttft_ms": 180.0, "tpot_ms": 9.0}
    result = compare(json.loads(json.dumps(DISAGG)), json.loads(json.dumps(UNIFIED)), limits)
    low, high = result["by_rate"]["2"], result["by_rate"]["inf"]
    assert low["goodput"]["unified"] == pytest.approx(4 / 2.0)
    assert low["goodput"]["disaggregated"] == pytest.approx(4 / 2.0)
    assert high["goodput"]["unified"] == pytest.approx(2 / 1.0)  # 900 ms, 15 ms/token out
    assert high["goodput"]["disaggregated"] == pytest.approx(1 / 1.0)  # 175 ms, 7 ms
    assert high["goodput"]["ratio"] == pytest.approx(0.5)
    assert result["goodput_limits"] == limits
    assert result["systems"]["unified"]["num_unified_workers"] == 2


def test_compare_main_writes_json(tmp_path: Path) -> None:
    d, u = tmp_path / "d.json", tmp_path / "u.json"
    d.write_text(json.dumps(DISAGG))
    u.write_text(json.dumps(UNIFIED))
    out = tmp_path / "cmp.json"
    assert compare_main([str(d), str(u), "--goodput-auto", "--out", str(out), "--no-plot"]) == 0
    result = json.loads(out.read_text())
    assert result["goodput_limits"]["ttft_ms"] == 180.0
    assert set(result["by_rate"]) == {"2", "inf"}


def test_different_workloads_are_refused() -> None:
    other = json.loads(json.dumps(UNIFIED))
    other["workload"] = {"num_prompts": 5}
    with pytest.raises(ValueError, match="different workloads"):
        compare(DISAGG, other)
