"""The compose topology without Docker: compose.yaml + compose.cpu.yaml, read as compose
reads them, started as local processes on 127.0.0.1 through the image's entry point (a real
Redis from the tests' fixture, the scheduler, two prefill and two decode replicas, the
frontend), then driven through the frontend's OpenAI HTTP API.

Each worker runs one intra-op thread (WORKER_THREADS=1): several engines on two cores thrash
with more. The tests share one topology and run in file order: load, then a decode replica
stopped under load, then one started under load, then one drained the Kubernetes way
(preStop `drain`, then SIGTERM).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem_protos.v1 import (
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.deploy.compose_local import CPU_COMPOSE_FILES, ROOT, LocalService, local_service
from tests.ports import free_port
from tests.redis_server import RedisServer

ENV = {
    "MODEL": "default",
    "DEVICE": "cpu",
    "WORKER_THREADS": "1",
    "MAX_MODEL_LEN": "2048",
    "NUM_GPU_BLOCKS": "256",
    "PREFILL_REPLICAS": "2",
    "DECODE_REPLICAS": "2",
    "REPORT_INTERVAL_S": "0.2",
    "GRACE_PERIOD_S": "15",
}
STARTUP_S = 300.0
PROMPTS = [
    "The capital of France is",
    "Hello, my name is",
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The quick brown fox",
    "Water boils at a temperature of",
    "My favourite programming language is",
]
# Longer than one KV block (16 tokens), for prefix cache hits.
SHARED_PREFIX = (
    "You are a careful assistant. Answer briefly and precisely, in one sentence, and never "
    "make anything up. Question: "
)


@dataclass
class Proc:
    service: str
    replica: int
    local: LocalService
    process: subprocess.Popen[bytes]
    log_path: Path
    ports: dict[str, int]

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    @property
    def grpc_address(self) -> str:
        return self.local.healthcheck[-1]

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['METRICS_PORT']}/metrics"


@dataclass
class Topology:
    workdir: Path
    redis: RedisServer
    scheduler_port: int = field(default_factory=free_port)
    procs: list[Proc] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        return {
            **ENV,
            "SCHEDULER_PORT": str(self.scheduler_port),
            "REDIS_PORT": str(self.redis.port),
            "WORKER_PORT": str(free_port()),
            "METRICS_PORT": str(free_port()),
            "FRONTEND_HTTP_PORT": str(free_port()),
            "FRONTEND_GRPC_PORT": str(free_port()),
        }

    def start(self, service: str, replica: int) -> Proc:
        env = self.env()
        local = local_service(CPU_COMPOSE_FILES, service, replica, env)
        log_path = self.workdir / f"{service}-{replica}.log"
        proc_env = {
            **os.environ,
            **local.env,
            "PYTHONPATH": str(ROOT),
            "TANDEM_GPU_SLOT_DIR": str(self.workdir / "gpu-slots"),
        }
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                local.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=proc_env,
                cwd=ROOT,
                start_new_session=True,
            )
        ports = {k: int(v) for k, v in env.items() if k.endswith("_PORT")}
        proc = Proc(service, replica, local, process, log_path, ports)
        self.procs.append(proc)
        return proc

    def replicas(self, service: str) -> int:
        from tests.deploy.compose_local import load_compose

        return int(
            load_compose(CPU_COMPOSE_FILES, self.env())["services"][service]["deploy"]["replicas"]
        )

    def alive(self, service: str) -> list[Proc]:
        return [p for p in self.procs if p.service == service and p.process.poll() is None]

    def one(self, service: str) -> Proc:
        (proc,) = self.alive(service)
        return proc

    def wait_healthy(self, procs: list[Proc], timeout_s: float = STARTUP_S) -> None:
        """Run each one's compose health check until it passes."""
        deadline = time.monotonic() + timeout_s
        pending = list(procs)
        while pending:
            for p in list(pending):
                if p.process.poll() is not None:
                    raise AssertionError(
                        f"{p.service}-{p.replica} exited ({p.process.returncode}):\n" + p.log_tail()
                    )
                check = subprocess.run(p.local.healthcheck, capture_output=True, timeout=60)
                if check.returncode == 0:
                    pending.remove(p)
            if pending and time.monotonic() > deadline:
                raise AssertionError(f"not healthy in time: {[p.service for p in pending]}")
            time.sleep(0.5)

    def stop_all(self) -> dict[str, int]:
        codes = {}
        order = ("frontend", "prefill", "decode", "scheduler")
        for service in order:
            for p in self.procs:
                if p.service == service and p.process.poll() is None:
                    p.process.send_signal(signal.SIGTERM)
            for p in self.procs:
                if p.service != service:
                    continue
                try:
                    p.process.wait(timeout=40)
                except subprocess.TimeoutExpired:
                    p.process.kill()
                    p.process.wait()
                codes[f"{p.service}-{p.replica}"] = p.process.returncode
        return codes

    # ------------------------------------------------------------------ observations

    def workers(self) -> list[scheduler_pb2.WorkerInfo]:
        with grpc.insecure_channel(f"127.0.0.1:{self.scheduler_port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            return list(stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=30).workers)

    def worker_id(self, proc: Proc) -> str:
        return next(w.worker_id for w in self.workers() if w.address == proc.grpc_address)

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.one('frontend').ports['FRONTEND_HTTP_PORT']}"


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.1)


