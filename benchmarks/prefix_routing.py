"""Prefix-aware routing against round robin: two prefill workers, one decode worker, Redis.

Workload (shared prefixes): `--num-prefixes` system prompts of `--prefix-len` random tokens,
`--questions` questions each (`--question-len` random tokens, +-50%), interleaved: every
round asks each system prompt one question, in a shuffled order (a fixed cycle would give
round robin perfect affinity by accident: prompt k would always land on worker k mod 2).
Requests run `--concurrency` at a time through the frontend (gRPC, streamed); each asks for
`--output-len` tokens.

For each routing mode, in one run, a fresh deployment (`tandem serve` with two prefill
workers, a private redis-server as the directory, one torch thread per worker): a warm-up
request per prefill worker, then the workload. Reported per mode:

- prefix hit rate: prompt tokens the prefill workers found in their prefix cache / prompt
  tokens they looked up (their own counters), and the same against the ideal (every request
  but each system prompt's first finds the whole system prompt cached);
- TTFT (client side: request sent -> first token) mean / p50 / p99, end-to-end p50, the
  run's duration;
- the scheduler's routing counters (directory answers, fallbacks).

The prefill workers' KV pools (`--prefill-blocks`, default 192 blocks of 16 tokens: about
five of the eight system prompts) hold all eight prompts between them only when each prompt
lives on one worker: the regime where routing decides the hit rate. Round robin makes
every worker cache every prompt, and their LRU pools thrash.

    python -m benchmarks.prefix_routing                      # defaults above
    python -m benchmarks.prefix_routing --modes prefix,round-robin,load --concurrency 2

Prints a table, writes JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.config import add_engine_args, engine_argv

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BLOCK_SIZE = 16
NAN = float("nan")  # a percentile of no requests


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    prefix_ids: list[int]  # which system prompt each request asks about
    prefix_len: int

    def first_of_prefix(self) -> list[bool]:
        """Per request, whether it is the first to ask about its system prompt."""
        seen: set[int] = set()
        first = []
        for pid in self.prefix_ids:
            first.append(pid not in seen)
            seen.add(pid)
        return first

    def ideal_hit_tokens(self, block_size: int = BLOCK_SIZE) -> int:
        """Cached prompt tokens if every request but each prefix's first found it cached."""
        full = self.prefix_len // block_size * block_size
        return sum(
            min(full, len(prompt) - 1)
            for prompt, first in zip(self.prompts, self.first_of_prefix(), strict=True)
            if not first
        )


