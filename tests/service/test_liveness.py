"""Liveness that means something: an engine whose step loop stalls (made real with SIGSTOP of
the engine process) is noticed by its client, turns its worker's gRPC health NOT_SERVING and
the frontend's /health and /ready 503 (the scheduler drops the silent worker); SIGCONT brings
all of it back. And /metrics is served on the frontend's HTTP port; readiness needs a serving
worker for every role."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.core.outputs import EngineCoreOutput
from tandem.engine.core_client import AsyncMPClient
from tandem.engine.serial import Piggyback
from tandem.engine_args import EngineArgs
from tandem.request import EngineCoreRequest
from tandem.sampling_params import SamplingParams
from tandem_protos.v1 import common_pb2, scheduler_pb2
from tandem_services.frontend.health import readiness
from tandem_services.launcher import Deployment, ServeConfig, start_deployment

from .conftest import GRACE_S, SCHEDULER_ARGS, WORKER_ARGS, wait_until

pytestmark = pytest.mark.timeout(600)

STALL_TIMEOUT_S = 2.0


def test_client_tells_a_stalled_engine_from_a_busy_or_idle_one(smollm2_path: Path) -> None:
    """Idle or stepping: never stalled. SIGSTOPped with a request running: stalled within the
    timeout (plus a probe period); SIGCONT: running again, and the request completes."""

    async def run() -> None:
        calls: list[tuple[bool, float]] = []
        finished: list[EngineCoreOutput] = []

        def on_step(outputs: list[EngineCoreOutput], pig: Piggyback) -> None:
            finished.extend(o for o in outputs if o.finished)

        config = EngineArgs(
            model=str(smollm2_path), dtype="float32", device="cpu", num_gpu_blocks=64,
            max_model_len=512, num_threads=1,
        ).create_engine_config()  # fmt: skip
        client = AsyncMPClient(
            config,
            on_step,
            stall_timeout_s=STALL_TIMEOUT_S,
            on_stall=lambda s: calls.append((s, time.monotonic())),
        )
        info = await client.start()
        try:
            await asyncio.sleep(STALL_TIMEOUT_S * 2)  # idle
            params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
            await client.add_request(EngineCoreRequest("long", list(range(10, 40)), params))
            await asyncio.sleep(0.5)  # stepping
            assert not client.stalled and calls == []
            os.kill(info.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            while not client.stalled:
                assert time.monotonic() - stopped < STALL_TIMEOUT_S + 5, "stall not noticed"
                await asyncio.sleep(0.05)
            assert [s for s, _ in calls] == [True]
            assert calls[0][1] - stopped >= STALL_TIMEOUT_S - 1.0
            assert client.alive  # stalled is not dead
            os.kill(info.pid, signal.SIGCONT)
            while client.stalled:
                assert time.monotonic() - stopped < STALL_TIMEOUT_S + 15, "no recovery"
                await asyncio.sleep(0.05)
            assert [s for s, _ in calls] == [True, False]
            while not finished:
                await asyncio.sleep(0.05)
            assert finished[0].request_id == "long"
        finally:
            os.kill(info.pid, signal.SIGCONT)
            await client.shutdown()

    asyncio.run(run())


@pytest.fixture(scope="module")
def unified(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    config = ServeConfig(
        http_port=0,
        grpc_port=0,
        unified=True,
        worker_args=(*WORKER_ARGS, "--engine-stall-timeout-s", str(STALL_TIMEOUT_S)),
        scheduler_args=SCHEDULER_ARGS,
        grace_period_s=GRACE_S,
        log_dir=str(tmp_path_factory.mktemp("liveness")),
        startup_timeout_s=300.0,
    )
    dep = start_deployment(config)
    try:
        yield dep
    finally:
        with_engine = dep.services["unified"].info.get("engine_pid")
        if with_engine:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(with_engine), signal.SIGCONT)
        dep.stop(timeout_s=GRACE_S + 10)


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    return reply.status


def _complete(http: httpx.Client, base: str) -> httpx.Response:
    body = {"prompt": "Hello, my name is", "max_tokens": 4, "temperature": 0}
    return http.post(f"{base}/v1/completions", json=body)


def test_metrics_on_the_http_port(unified: Deployment) -> None:
    base = f"http://{unified.http_address}"
    with httpx.Client(timeout=120) as http:
        assert _complete(http, base).status_code == 200
        r = http.get(f"{base}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'tandem_requests_total{outcome="success"}' in r.text
    assert "tandem_request_time_to_first_token_seconds_bucket" in r.text


def test_a_stalled_engine_turns_worker_and_frontend_health_off_then_on(
    unified: Deployment,
) -> None:
    base = f"http://{unified.http_address}"
    worker = unified.address("unified")
    engine_pid = int(unified.services["unified"].info["engine_pid"])
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        (health_pb2.HealthCheckResponse.NOT_SERVING),
    )
    with httpx.Client(timeout=30) as http:
        for path in ("/health", "/ready"):
            r = http.get(base + path)
            assert r.status_code == 200, r.text
            assert r.json()["workers"] == {"prefill": 0, "decode": 0, "unified": 1}
        assert _health(worker) == serving

        os.kill(engine_pid, signal.SIGSTOP)
        try:
            wait_until(lambda: _health(worker) == not_serving, STALL_TIMEOUT_S + 8, "NOT_SERVING")
            # The worker stops reporting; the scheduler drops it (dead_after_s 3).
            wait_until(lambda: http.get(base + "/ready").status_code == 503, 20, "/ready 503")
            wait_until(lambda: http.get(base + "/health").status_code == 503, 10, "/health 503")
            body = http.get(base + "/ready").json()
            assert body["workers"]["unified"] == 0 and "no serving worker" in body["status"]
        finally:
            os.kill(engine_pid, signal.SIGCONT)
        wait_until(lambda: _health(worker) == serving, 15, "SERVING again")
        wait_until(lambda: http.get(base + "/ready").status_code == 200, 30, "/ready 200 again")
        assert http.get(base + "/health").status_code == 200
        r = _complete(http, base)
        assert r.status_code == 200, r.text


def test_readiness_needs_a_serving_worker_for_every_role() -> None:
    """A request needs a unified worker, or a prefill and a decode worker; a draining worker
    does not count (what /health and /ready answer, from the scheduler's worker list)."""

    def info(role: int, draining: bool = False) -> scheduler_pb2.WorkerInfo:
        return scheduler_pb2.WorkerInfo(role=role, draining=draining)

    prefill, decode, unified = (
        common_pb2.WORKER_ROLE_PREFILL,
        common_pb2.WORKER_ROLE_DECODE,
        common_pb2.WORKER_ROLE_UNIFIED,
    )
    assert not readiness([]).ok
    assert not readiness([info(prefill), info(prefill)]).ok  # no decode worker
    assert not readiness([info(decode)]).ok
    assert not readiness([info(prefill), info(decode, draining=True)]).ok
    r = readiness([info(prefill), info(decode, draining=True)])
    assert r.workers == {"prefill": 1, "decode": 0, "unified": 0}
    assert r.status == "no serving worker for every role"
    assert readiness([info(prefill), info(decode)]).ok
    assert readiness([info(unified)]).ok
    assert not readiness([info(unified)], draining=True).ok
    assert readiness([info(unified)], draining=True).status == "draining"
    assert not readiness([info(unified)], scheduler_error="UNAVAILABLE").ok