def registered(topo: Topology, role: int) -> int:
    return sum(1 for w in topo.workers() if w.role == role and not w.draining)


def scrape(proc: Proc) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one process's /metrics, parsed by prometheus-client's parser."""
    text = httpx.get(proc.metrics_url, timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: dict[Any, float], name: str) -> float:
    """`name`'s samples summed over every label set."""
    return sum(v for (n, _), v in samples.items() if n == name)


def worker_stats(proc: Proc) -> common_pb2.WorkerStats:
    with grpc.insecure_channel(proc.grpc_address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=30)


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Topology]:
    topology = Topology(tmp_path_factory.mktemp("compose"), redis_server)
    try:
        scheduler = topology.start("scheduler", 0)
        topology.wait_healthy([scheduler], 60)
        workers = [
            topology.start(role, i)
            for role in ("prefill", "decode")
            for i in range(topology.replicas(role))
        ]
        frontend = topology.start("frontend", 0)
        topology.wait_healthy([*workers, frontend])
        wait_until(
            lambda: (
                registered(topology, common_pb2.WORKER_ROLE_PREFILL) == 2
                and registered(topology, common_pb2.WORKER_ROLE_DECODE) == 2
            ),
            60,
            "two prefill and two decode workers registered",
        )
        yield topology
    finally:
        codes = topology.stop_all()
        bad = {k: v for k, v in codes.items() if v != 0}
        for p in topology.procs:
            if f"{p.service}-{p.replica}" in bad:
                print(f"---- {p.service}-{p.replica} (exit {p.process.returncode}) ----")
                print(p.log_tail())
    # Every service stops cleanly on SIGTERM (drains, exits 0).
    assert not bad, f"unclean exits: {bad}"


# ----------------------------------------------------------------------------- load


@dataclass
class Result:
    status: int
    text: str
    finish_reason: str | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.finish_reason in ("length", "stop")


async def complete(
    client: httpx.AsyncClient,
    base: str,
    prompt: str,
    max_tokens: int,
    stream: bool,
    on_first: Callable[[], None] | None = None,
) -> Result:
    body = {
        "model": "default",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    url = f"{base}/v1/completions"
    if not stream:
        r = await client.post(url, json=body)
        if r.status_code != 200:
            return Result(r.status_code, "", None, r.text)
        choice = r.json()["choices"][0]
        return Result(200, choice["text"], choice["finish_reason"])
    text, finish, error = "", None, ""
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            return Result(r.status_code, "", None, (await r.aread()).decode())
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = json.dumps(event["error"])
                continue
            for choice in event["choices"]:
                if choice["text"] and not text and on_first is not None:
                    on_first()
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    return Result(200, text, finish, error)


async def run_load(
    base: str,
    prompts: list[str],
    max_tokens: int,
    concurrency: int,
    on_first: Callable[[], None] | None = None,
) -> list[Result]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:

        async def one(i: int, prompt: str) -> Result:
            async with limit:
                return await complete(client, base, prompt, max_tokens, i % 2 == 0, on_first)

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def assert_all_ok(results: list[Result]) -> None:
    failed = [r for r in results if not r.ok]
    assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:3]}"
    assert all(r.text for r in results)


class Background:
    """Load on its own thread (its own event loop) while the test does something else."""

    def __init__(self, base: str, prompts: list[str], max_tokens: int, concurrency: int) -> None:
        self.first_tokens = 0
        self.results: list[Result] = []
        self._lock = threading.Lock()

        def on_first() -> None:
            with self._lock:
                self.first_tokens += 1

        self._thread = threading.Thread(
            target=lambda: self.results.extend(
                asyncio.run(run_load(base, prompts, max_tokens, concurrency, on_first))
            ),
            daemon=True,
        )
        self._thread.start()

    def join(self, timeout_s: float = 300) -> list[Result]:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "load did not finish"
        return self.results