def make_workload(
    num_prefixes: int, questions: int, prefix_len: int, question_len: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    vocab = (1000, 40000)
    prefixes = [[rng.randrange(*vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    prompts: list[list[int]] = []
    ids: list[int] = []
    for _ in range(questions):
        order = list(range(num_prefixes))
        rng.shuffle(order)
        for pid in order:
            n = rng.randint(max(1, question_len // 2), question_len * 3 // 2)
            prompts.append(prefixes[pid] + [rng.randrange(*vocab) for _ in range(n)])
            ids.append(pid)
    return Workload(prompts, ids, prefix_len)


@dataclass
class Result:
    ok: bool = False
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    error: str = ""


async def run_workload(
    address: str, prompts: list[list[int]], output_len: int, concurrency: int
) -> tuple[list[Result], float]:
    import grpc

    from tandem_protos.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc

    results = [Result() for _ in prompts]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)

    async with grpc.aio.insecure_channel(address) as channel:
        stub = frontend_pb2_grpc.FrontendStub(channel)

        async def one(i: int) -> None:
            request = frontend_pb2.GenerateRequest(
                token_ids=frontend_pb2.TokenIds(ids=prompts[i]),
                sampling_params=common_pb2.SamplingParams(
                    temperature=0.0, max_tokens=output_len, ignore_eos=True
                ),
            )
            r = results[i]
            t0 = time.perf_counter()
            n = 0
            try:
                async for resp in stub.Generate(request, timeout=600):
                    got = sum(len(c.token_ids) for c in resp.choices)
                    if got and not n:
                        r.ttft_s = time.perf_counter() - t0
                    n += got
                r.e2e_s = time.perf_counter() - t0
                r.ok = n == output_len
                if not r.ok:
                    r.error = f"got {n} tokens"
            except grpc.aio.AioRpcError as exc:
                r.error = f"{exc.code().name}: {exc.details()}"

        async def client() -> None:
            while not queue.empty():
                await one(queue.get_nowait())

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return results, time.perf_counter() - t0


def prefill_counters(dep: Any, names: list[str]) -> dict[str, tuple[int, int]]:
    import grpc

    from tandem_protos.v1 import worker_pb2, worker_pb2_grpc

    out = {}
    for name in names:
        with grpc.insecure_channel(dep.address(name)) as channel:
            s = worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=30)
        out[name] = (s.prefix_cache_queries, s.prefix_cache_hits)
    return out


def scheduler_counters(dep: Any) -> dict[str, float]:
    url = f"http://{dep.services['scheduler'].info['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("tandem_scheduler_prefix_"):
            name, _, value = line.rpartition(" ")
            values[name.removeprefix("tandem_scheduler_prefix_")] = float(value)
    return values


def worker_args(ns: argparse.Namespace) -> tuple[str, ...]:
    """The workers' engine flags: every engine flag given (or defaulted here) but --model."""
    return tuple(engine_argv(ns))


def run_mode(mode: str, ns: argparse.Namespace, workload: Workload, redis_url: str) -> dict:
    from tandem_services.bench.serve import percentile
    from tandem_services.directory import DirectoryConfig
    from tandem_services.launcher import ServeConfig, start_deployment

    logs = tempfile.mkdtemp(prefix=f"tandem-bench-prefix-{mode}-")
    config = ServeConfig(
        model=ns.model,
        http_port=0,
        grpc_port=0,
        num_prefill_workers=2,
        worker_args=worker_args(ns),
        scheduler_args=("--metrics-port", "0"),
        log_dir=logs,
        startup_timeout_s=600.0,
        directory=DirectoryConfig(redis_url=redis_url, key_prefix=f"tandem-bench-{mode}:"),
        routing=mode,
    )
    t0 = time.perf_counter()
    dep = start_deployment(config)
    startup_s = time.perf_counter() - t0
    prefill = [name for name, role in config.worker_roles if role == "prefill"]
    try:
        # Warm-up: one unrelated prompt per prefill worker, sent together (spread by load
        # or by turn).
        rng = random.Random(ns.seed + 99)
        warm = [[rng.randrange(1000, 40000) for _ in range(64)] for _ in prefill]
        asyncio.run(run_workload(dep.grpc_address, warm, 2, len(warm)))
        before = prefill_counters(dep, prefill)
        sched_before = scheduler_counters(dep)
        results, duration = asyncio.run(
            run_workload(dep.grpc_address, workload.prompts, ns.output_len, ns.concurrency)
        )
        after = prefill_counters(dep, prefill)
        sched_after = scheduler_counters(dep)
    finally:
        dep.stop()
    queries = sum(after[n][0] - before[n][0] for n in prefill)
    hits = sum(after[n][1] - before[n][1] for n in prefill)
    ideal = workload.ideal_hit_tokens(ns.block_size)
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s * 1000 for r in ok]
    # Each system prompt's first request can hit nowhere, whatever the routing.
    first = workload.first_of_prefix()
    cold = [r.ttft_s * 1000 for r, f in zip(results, first, strict=True) if r.ok and f]
    warm = [r.ttft_s * 1000 for r, f in zip(results, first, strict=True) if r.ok and not f]
    return {
        "mode": mode,
        "num_requests": len(results),
        "num_ok": len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "startup_s": round(startup_s, 1),
        "duration_s": round(duration, 2),
        "requests_per_s": round(len(ok) / duration, 3),
        "prompt_tokens_looked_up": queries,
        "prompt_tokens_hit": hits,
        "hit_rate": hits / queries if queries else 0.0,
        "ideal_hit_rate": ideal / queries if queries else 0.0,
        "hit_rate_vs_ideal": hits / ideal if ideal else 0.0,
        "prompt_tokens_per_worker": {n: after[n][0] - before[n][0] for n in prefill},
        "ttft_ms": {
            "mean": statistics.fmean(ttft) if ttft else NAN,
            "p50": percentile(ttft, 50, NAN),
            "p90": percentile(ttft, 90, NAN),
            "p99": percentile(ttft, 99, NAN),
        },
        "ttft_ms_first_of_each_prefix": {
            "p50": percentile(cold, 50, NAN),
            "max": max(cold, default=0),
        },
        "ttft_ms_later_requests": {
            "p50": percentile(warm, 50, NAN),
            "p99": percentile(warm, 99, NAN),
        },
        "requests": [
            {"prefix": pid, "prompt_len": len(p), "ttft_ms": r.ttft_s * 1000, "ok": r.ok}
            for pid, p, r in zip(workload.prefix_ids, workload.prompts, results, strict=True)
        ],
        "e2e_ms_p50": percentile([r.e2e_s * 1000 for r in ok], 50, NAN),
        "scheduler": {
            k: sched_after.get(k, 0.0) - sched_before.get(k, 0.0)
            for k in sched_after
            if k.endswith("_total")
        },
    }


def build_parser() -> argparse.ArgumentParser:
    """Every engine flag, forwarded to the workers (this benchmark's defaults: one torch thread,
    1024 tokens of context, 192 KV blocks per worker), then the workload."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.prefix_routing",
        description="Prefix-aware routing against round robin (2 prefill + 1 decode worker).",
    )
    add_engine_args(p)
    p.set_defaults(num_threads=1, max_model_len=1024, num_gpu_blocks=192)
    p.add_argument("--modes", default="prefix,round-robin", help="comma-separated --routing")
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--questions", type=int, default=10)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=24)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument(
        "--prefill-blocks",
        dest="num_gpu_blocks",
        type=int,
        default=argparse.SUPPRESS,
        help="same as --num-gpu-blocks: KV blocks per worker (the decode worker gets as many)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--redis-url", default="", help="an existing Redis (default: start a private one)"
    )
    p.add_argument("--name", default="", help="results file stem")
    return p


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    modes = [m.strip() for m in ns.modes.split(",") if m.strip()]
    workload = make_workload(ns.num_prefixes, ns.questions, ns.prefix_len, ns.question_len, ns.seed)
    server = None
    redis_url = ns.redis_url
    if not redis_url:
        # The tests' real-Redis helper: loopback, a free port, no persistence.
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests.redis_server import RedisServer

        server = RedisServer().start()
        redis_url = server.url
    runs = []
    try:
        for mode in modes:
            print(f"== {mode}: starting scheduler, 2 prefill + 1 decode workers, frontend ...")
            run = run_mode(mode, ns, workload, redis_url)
            runs.append(run)
            print(_row(run), flush=True)
    finally:
        if server is not None:
            server.close()
    print()
    print(_table(runs))
    by_mode = {r["mode"]: r for r in runs}
    comparison = {}
    if "prefix" in by_mode and "round-robin" in by_mode:
        p, rr = by_mode["prefix"], by_mode["round-robin"]
        comparison = {
            "ttft_p50_speedup": rr["ttft_ms"]["p50"] / p["ttft_ms"]["p50"],
            "ttft_p99_speedup": rr["ttft_ms"]["p99"] / p["ttft_ms"]["p99"],
            "hit_rate_prefix": p["hit_rate"],
            "hit_rate_round_robin": rr["hit_rate"],
            "prefix_hit_rate_vs_ideal": p["hit_rate_vs_ideal"],
        }
        print(
            f"\nprefix vs round robin: TTFT p50 {comparison['ttft_p50_speedup']:.2f}x lower, "
            f"p99 {comparison['ttft_p99_speedup']:.2f}x lower; hit rate "
            f"{p['hit_rate']:.1%} vs {rr['hit_rate']:.1%} "
            f"(prefix routing at {p['hit_rate_vs_ideal']:.1%} of the ideal)"
        )
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = ns.name or f"prefix_routing-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    out = RESULTS_DIR / f"{stem}.json"
    out.write_text(
        json.dumps(
            {
                "benchmark": "prefix_routing",
                "args": vars(ns),
                "machine": {
                    "platform": platform.platform(),
                    "cpu_count": os.cpu_count(),
                    "python": platform.python_version(),
                },
                "workload": {
                    "num_requests": len(workload.prompts),
                    "prompt_tokens": sum(len(p) for p in workload.prompts),
                    "ideal_hit_tokens": workload.ideal_hit_tokens(ns.block_size),
                },
                "runs": runs,
                "comparison": comparison,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0 if all(r["num_ok"] == r["num_requests"] for r in runs) else 1


def _row(r: dict) -> str:
    t = r["ttft_ms"]
    return (
        f"{r['mode']:<12} ok {r['num_ok']}/{r['num_requests']}  hit {r['hit_rate']:6.1%} "
        f"({r['hit_rate_vs_ideal']:6.1%} of ideal)  TTFT p50 {t['p50']:8.0f} ms  "
        f"p99 {t['p99']:8.0f} ms  mean {t['mean']:8.0f} ms  {r['duration_s']:.0f} s\n"
        f"{'':<12} later requests (not a prefix's first): TTFT p50 "
        f"{r['ttft_ms_later_requests']['p50']:.0f} ms, p99 "
        f"{r['ttft_ms_later_requests']['p99']:.0f} ms; prefixes' first requests: p50 "
        f"{r['ttft_ms_first_of_each_prefix']['p50']:.0f} ms, max "
        f"{r['ttft_ms_first_of_each_prefix']['max']:.0f} ms"
    )


def _table(runs: list[dict]) -> str:
    return "\n".join(_row(r) for r in runs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
