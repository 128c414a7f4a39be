"""benchmarks/serve_offline.py on the CPU: the offline engine on a served run's requests, with
its step timeline (which wraps the scheduler's `schedule`, whatever arguments the engine
passes it), under async scheduling (the timeline's one-step lag) and without."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks import serve_offline
from tandem.engine.core import EngineCore
from tandem.engine_args import EngineArgs
from tandem_services.bench.serve import thread_affinity_kept


@pytest.mark.parametrize("async_scheduling", ["on", "off"])
def test_timeline_accounts_for_every_prompt_token(
    tiny_model_path: Callable[[str], Path], tmp_path: Path, async_scheduling: str
) -> None:
    out = tmp_path / "offline.json"
    argv = [
        "--model", str(tiny_model_path("llama")), "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "256", "--num-gpu-blocks", "128",
        "--async-scheduling", async_scheduling,
        "--num-prompts", "6", "--input-len", "40", "--output-len", "6", "--range-ratio", "0.5",
        "--request-rate", "inf,50", "--seeds", "1,2", "--warmup", "1", "--timeline",
        "--out", str(out),
    ]  # fmt: skip
    assert serve_offline.main(argv) == 0
    report = json.loads(out.read_text())
    assert [run["rate"] for run in report["runs"]] == [float("inf"), 50.0]
    for run in report["runs"]:
        assert run["summary"]["completed"] == 6
        steps = run["steps"]
        assert any(name.startswith("mixed") for name in steps)
        assert any(name.startswith("decode") for name in steps)
        # The served budget (8,192) takes each prompt whole and the last steps (the ones the
        # timeline cannot time) only decode: every prompt token is in a timed step's plan.
        prefill = sum(kd["prefill"] for kd in steps.values())
        assert prefill == run["workload"]["prompt_tokens"]
        assert all(kd["ms"] > 0 for kd in steps.values())
        # The phases split the same timed steps: together, every step's time.
        phases = run["phases"]
        total_s = sum(kd["ms"] for kd in steps.values()) / 1e3
        assert phases["prefill_s"] + phases["tail_s"] == pytest.approx(total_s, rel=1e-6)
        assert phases["prefill_s"] > 0 and phases["tail_steps"] >= 0
        decode_only = sum(kd["steps"] for name, kd in steps.items() if name.startswith("decode"))
        assert phases["tail_steps"] <= decode_only


def test_the_offline_comparison_gives_the_client_thread_its_cores_back(
    tiny_model_path: Callable[[str], Path],
) -> None:
    """`tandem bench serve --compare-offline --cpu-cores N` steps a CPU engine on its own
    thread, which binds that thread to core N; the load that follows must not run there too
    (beside the served engine bound to the same core)."""
    before = os.sched_getaffinity(0)
    core = max(before)
    config = EngineArgs(
        model=str(tiny_model_path("llama")), device="cpu", dtype="float32",
        max_model_len=128, num_gpu_blocks=16, cpu_cores=str(core),
    ).create_engine_config()  # fmt: skip
    with thread_affinity_kept():
        engine = EngineCore(config)
        bound = os.sched_getaffinity(0)
        engine.shutdown()
    assert bound == {core}  # the engine did bind this thread
    assert os.sched_getaffinity(0) == before
