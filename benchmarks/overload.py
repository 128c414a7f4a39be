"""Overload: admitted requests' TTFT at capacity and at `--factor` x capacity, with the excess
refused at once.

One unified CPU worker runs at most `--max-num-seqs` requests; the scheduler hands it at most
that many (`--max-inflight-per-worker`) and queues at most `--max-queue-len` more, so the
deployment's capacity is their sum: that many requests at once are all admitted. Each round
sends a burst of simultaneous streamed completions (short prompt, `--max-tokens` greedy
tokens) over HTTP:

- at capacity: `capacity` requests, every one admitted;
- overload: `factor x capacity` requests; about `capacity` admitted, the rest answered 429
  with `Retry-After` (refusal latency measured).

Reported: admitted TTFT p50 / p99 per phase (client side: request sent -> first token), the
ratio of the overload p99 to the capacity p99, refusals and their latency, the services' RSS
(psutil, the engine process included) before and after the overload rounds, and whether the
queue and the block pools are empty afterwards.

    python -m benchmarks.overload                 # capacity 8 (4 running + 4 queued), 10x, 5 rounds
    python -m benchmarks.overload --rounds 10 --factor 20

Prints JSON and writes it under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PROMPT = "The capital of France is"
# Longer than a few load report intervals (0.25 s).
SETTLE_S = 1.0


@dataclass(frozen=True)
class OverloadSettings:
    max_num_seqs: int = 4
    max_queue_len: int = 4
    factor: int = 10
    max_tokens: int = 8
    rounds: int = 5

    @property
    def capacity(self) -> int:
        return self.max_num_seqs + self.max_queue_len


@dataclass
class Outcome:
    """One request of a burst: its status, when its answer (or first token) came."""

    status: int
    ttft_s: float = math.nan
    answer_s: float = math.nan
    retry_after: str | None = None
    tokens: int = 0


@dataclass
class Phase:
    outcomes: list[Outcome] = field(default_factory=list)

    def admitted(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 200]

    def refused(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 429]

    def summary(self) -> dict[str, Any]:
        admitted, refused = self.admitted(), self.refused()
        return {
            "requests": len(self.outcomes),
            "admitted": len(admitted),
            "refused_429": len(refused),
            "other": len(self.outcomes) - len(admitted) - len(refused),
            "admitted_ttft_p50_s": percentile([o.ttft_s for o in admitted], 50),
            "admitted_ttft_p99_s": percentile([o.ttft_s for o in admitted], 99),
            "refusal_latency_p99_s": percentile([o.answer_s for o in refused], 99),
            "refusals_with_retry_after": sum(o.retry_after is not None for o in refused),
        }


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (NaN of no values)."""
    vals = sorted(v for v in values if not math.isnan(v))
    if not vals:
        return math.nan
    return vals[max(0, math.ceil(q / 100 * len(vals)) - 1)]