def prompts(n: int, tag: str) -> list[str]:
    return [f"{PROMPTS[i % len(PROMPTS)]} ({tag} {i})" for i in range(n)]


# ----------------------------------------------------------------------------- tests


def test_load_through_the_frontend_no_failures_and_every_metrics_endpoint_moves(
    topo: Topology,
) -> None:
    procs = [p for p in topo.procs if p.process.poll() is None]
    assert sorted(p.service for p in procs) == [
        "decode", "decode", "frontend", "prefill", "prefill", "scheduler",
    ]  # fmt: skip
    before = {id(p): scrape(p) for p in procs}
    n = 16
    results = asyncio.run(run_load(topo.http, prompts(n, "load"), 8, concurrency=8))
    assert_all_ok(results)
    # Repeats of one long prompt: the prefix cache hits.
    for _ in range(3):
        assert_all_ok(asyncio.run(run_load(topo.http, [SHARED_PREFIX + "What is 2+2?"], 4, 1)))
    n += 3
    after = {id(p): scrape(p) for p in procs}

    def delta(p: Proc, name: str, **labels: str) -> float:
        return value(after[id(p)], name, **labels) - value(before[id(p)], name, **labels)

    frontend = topo.one("frontend")
    assert delta(frontend, "tandem_requests_total", outcome="success") == n
    for hist in ("time_to_first_token", "time_per_output_token", "e2e_latency"):
        assert delta(frontend, f"tandem_request_{hist}_seconds_count") == n, hist
    assert delta(frontend, "tandem_generation_tokens_total") >= n
    assert value(after[id(frontend)], "tandem_requests_running") == 0
    # The same under vLLM's names (dashboards, autoscalers and gateways written for vLLM).
    front_before, front_after = before[id(frontend)], after[id(frontend)]

    def vllm_delta(samples_after: Any, samples_before: Any, name: str) -> float:
        return total(samples_after, name) - total(samples_before, name)

    for name, want in (
        ("vllm:request_success_total", n),
        ("vllm:time_to_first_token_seconds_count", n),
        ("vllm:e2e_request_latency_seconds_count", n),
        ("vllm:generation_tokens_total", delta(frontend, "tandem_generation_tokens_total")),
        ("vllm:prompt_tokens_total", delta(frontend, "tandem_prompt_tokens_total")),
    ):
        assert vllm_delta(front_after, front_before, name) == want, name
    assert {dict(k)["model_name"] for n_, k in front_after if n_.startswith("vllm:")} == {
        ENV["MODEL"]
    }

    scheduler = topo.one("scheduler")
    assert delta(scheduler, "tandem_scheduler_requests_total", outcome="dispatched") == n
    assert delta(scheduler, "tandem_scheduler_queue_time_seconds_count") == n
    assert (
        value(after[id(scheduler)], "tandem_scheduler_workers", role="decode", state="ready") == 2
    )

    hits = 0.0
    for p in topo.alive("prefill"):
        role = {"role": "prefill"}
        sent = {**role, "direction": "sent", "transport": "tcp"}
        assert delta(p, "tandem_worker_engine_steps_total", **role) > 0, "every prefill worker"
        assert delta(p, "tandem_kv_transfer_bytes_total", **sent) > 0
        assert delta(p, "tandem_kv_transfer_duration_seconds_count", **sent) > 0
        hits += delta(p, "tandem_worker_prefix_cache_hit_tokens_total", **role)
        # The prefill autoscaling signal is exported.
        assert ("tandem_worker_pending_prefill_tokens", (("role", "prefill"),)) in after[id(p)]
    assert hits >= 16, "a repeated prompt found its blocks in the prefix cache"
    vllm_hits = sum(
        total(after[id(p)], "vllm:prefix_cache_hits_total")
        - total(before[id(p)], "vllm:prefix_cache_hits_total")
        for p in topo.alive("prefill")
    )
    assert vllm_hits == hits
    for p in topo.alive("decode"):
        role = {"role": "decode"}
        received = {**role, "direction": "received", "transport": "tcp"}
        assert delta(p, "tandem_worker_generated_tokens_total", **role) > 0, "every decode worker"
        assert delta(p, "tandem_kv_transfer_bytes_total", **received) > 0
        assert delta(p, "tandem_kv_transfer_duration_seconds_count", **received) > 0
        for signal_name in ("tandem_worker_kv_cache_usage_ratio", "tandem_worker_running_requests"):
            assert (signal_name, (("role", "decode"),)) in after[id(p)]
        for signal_name in (
            "vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"
        ):  # fmt: skip
            assert any(name == signal_name for name, _ in after[id(p)]), signal_name
    # After the load every block is free again (no leaks across the hand-off).
    for p in [*topo.alive("prefill"), *topo.alive("decode")]:
        wait_until(
            lambda p=p: (
                (s := worker_stats(p)).num_inflight == 0 and s.num_free_blocks == s.num_blocks
            ),
            20,
            f"{p.service}-{p.replica}'s pool to be whole",
        )
        samples = scrape(p)
        assert value(samples, "tandem_worker_kv_cache_blocks_used", role=p.service) == 0
        assert value(samples, "tandem_worker_kv_cache_blocks_free", role=p.service) == 256


