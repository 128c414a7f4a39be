"""`tandem bench serve`'s clients against a real server of known timing: the stream server
in its own process, over real gRPC and real HTTP on 127.0.0.1. The figures must match the
server's schedule (TTFT about ttft_ms, one message per step), whatever the backend or the
number of client processes; the CPU figure must be present and sane."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem_services.bench.client import Target, run_load
from tandem_services.bench.metrics import summarize
from tandem_services.bench.stream_server import Schedule, StreamServerProcess
from tandem_services.bench.workload import random_workload

STEP_MS, TTFT_MS = 20.0, 100.0
# Slack for a loaded test machine: a late timer moves a message later, never earlier.
SLACK_MS = 60.0


def _warm(server: StreamServerProcess) -> StreamServerProcess:
    """One request per backend first: a fresh server's first call pays its lazy set-up."""
    wl = random_workload(1, 8, 2, 0.0, 1000, seed=0)
    for backend in ("grpc", "http"):
        assert run_load(Target(backend, _address(server, backend)), wl, math.inf).results[0].ok
    return server


@pytest.fixture(scope="module")
def server() -> Iterator[StreamServerProcess]:
    with StreamServerProcess(Schedule(step_ms=STEP_MS, ttft_ms=TTFT_MS)) as s:
        yield _warm(s)


@pytest.fixture(scope="module")
def batched_server() -> Iterator[StreamServerProcess]:
    with StreamServerProcess(Schedule(step_ms=STEP_MS, ttft_ms=TTFT_MS, tokens_per_step=4)) as s:
        yield _warm(s)


def _address(server: StreamServerProcess, backend: str) -> str:
    return server.grpc_address if backend == "grpc" else server.http_url


def _check_schedule(s: dict[str, float], tpot_ms: float = STEP_MS) -> None:
    """TTFT, ITL and TPOT medians where the schedule puts them (late, never early)."""
    assert TTFT_MS <= s["median_ttft_ms"] <= TTFT_MS + STEP_MS + SLACK_MS
    assert 0.8 * STEP_MS <= s["median_itl_ms"] <= STEP_MS + SLACK_MS / 3
    assert 0.8 * tpot_ms <= s["median_tpot_ms"] <= tpot_ms + SLACK_MS / 3


@pytest.mark.parametrize("backend", ["grpc", "http"])
def test_figures_follow_the_servers_schedule(server: StreamServerProcess, backend: str) -> None:
    wl = random_workload(8, 64, 12, 0.5, 1000, seed=1)
    run = run_load(Target(backend, _address(server, backend)), wl, math.inf)
    s = summarize(run.results, run.duration_s, client_cpu=run.cpu)
    assert s["completed"] == 8, s["errors"]
    assert [r.output_len for r in run.results] == wl.output_lens
    # One message per token: (n - 1) gaps per request.
    assert all(len(r.itl_s) == r.output_len - 1 for r in run.results)
    _check_schedule(s)
    # E2E: TTFT plus one step per further token.
    for r, n in zip(run.results, wl.output_lens, strict=True):
        assert r.e2e_s * 1000 >= TTFT_MS + (n - 1) * STEP_MS * 0.8
    assert 0 < s["client_cores_used"] < (os.cpu_count() or 1)
    assert s["client_cpu_s"] > 0 and s["num_client_procs"] == 1


@pytest.mark.parametrize("backend", ["grpc", "http"])
def test_several_tokens_per_message(batched_server: StreamServerProcess, backend: str) -> None:
    wl = random_workload(4, 32, 12, 0.0, 1000, seed=2)
    run = run_load(Target(backend, _address(batched_server, backend)), wl, math.inf)
    s = summarize(run.results, run.duration_s, client_cpu=run.cpu)
    assert s["completed"] == 4, s["errors"]
    # Three messages of 4 tokens: 2 gaps of one step each; TPOT spreads them over 11 tokens.
    assert all(r.output_len == 12 and len(r.itl_s) == 2 for r in run.results)
    _check_schedule(s, tpot_ms=2 * STEP_MS / 11)


@pytest.mark.parametrize("backend", ["grpc", "http"])
def test_client_processes_merge_to_the_same_run(server: StreamServerProcess, backend: str) -> None:
    wl = random_workload(9, 64, 10, 0.5, 1000, seed=3)
    target = Target(backend, _address(server, backend))
    one = run_load(target, wl, 40.0, seed=5)
    three = run_load(target, wl, 40.0, seed=5, num_procs=3)
    s1 = summarize(one.results, one.duration_s, client_cpu=one.cpu)
    s3 = summarize(three.results, three.duration_s, client_cpu=three.cpu)
    assert s1["completed"] == s3["completed"] == 9, (s1["errors"], s3["errors"])
    # Request i's result comes back in place i, whichever process sent it.
    assert [r.prompt_len for r in three.results] == [len(p) for p in wl.prompts]
    assert [r.output_len for r in three.results] == wl.output_lens
    assert s1["total_output_tokens"] == s3["total_output_tokens"] == sum(wl.output_lens)
    _check_schedule(s1)
    _check_schedule(s3)
    assert abs(s1["median_tpot_ms"] - s3["median_tpot_ms"]) < SLACK_MS / 3
    assert abs(s1["median_ttft_ms"] - s3["median_ttft_ms"]) < STEP_MS + SLACK_MS
    # Same arrival schedule: the runs last about as long.
    assert abs(one.duration_s - three.duration_s) < 0.5
    assert three.cpu.num_procs == 3 and len(three.cpu.per_proc_cpu_s) == 3
    assert all(c > 0 for c in three.cpu.per_proc_cpu_s)
    assert 0 < s3["client_cores_used"] < 3 * (os.cpu_count() or 1)


def test_http_error_status_is_an_error(server: StreamServerProcess) -> None:
    wl = random_workload(1, 8, 2, 0.0, 1000, seed=0)
    run = run_load(Target("http", server.http_url + "/nowhere"), wl, math.inf)
    assert not run.results[0].ok
    assert run.results[0].error


def test_bench_serve_cli_reports_client_cpu(server: StreamServerProcess, tmp_path: Path) -> None:
    from tandem_services.bench.serve import main

    argv = [
        "--url",
        server.grpc_address,
        "--dataset-name",
        "random",
        "--random-input-len",
        "40",
        "--random-range-ratio",
        "0.5",
        "--random-output-len",
        "6",
        "--num-prompts",
        "6",
        "--request-rate",
        "30,inf",
        "--num-client-procs",
        "2",
        "--warmup",
        "1",
        "--out-dir",
        str(tmp_path),
        "--name",
        "cli",
        "--no-plots",
    ]
    assert main(argv) == 0
    report = json.loads((tmp_path / "cli.json").read_text())
    assert [r["rate"] for r in report["runs"]] == [30.0, math.inf]
    for run in report["runs"]:
        s = run["summary"]
        assert s["completed"] == 6, s["errors"]
        assert s["num_client_procs"] == 2
        assert 0 < s["client_cores_used"] < 2 * (os.cpu_count() or 1)
        for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms"):
            assert s[key] > 0
        assert s["output_throughput"] > 0
        assert TTFT_MS <= s["median_ttft_ms"] <= TTFT_MS + STEP_MS + SLACK_MS