async def one_request(http: Any, url: str, max_tokens: int) -> Outcome:
    body = {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.monotonic()
    async with http.stream("POST", url, json=body) as r:
        out = Outcome(r.status_code, answer_s=time.monotonic() - t0)
        out.retry_after = r.headers.get("retry-after")
        if r.status_code != 200:
            await r.aread()
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if any(c.get("text") for c in chunk.get("choices", [])):
                out.tokens += 1
                if math.isnan(out.ttft_s):
                    out.ttft_s = time.monotonic() - t0
    return out


async def burst(http_address: str, n: int, max_tokens: int) -> Phase:
    """`n` simultaneous requests; then a pause for the worker's next load report, so the
    scheduler has counted the burst's requests finished before the next burst."""
    import httpx

    url = f"http://{http_address}/v1/completions"
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        outcomes = await asyncio.gather(*(one_request(http, url, max_tokens) for _ in range(n)))
    await asyncio.sleep(SETTLE_S)
    return Phase(list(outcomes))


def services_rss_bytes(pids: list[int]) -> int:
    """RSS of the services and their children (a worker's engine process)."""
    import psutil

    total = 0
    for pid in pids:
        proc = psutil.Process(pid)
        for p in [proc, *proc.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += p.memory_info().rss
    return total


def deployment_config(settings: OverloadSettings, log_dir: str) -> Any:
    from tandem_services.launcher import ServeConfig

    return ServeConfig(
        http_port=0,
        grpc_port=0,
        unified=True,
        worker_args=(
            "--max-model-len", "512", "--num-gpu-blocks", "128", "--num-threads", "1",
            "--max-num-seqs", str(settings.max_num_seqs),
        ),
        scheduler_args=(
            "--max-queue-len", str(settings.max_queue_len),
            "--max-inflight-per-worker", str(settings.max_num_seqs),
            "--queue-timeout-s", "120",
        ),
        grace_period_s=5.0,
        log_dir=log_dir,
        startup_timeout_s=300.0,
    )  # fmt: skip


def queue_and_pools_empty(dep: Any) -> dict[str, Any]:
    import grpc

    from tandem_protos.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(dep.scheduler_address) as channel:
        listed = scheduler_pb2_grpc.SchedulerStub(channel).ListWorkers(
            scheduler_pb2.ListWorkersRequest(), timeout=30
        )
    with grpc.insecure_channel(dep.address("unified")) as channel:
        stats = worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=30)
    return {
        "scheduler_queued": listed.num_queued,
        "scheduler_inflight": listed.num_inflight,
        "worker_inflight": stats.num_inflight,
        "free_blocks": stats.num_free_blocks,
        "num_blocks": stats.num_blocks,
    }


def run_overload(dep: Any, settings: OverloadSettings) -> dict[str, Any]:
    """The benchmark against a running unified deployment made from `deployment_config`."""
    pids = [dep.pid(name) for name in ("frontend", "scheduler", "unified")]
    address = dep.http_address
    asyncio.run(burst(address, settings.capacity, settings.max_tokens))  # warm-up
    at_capacity = Phase()
    for _ in range(settings.rounds):
        at_capacity.outcomes += asyncio.run(
            burst(address, settings.capacity, settings.max_tokens)
        ).outcomes
    # One overload burst before measuring memory: the first grows buffers once.
    asyncio.run(burst(address, settings.capacity * settings.factor, settings.max_tokens))
    rss_before = services_rss_bytes(pids)
    overload = Phase()
    for _ in range(settings.rounds):
        overload.outcomes += asyncio.run(
            burst(address, settings.capacity * settings.factor, settings.max_tokens)
        ).outcomes
    rss_after = services_rss_bytes(pids)
    cap, over = at_capacity.summary(), overload.summary()
    return {
        "settings": {**asdict(settings), "capacity": settings.capacity},
        "at_capacity": cap,
        "overload": over,
        "admitted_ttft_p99_ratio": over["admitted_ttft_p99_s"] / cap["admitted_ttft_p99_s"],
        "admitted_tokens_complete": all(
            o.tokens == settings.max_tokens for o in at_capacity.admitted() + overload.admitted()
        ),
        "rss_before_mb": rss_before / 2**20,
        "rss_after_mb": rss_after / 2**20,
        "rss_growth_mb": (rss_after - rss_before) / 2**20,
        "after": queue_and_pools_empty(dep),
    }


def _finite(value: Any) -> Any:
    """`value` with NaN (a percentile of no requests) as null: strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overload", description=__doc__)
    d = OverloadSettings()
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-queue-len", type=int, default=d.max_queue_len)
    p.add_argument("--factor", type=int, default=d.factor)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--rounds", type=int, default=d.rounds)
    ns = p.parse_args(argv)
    settings = OverloadSettings(
        ns.max_num_seqs, ns.max_queue_len, ns.factor, ns.max_tokens, ns.rounds
    )
    from tandem_services.launcher import start_deployment

    with tempfile.TemporaryDirectory(prefix="overload-") as logs:
        dep = start_deployment(deployment_config(settings, logs))
        try:
            result = run_overload(dep, settings)
        finally:
            dep.stop(timeout_s=20)
    result["machine"] = {"platform": platform.platform(), "python": platform.python_version()}
    text = json.dumps(_finite(result), indent=2)
    print(text)
    RESULTS_DIR.mkdir(exist_ok=True)
    day = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    (RESULTS_DIR / f"overload_cpu_{day}.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