def test_sigterm_to_a_decode_worker_under_load_fails_no_request(topo: Topology) -> None:
    victim = topo.alive("decode")[-1]
    load = Background(topo.http, prompts(12, "scale-down"), 24, concurrency=8)
    wait_until(lambda: load.first_tokens >= 4, 120, "streams under way")
    wait_until(lambda: worker_stats(victim).num_running > 0, 60, "the victim to be decoding")
    victim.process.send_signal(signal.SIGTERM)
    # Requests that arrive while it drains go elsewhere.
    late = asyncio.run(run_load(topo.http, prompts(4, "during-drain"), 8, concurrency=4))
    assert victim.process.wait(timeout=60) == 0, victim.log_tail()
    assert_all_ok(load.join())
    assert_all_ok(late)
    wait_until(
        lambda: registered(topo, common_pb2.WORKER_ROLE_DECODE) == 1, 30, "the worker to leave"
    )
    assert all(w.address != victim.grpc_address for w in topo.workers())


def test_a_decode_worker_started_mid_run_receives_requests(topo: Topology) -> None:
    assert len(topo.alive("decode")) == 1
    load = Background(topo.http, prompts(24, "scale-up"), 12, concurrency=4)
    new = topo.start("decode", 9)
    topo.wait_healthy([new])
    wait_until(
        lambda: any(w.address == new.grpc_address for w in topo.workers()), 60, "registration"
    )
    registered_at = time.monotonic()
    more = asyncio.run(run_load(topo.http, prompts(6, "after-join"), 8, concurrency=3))
    assert_all_ok(load.join())
    assert_all_ok(more)
    got = value(scrape(new), "tandem_worker_generated_tokens_total", role="decode")
    assert got > 0, "the new decode worker took requests"
    assert time.monotonic() - registered_at < 120


def test_prestop_drain_then_sigterm_under_load_fails_no_request(topo: Topology) -> None:
    """The Kubernetes way: preStop runs `entrypoint drain` (the scheduler stops routing to the
    pod; wait until it is idle), then SIGTERM."""
    old, new = sorted(topo.alive("decode"), key=lambda p: p.replica)
    assert new.replica == 9
    worker_id = topo.worker_id(old)
    load = Background(topo.http, prompts(12, "drain"), 24, concurrency=6)
    wait_until(lambda: load.first_tokens >= 3, 120, "streams under way")
    wait_until(lambda: worker_stats(old).num_running > 0, 60, "the old worker to be decoding")
    drain = subprocess.run(
        [
            *old.local.argv[:3],
            "drain",
            "--scheduler", f"127.0.0.1:{topo.scheduler_port}",
            "--worker", old.grpc_address,
            "--worker-id", worker_id,
            "--timeout-s", "120",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )  # fmt: skip
    assert drain.returncode == 0, drain.stderr
    # Drained: nothing in flight, and the scheduler routes nothing new to it.
    assert worker_stats(old).num_inflight == 0
    assert next(w for w in topo.workers() if w.worker_id == worker_id).draining
    steps = value(scrape(old), "tandem_worker_engine_steps_total", role="decode")
    after_drain = asyncio.run(run_load(topo.http, prompts(4, "after-drain"), 6, concurrency=4))
    assert_all_ok(after_drain)
    assert value(scrape(old), "tandem_worker_engine_steps_total", role="decode") == steps
    stats = worker_stats(old)
    assert stats.num_inflight == 0 and stats.num_free_blocks == stats.num_blocks
    t0 = time.monotonic()
    old.process.send_signal(signal.SIGTERM)
    assert old.process.wait(timeout=60) == 0, old.log_tail()
    assert time.monotonic() - t0 < 10, "an idle worker stops at once"
    assert_all_ok(load.join())
    wait_until(
        lambda: all(w.worker_id != worker_id for w in topo.workers()), 30, "the worker to leave"
    )
