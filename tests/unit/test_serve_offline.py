"""benchmarks/serve_offline.py on the CPU: the offline engine on a served run's requests, with
its step timeline (which wraps the scheduler's `schedule`, whatever arguments the engine
passes it), under async scheduling (the timeline's one-step lag) and without."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from benchmarks import serve_offline
from tandem.engine.core import EngineCore
from tandem.engine_args import EngineArgs
from tandem_services.bench.serve import ClientSlots, run_offline_at, thread_affinity_kept
from tandem_services.bench.workload import Workload


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
        assert "idle_s" not in phases  # only device-timed (CUDA events) timelines have it
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


def test_client_slots_send_at_arrival_or_when_a_slot_frees() -> None:
    """The offline loop takes a request only between engine steps, but its send time, from
    which TTFT counts, is its arrival time (the served client sends then), or, with every
    slot of `max_concurrency` taken, the end of an earlier request."""
    free = ClientSlots(start=0.0, max_concurrency=3)
    assert [free.send(a) for a in (0.0, 0.01, 0.02)] == [0.0, 0.01, 0.02]
    slots = ClientSlots(start=10.0, max_concurrency=1)
    assert slots.send(10.5) == 10.5  # taken later by the loop: still sent at its arrival
    slots.release(12.0)
    assert slots.send(11.0) == 12.0  # arrived while the only slot was taken
    slots.release(13.0)
    assert slots.send(20.0) == 20.0
    two = ClientSlots(start=0.0, max_concurrency=2)
    assert (two.send(1.0), two.send(1.0)) == (1.0, 1.0)
    two.release(5.0)
    two.release(6.0)
    assert (two.send(2.0), two.send(2.0)) == (5.0, 6.0)  # the slots in the order they freed


def test_offline_ttft_counts_from_arrival_not_from_the_loop_taking_it(
    tiny_model_path: Callable[[str], Path],
) -> None:
    """Requests that arrive while a step runs wait for it: their TTFT includes that wait.
    Steps here take at least 40 ms (each `step()` of a tiny CPU engine, slowed), requests
    arrive 10 ms apart, and the cap is off: every request's first token is at least one
    step after its arrival, and all but the first arrive inside a running step, so their
    TTFT exceeds a step by the rest of the step they arrived in."""
    config = EngineArgs(
        model=str(tiny_model_path("llama")), device="cpu", dtype="float32",
        max_model_len=128, num_gpu_blocks=64, async_scheduling="off",
    ).create_engine_config()  # fmt: skip
    engine = EngineCore(config)
    step = engine.step

    def slow_step() -> Any:
        t = time.perf_counter()
        out = step()
        time.sleep(max(0.0, 0.04 - (time.perf_counter() - t)))
        return out

    engine.step = slow_step  # type: ignore[method-assign]
    workload = Workload([[5 + i] * 8 for i in range(4)], [2] * 4)
    try:
        results, _ = run_offline_at(engine, workload, [0.0, 0.01, 0.02, 0.03])
    finally:
        engine.shutdown()
    ttfts = [r.ttft_s for r in results]
    assert all(t >= 0.04 for t in ttfts), ttfts
    # Requests 1-3 arrived 30, 20 and 10 ms before the first step ended; the loop took them
    # then and prefilled them in the next step: TTFT >= the rest of step 1 + step 2.
    for i in (1, 2, 3):
        assert ttfts[i] >= 0.04 + (0.04 - 0.01 * i) - 0.005, (i, ttfts)
