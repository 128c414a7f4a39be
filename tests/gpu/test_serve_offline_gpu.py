"""benchmarks/serve_offline.py's step timeline on CUDA: each step timed by CUDA events around
its launch (device time), under async scheduling, on a random llama-3.2-1b in bf16.

    pytest -q -m gpu tests/gpu/test_serve_offline_gpu.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import serve_offline

pytestmark = pytest.mark.gpu


def test_device_timeline_times_every_step(tmp_path: Path) -> None:
    out = tmp_path / "offline.json"
    argv = [
        "--model", "random:llama-3.2-1b", "--device", "cuda", "--dtype", "bfloat16",
        "--max-model-len", "1024", "--gpu-memory-utilization", "0.3",
        "--num-prompts", "8", "--input-len", "400", "--output-len", "24", "--range-ratio", "0.25",
        "--request-rate", "inf,40", "--seeds", "1,2", "--warmup", "2", "--timeline",
        "--out", str(out),
    ]  # fmt: skip
    assert serve_offline.main(argv) == 0
    for run in json.loads(out.read_text())["runs"]:
        assert run["summary"]["completed"] == 8
        steps, phases = run["steps"], run["phases"]
        # Device-timed: every step is timed, so every prompt token is in a timed plan.
        assert sum(kd["prefill"] for kd in steps.values()) == run["workload"]["prompt_tokens"]
        assert all(kd["ms"] > 0 for kd in steps.values())
        device_s = sum(kd["ms"] for kd in steps.values()) / 1e3
        assert phases["prefill_s"] + phases["tail_s"] == pytest.approx(device_s, rel=1e-6)
        # The steps' device time and the idle between them fit in the run's wall time.
        assert phases["idle_s"] >= 0
        assert device_s + phases["idle_s"] <= run["summary"]["duration"] * 1.01
        # A step with hundreds of prompt rows takes the device longer than a decode step
        # of at most 8 rows.
        mixed = [kd["ms_per_step"] for name, kd in steps.items() if name.startswith("mixed")]
        decode = [kd["ms_per_step"] for name, kd in steps.items() if name.startswith("decode")]
        assert mixed and decode and min(mixed) > max(decode), steps
