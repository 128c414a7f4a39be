"""benchmarks/serving_report.py sets a served run beside the vLLM figures of the issue whose
load it ran: fresh prompts per rate (issue 30) unless told the prompts were the same at every
rate (issue 14)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import serving_report


def _results(folder: Path) -> Path:
    """One served run ("unified") at 5 req/s and all at once, as gpu_issue14.sh leaves it."""
    folder.mkdir()
    (folder / "unified_startup.json").write_text(json.dumps({"name": "unified", "startup_s": 9}))
    for rate, tpot in (("5", 5.5), ("inf", 17.0)):
        summary = {
            "ttft_ms": {"p50": 40.0, "p99": 90.0},
            "tpot_ms": {"p50": tpot, "p99": tpot + 1},
            "output_token_throughput": 900.0,
        }
        run = {"system": "serve/http", "summary": summary}
        (folder / f"unified_{rate}.json").write_text(json.dumps({"runs": [run]}))
    return folder


@pytest.mark.parametrize(
    ("flags", "row_5", "row_inf", "workload"),
    [
        (
            [],
            "| vLLM, H200 (issue 30) | 5 | - | 116 | 6.11 | - | - | |",
            "| vLLM, H200 (issue 30) | inf | - | 3820 | 18.93 | - | 4539 | |",
            "issue 30, fresh prompts per rate",
        ),
        (
            ["--same-prompts"],
            "| vLLM, H200 (issue 14) | 5 | 53 | 106 | 6.04 | 7.47 | - | |",
            None,
            "issue 14, same prompts every rate",
        ),
    ],
)
def test_the_vllm_rows_follow_the_load(tmp_path, capsys, flags, row_5, row_inf, workload):
    res = _results(tmp_path / "results")
    out = tmp_path / "merged.json"
    assert serving_report.main([str(res), str(out), *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[lines.index(next(ln for ln in lines if ln.startswith("| unified | 5 "))) + 1] == (
        row_5
    )
    vllm_inf = [ln for ln in lines if ln.startswith("| vLLM") and "| inf |" in ln]
    assert vllm_inf == ([row_inf] if row_inf else [])
    merged = json.loads(out.read_text())
    assert merged["vllm_h200"]["workload"] == workload
    assert merged["served"]["unified"]["rates"]["5"]["summary"]["tpot_ms"]["p50"] == 5.5
