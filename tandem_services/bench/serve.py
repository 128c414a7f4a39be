"""`tandem bench serve`: a load generator for the serving system, and its cost against the
offline engine.

Workload (vLLM bench serve's flag names): `--dataset-name random` token-id prompts
(`--random-input-len`, `--random-output-len`, lengths in [len*(1-r), len*(1+r)] for
`--random-range-ratio r`) or a prompt file, `--ignore-eos` (the default), arrivals at
`--request-rate` with `--burstiness` (1: Poisson; `inf`: all at once), seeded, optionally
capped at `--max-concurrency` in flight. Per request it records TTFT, inter-token latencies,
TPOT and end-to-end latency; per run it reports mean / median / p50 / p90 / p99 of each
(`--metric-percentiles`), request and token throughput, goodput (`--goodput ttft:MS tpot:MS`),
and the load generator's own CPU (cores = CPU seconds of its processes / wall seconds), which
`--num-client-procs N` spreads over N processes. Results go to JSON (vLLM's result field names
where they exist: mean_ttft_ms, median_tpot_ms, p99_itl_ms, output_throughput, ...) and PNG
plots. Module layout: `workload` (what and when), `client` (gRPC / SSE clients, processes),
`metrics` (figures), `stream_server` (a server of known timing, for the client's own cost).

    tandem bench serve --url 127.0.0.1:50051                  # a running frontend (gRPC)
    tandem bench serve --launch --compare-offline             # start `tandem serve`, compare
    tandem bench serve --launch --unified --dataset-name random --random-input-len 1000 \
        --random-range-ratio 0.5 --random-output-len 200 --ignore-eos --num-prompts 150 \
        --request-rate 5,15,25,inf --burstiness 1 --seed 0     # the issue-14 load

Before anything is sent, `/v1/models` of the frontend's HTTP address (`--url` with `--backend
http`, `--ready-url`, or the launched deployment's) is polled until it answers 200, for at most
`--ready-check-timeout-sec` (ready.py): the frontend answers 503 until a worker serves.

`--compare-offline` runs the same prompts and arrival times through an `EngineCore` stepped in
this process (no services, no detokenization), then through the services, and reports the
throughput and TTFT differences.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime as dt
import json
import math
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tandem_services.bench.client import (
    LoadRun,
    Target,
    grpc_channel,
    grpc_request,
    grpc_stream,
    run_load,
)
from tandem_services.bench.metrics import (
    ClientCpu,
    RequestResult,
    percentile,
    record_times,
    summarize,
)
from tandem_services.bench.ready import NotReadyError, wait_until_serving
from tandem_services.bench.workload import Workload, arrival_times, file_workload, random_workload

__all__ = [
    "build_parser",
    "launch",
    "main",
    "percentile",
    "run_offline",
    "run_offline_at",
    "run_paired",
    "thread_affinity_kept",
]


async def run_paired(
    engine: Any, address: str, workload: Workload, seed: int, api_key: str = ""
) -> tuple[list[RequestResult], list[RequestResult]]:
    """Each request alone, once through the offline engine and once through the services,
    alternating which goes first: the per-request cost of the services under the same
    machine load (the two engines never run at the same time)."""
    from tandem_protos.v1 import frontend_pb2_grpc

    offline: list[RequestResult] = []
    served: list[RequestResult] = []
    async with grpc_channel(address) as channel:
        stub = frontend_pb2_grpc.FrontendStub(channel)
        for i in range(workload.num_requests):
            one = workload.subset([i])
            request = grpc_request(workload.prompts[i], workload.output_lens[i])
            result = RequestResult(len(workload.prompts[i]))
            if i % 2:
                await grpc_stream(stub, request, result, api_key)
                offline.append(run_offline(engine, one, math.inf, 1, seed)[0][0])
            else:
                offline.append(run_offline(engine, one, math.inf, 1, seed)[0][0])
                await grpc_stream(stub, request, result, api_key)
            result.ok = result.output_len == workload.output_lens[i]
            served.append(result)
    return offline, served


class ClientSlots:
    """When the client sends each request, as `paced` does: at its arrival time, or, with every
    one of its `max_concurrency` slots taken, when a slot frees (a request ends), whichever is
    later. The offline loop notices arrivals only between engine steps; a request's TTFT
    counts from here, as the served client's does, not from when the loop took it."""

    def __init__(self, start: float, max_concurrency: int) -> None:
        self._free = collections.deque([start] * max_concurrency)

    @property
    def num_free(self) -> int:
        """Slots free now (the requests in flight hold the rest)."""
        return len(self._free)

    def send(self, arrival: float) -> float:
        """The send time of the next request (in order), which arrives at `arrival`; it holds
        a slot until `release`."""
        return max(arrival, self._free.popleft())

    def release(self, at: float) -> None:
        """A request ended at `at`: its slot is free from then."""
        self._free.append(at)


def run_offline(
    engine: Any,
    workload: Workload,
    rate: float,
    max_concurrency: int,
    seed: int,
    burstiness: float = 1.0,
) -> tuple[list[RequestResult], float]:
    """The same schedule through an EngineCore stepped here: the engine's own cost."""
    arrivals = arrival_times(workload.num_requests, rate, seed, burstiness)
    return run_offline_at(engine, workload, arrivals, max_concurrency)


def run_offline_at(
    engine: Any, workload: Workload, arrivals: list[float], max_concurrency: int = 0
) -> tuple[list[RequestResult], float]:
    """`workload` through an EngineCore stepped here, request i arriving `arrivals[i]` s after
    the start. TTFT and E2E count from each request's send time (`ClientSlots`), as the
    served client's do; the results and the duration."""
    from tandem.request import EngineCoreRequest
    from tandem.sampling_params import SamplingParams

    results = [RequestResult(len(p)) for p in workload.prompts]
    times: list[list[float]] = [[] for _ in workload.prompts]
    counts = [0] * workload.num_requests
    sent = [0.0] * workload.num_requests
    cap = max_concurrency if max_concurrency > 0 else workload.num_requests
    next_i = 0
    t0 = time.perf_counter()
    slots = ClientSlots(t0, cap)
    while next_i < workload.num_requests or engine.has_unfinished_requests():
        now = time.perf_counter()
        while next_i < workload.num_requests and slots.num_free and t0 + arrivals[next_i] <= now:
            i = next_i
            engine.add_request(
                EngineCoreRequest(
                    request_id=f"bench-{i}",
                    prompt_token_ids=workload.prompts[i],
                    sampling_params=SamplingParams(
                        temperature=0.0, max_tokens=workload.output_lens[i], ignore_eos=True
                    ),
                    eos_token_id=engine.eos_token_id,
                )
            )
            sent[i] = slots.send(t0 + arrivals[i])
            next_i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, t0 + arrivals[next_i] - time.perf_counter()))
            continue
        outputs = engine.step()
        t = time.perf_counter()
        for out in outputs:
            i = int(out.request_id.split("-", 1)[1])
            if out.new_token_ids:
                times[i].append(t)
                counts[i] += len(out.new_token_ids)
            if out.finished:
                slots.release(t)
    duration = time.perf_counter() - t0
    for i, r in enumerate(results):
        record_times(r, sent[i], times[i])
        r.output_len = counts[i]
        r.ok = r.output_len == workload.output_lens[i]
    return results, duration


def _stats_ms(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {
        "mean": sum(ms) / len(ms) if ms else 0.0,
        "p50": percentile(ms, 50),
        "p99": percentile(ms, 99),
    }


@contextlib.contextmanager
def thread_affinity_kept(keep: bool = True) -> Iterator[None]:
    """Run the body, then (with `keep`) give the calling thread back the CPU affinity it had
    before: an engine stepped on this thread may bind it to the engine's cores."""
    saved = os.sched_getaffinity(0) if keep and hasattr(os, "sched_getaffinity") else None
    try:
        yield
    finally:
        if saved is not None:
            os.sched_setaffinity(0, saved)


def paired_summary(offline: list[RequestResult], served: list[RequestResult]) -> dict[str, Any]:
    pairs = [(o, s) for o, s in zip(offline, served, strict=True) if o.ok and s.ok]
    multi = [(o, s) for o, s in pairs if o.output_len > 1]
    return {
        "num_pairs": len(pairs),
        "offline_ttft_ms": _stats_ms([o.ttft_s for o, _ in pairs]),
        "serve_ttft_ms": _stats_ms([s.ttft_s for _, s in pairs]),
        "ttft_delta_ms": _stats_ms([s.ttft_s - o.ttft_s for o, s in pairs]),
        "offline_tpot_ms": _stats_ms([o.tpot_s for o, _ in multi]),
        "serve_tpot_ms": _stats_ms([s.tpot_s for _, s in multi]),
        "tpot_delta_ms": _stats_ms([s.tpot_s - o.tpot_s for o, s in multi]),
    }


# ----------------------------------------------------------------------------- plots


def plot(runs: list[dict[str, Any]], out_dir: Path, stem: str) -> list[Path]:
    """Latency distributions per run, and throughput / latency against request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for run in runs:
        label = f"{run['system']} @ {run['rate']}"
        for ax, key in zip(axes, ("ttft", "tpot", "e2e"), strict=True):
            vals = sorted(run["samples_ms"][key])
            if vals:
                ax.plot(vals, [(k + 1) / len(vals) for k in range(len(vals))], label=label)
    for ax, title in zip(axes, ("TTFT (ms)", "TPOT (ms)", "end-to-end (ms)"), strict=True):
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Latency distribution (CDF)")
    fig.tight_layout()
    path = out_dir / f"{stem}-latency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)

    systems = sorted({r["system"] for r in runs})
    finite = [r["rate"] for r in runs if not math.isinf(r["rate"])]
    inf_x = (max(finite) * 2) if finite else 1.0
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for system in systems:
        pts = sorted(
            ((inf_x if math.isinf(r["rate"]) else r["rate"]), r["summary"])
            for r in runs
            if r["system"] == system
        )
        xs = [x for x, _ in pts]
        axes[0].plot(xs, [s["output_token_throughput"] for _, s in pts], "o-", label=system)
        axes[1].plot(xs, [s["ttft_ms"]["p50"] for _, s in pts], "o-", label=f"{system} p50")
        axes[1].plot(xs, [s["ttft_ms"]["p99"] for _, s in pts], "x--", label=f"{system} p99")
        axes[2].plot(xs, [s["tpot_ms"]["p50"] for _, s in pts], "o-", label=f"{system} p50")
        axes[2].plot(xs, [s["tpot_ms"]["p99"] for _, s in pts], "x--", label=f"{system} p99")
    for ax, ylabel in zip(axes, ("output tokens/s", "TTFT (ms)", "TPOT (ms)"), strict=True):
        ax.set_xlabel(f"request rate (req/s; {inf_x:g} = all at once)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Throughput and latency against request rate")
    fig.tight_layout()
    path = out_dir / f"{stem}-rate.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    from tandem.config import SERVING_ENGINE_DEFAULTS, add_engine_args
    from tandem_services.launcher import add_worker_placement_args

    p = argparse.ArgumentParser(prog="tandem bench serve", description=__doc__.split("\n\n")[0])
    target = p.add_argument_group("target")
    target.add_argument(
        "--url",
        default="",
        help="frontend address (gRPC host:port, or http://host:port with --backend http)",
    )
    target.add_argument("--launch", action="store_true", help="start `tandem serve` here")
    target.add_argument(
        "--ready-url",
        default="",
        help="the frontend's HTTP address whose /v1/models is polled until 200 before the load "
        "(default: --url with --backend http; with --backend grpc only the channel is awaited)",
    )
    target.add_argument(
        "--ready-check-timeout-sec",
        type=float,
        default=600.0,
        help="how long to wait for /v1/models to answer 200 before giving up",
    )
    target.add_argument("--unified", action="store_true", help="with --launch: unified workers")
    target.add_argument("--backend", choices=["grpc", "http"], default="grpc")
    target.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY", ""))
    target.add_argument(
        "--compare-offline",
        action="store_true",
        help="first run the same workload through an in-process EngineCore",
    )
    target.add_argument(
        "--paired",
        action="store_true",
        help="with --compare-offline: also send each prompt alone through both, "
        "alternating, and report the paired latency differences",
    )
    add_worker_placement_args(target)
    w = p.add_argument_group("workload")
    w.add_argument("--dataset-name", choices=["random", "file"], default="random")
    w.add_argument("--num-prompts", type=int, default=64)
    w.add_argument("--random-input-len", "--input-len", dest="input_len", type=int, default=64)
    w.add_argument("--random-output-len", "--output-len", dest="output_len", type=int, default=32)
    w.add_argument(
        "--random-range-ratio", "--range-ratio", dest="range_ratio", type=float, default=0.0
    )
    w.add_argument(
        "--prompt-file",
        "--dataset-path",
        dest="prompt_file",
        default="",
        help="with --dataset-name file: .txt (one per line) or .jsonl (prompt)",
    )
    w.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the output length (default on)",
    )
    w.add_argument(
        "--request-rate",
        default="inf",
        help="requests/s, 'inf' for all at once; a comma list sweeps",
    )
    w.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 steadier",
    )
    w.add_argument("--max-concurrency", type=int, default=0, help="0: no cap")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="service level objectives, e.g. ttft:200 tpot:10 (ttft, tpot, e2el)",
    )
    w.add_argument("--goodput-ttft-ms", type=float, default=None)
    w.add_argument("--goodput-tpot-ms", type=float, default=None)
    w.add_argument(
        "--metric-percentiles",
        default="50,90,99",
        help="percentiles reported per metric (p50, p90 and p99 always)",
    )
    w.add_argument("--warmup", type=int, default=2, help="requests sent before timing")
    w.add_argument(
        "--num-client-procs",
        type=int,
        default=1,
        help="client processes the requests are spread over (round robin), results merged",
    )
    o = p.add_argument_group("output")
    o.add_argument("--out-dir", default="benchmarks/results")
    o.add_argument("--name", default="", help="file stem (default: serving-<timestamp>)")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument(
        "--log-dir", default="", help="with --launch: the services' logs (default: a temp dir)"
    )
    add_engine_args(p, defaults=SERVING_ENGINE_DEFAULTS)
    return p


def _rates(spec: str) -> list[float]:
    return [math.inf if s.strip() in ("inf", "") else float(s) for s in spec.split(",")]


def _table(runs: list[dict[str, Any]]) -> str:
    head = (
        f"{'system':<22}{'rate':>6}{'ok':>6}{'req/s':>8}{'out tok/s':>11}"
        f"{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}{'ITL p50':>9}"
        f"{'E2E p50':>10}{'client cores':>14}"
    )
    lines = [head, "-" * len(head)]
    for r in runs:
        s = r["summary"]
        cores = (
            f"{s['client_cores_used']:.3f}/{s['num_client_procs']}p"
            if "client_cores_used" in s
            else "-"
        )
        lines.append(
            f"{r['system']:<22}{r['rate']:>6g}{s['num_ok']:>6}{s['request_throughput']:>8.2f}"
            f"{s['output_token_throughput']:>11.1f}{s['ttft_ms']['p50']:>10.1f}"
            f"{s['ttft_ms']['p99']:>10.1f}{s['tpot_ms']['p50']:>10.2f}"
            f"{s['tpot_ms']['p99']:>10.2f}{s['itl_ms']['p50']:>9.2f}"
            f"{s['e2e_ms']['p50']:>10.1f}{cores:>14}"
        )
    return "\n".join(lines)


def goodput_limits(
    specs: list[str], ttft_ms: float | None = None, tpot_ms: float | None = None
) -> dict[str, float]:
    """Service level objectives in ms from vLLM-style `METRIC:MS` specs (ttft, tpot, e2el)
    and the older --goodput-ttft-ms / --goodput-tpot-ms."""
    limits: dict[str, float] = {}
    if ttft_ms is not None:
        limits["ttft"] = ttft_ms
    if tpot_ms is not None:
        limits["tpot"] = tpot_ms
    for spec in specs:
        name, _, value = spec.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {spec!r}")
        limits[name] = float(value)
    return limits


def set_cpu_threads(ns: argparse.Namespace) -> int:
    """On the CPU without --num-threads: the threads per engine of this machine's cores shared
    by the workers (and the offline engine, which gets the same). Returns the worker count."""
    from tandem_services.launcher import default_cpu_threads

    num_workers = ns.num_unified_workers if ns.unified else ns.num_prefill_workers + 1
    if not ns.num_threads and not ns.device.startswith("cuda") and not ns.gpus:
        ns.num_threads = default_cpu_threads(num_workers)
    return int(num_workers)


def launch(ns: argparse.Namespace, stem: str) -> Any:
    """Start `tandem serve` as the parsed `build_parser()` flags say (placement, engine flags,
    logs under --log-dir or a temp dir); returns the running `Deployment`. ValueError: a
    placement the launcher refuses."""
    from tandem.config import SERVING_ENGINE_DEFAULTS, engine_argv
    from tandem_services.launcher import ServeConfig, start_deployment

    if ns.log_dir:
        Path(ns.log_dir).mkdir(parents=True, exist_ok=True)
    config = ServeConfig(
        model=ns.model,
        http_port=0,
        grpc_port=0,
        unified=ns.unified,
        api_key=ns.api_key,
        worker_args=tuple(engine_argv(ns, defaults=SERVING_ENGINE_DEFAULTS)),
        log_dir=ns.log_dir or tempfile.mkdtemp(prefix=f"tandem-bench-{stem}-logs-"),
        num_prefill_workers=ns.num_prefill_workers,
        num_unified_workers=ns.num_unified_workers,
        num_decode_workers=ns.num_decode_workers,
        gpus=ns.gpus,
    )
    print(f"service logs: {config.log_dir}", flush=True)
    return start_deployment(config)


def main(argv: list[str]) -> int:
    from tandem.config import engine_kwargs_from
    from tandem.engine_args import EngineArgs
    from tandem.loader import load_hf_config, load_tokenizer, resolve_model_path

    parser = build_parser()
    ns = parser.parse_args(argv)
    if not ns.url and not ns.launch:
        parser.error("give --url of a running frontend or --launch")
    if ns.dataset_name == "file" and not ns.prompt_file:
        parser.error("--dataset-name file needs --prompt-file")
    if ns.num_client_procs < 1:
        parser.error("--num-client-procs must be at least 1")
    try:
        limits = goodput_limits(ns.goodput, ns.goodput_ttft_ms, ns.goodput_tpot_ms)
        percentiles = [float(q) for q in ns.metric_percentiles.split(",") if q.strip()]
    except ValueError as exc:
        parser.error(str(exc))
    num_workers = set_cpu_threads(ns)
    engine_kwargs = engine_kwargs_from(ns)
    model_path = resolve_model_path(ns.model, ns.cache_dir or None)
    tokenizer = load_tokenizer(model_path)
    if ns.dataset_name == "file" or ns.prompt_file:
        workload = file_workload(
            Path(ns.prompt_file), tokenizer, ns.num_prompts, ns.output_len, ns.seed
        )
    else:
        vocab = int(getattr(load_hf_config(model_path), "vocab_size", len(tokenizer)))
        workload = random_workload(
            ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio, vocab, ns.seed
        )
    rates = _rates(ns.request_rate)
    out_dir = Path(ns.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = ns.name or f"serving-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    runs: list[dict[str, Any]] = []

    def record(system: str, rate: float, res: tuple[list[RequestResult], float] | LoadRun) -> None:
        cpu: ClientCpu | None = None
        if isinstance(res, LoadRun):
            results, duration, cpu = res.results, res.duration_s, res.cpu
        else:
            results, duration = res
        summary = summarize(
            results,
            duration,
            limits.get("ttft"),
            limits.get("tpot"),
            goodput_e2el_ms=limits.get("e2el"),
            percentiles=percentiles,
            client_cpu=cpu,
        )
        ok = [r for r in results if r.ok]
        runs.append(
            {
                "system": system,
                "rate": rate,
                "summary": summary,
                # Per request that finished: [TTFT, TPOT] in ms (goodput under other limits
                # can be computed from the report afterwards).
                "request_latencies_ms": [
                    [round(r.ttft_s * 1000, 3), round(r.tpot_s * 1000, 4)] for r in ok
                ],
                "samples_ms": {
                    "ttft": [r.ttft_s * 1000 for r in ok],
                    "tpot": [r.tpot_s * 1000 for r in ok if r.output_len > 1],
                    "e2e": [r.e2e_s * 1000 for r in ok],
                },
            }
        )
        print(_table(runs[-1:]).splitlines()[-1], flush=True)

    # Warm-up prompts differ from the measured ones (no prefix-cache hits carry over).
    warm_rng = random.Random(ns.seed + 99)
    warm = Workload(
        [[warm_rng.randrange(100, 1000) for _ in range(16)] for _ in range(ns.warmup)],
        [4] * ns.warmup,
    )
    print(_table([]), flush=True)
    engine = None
    if ns.compare_offline:
        from tandem.engine.core import EngineCore

        with thread_affinity_kept(not ns.paired):
            engine = EngineCore(EngineArgs(model=ns.model, **engine_kwargs).create_engine_config())
            run_offline(engine, warm, math.inf, 0, ns.seed)
            for rate in rates:
                engine.scheduler.reset_prefix_cache()
                record(
                    "offline-engine",
                    rate,
                    run_offline(engine, workload, rate, ns.max_concurrency, ns.seed, ns.burstiness),
                )
            if not ns.paired:
                # Its device memory (weights, KV cache) goes back before the services start,
                # and (on leaving) this thread's cores: a CPU engine binds the thread that
                # steps it (--cpu-cores), which would then share them with the served engine.
                engine.shutdown()
                engine = None

    deployment = None
    paired: dict[str, Any] = {}
    system = "serve"
    url = ns.url
    if ns.launch:
        try:
            deployment = launch(ns, stem)
        except ValueError as exc:
            parser.error(str(exc))
        url = deployment.grpc_address if ns.backend == "grpc" else deployment.http_address
        system = "serve-unified" if ns.unified else "serve-disaggregated"
        if num_workers > (1 if ns.unified else 2):
            system += f"-{num_workers}w"
    system += f"/{ns.backend}"
    if ns.backend == "http" and not url.startswith("http"):
        url = f"http://{url}"
    try:
        ready_url = ns.ready_url or (url if ns.backend == "http" else "")
        if deployment is not None:
            ready_url = deployment.http_address
        if ready_url:
            try:
                wait_until_serving(ready_url, ns.ready_check_timeout_sec, ns.api_key)
            except NotReadyError as exc:
                print(f"tandem bench serve: {exc}", file=sys.stderr, flush=True)
                return 1
        target = Target(ns.backend, url, ns.api_key, ns.model, ns.ignore_eos)

        def run(wl: Workload, rate: float) -> LoadRun:
            return run_load(
                target,
                wl,
                rate,
                seed=ns.seed,
                burstiness=ns.burstiness,
                max_concurrency=ns.max_concurrency,
                num_procs=ns.num_client_procs,
            )

        run(warm, math.inf)
        for rate in rates:
            record(system, rate, run(workload, rate))
        if engine is not None:
            address = deployment.grpc_address if deployment is not None else ns.url
            if ns.backend != "grpc" and deployment is None:
                parser.error("--paired needs the gRPC address (--backend grpc or --launch)")
            engine.scheduler.reset_prefix_cache()
            offline, served = asyncio.run(
                run_paired(engine, address, workload, ns.seed, ns.api_key)
            )
            paired = paired_summary(offline, served)
            print(
                f"\npaired, one request at a time ({paired['num_pairs']} pairs): "
                f"TTFT p50 {paired['offline_ttft_ms']['p50']:.1f} -> "
                f"{paired['serve_ttft_ms']['p50']:.1f} ms (median difference "
                f"{paired['ttft_delta_ms']['p50']:+.1f} ms), TPOT p50 "
                f"{paired['offline_tpot_ms']['p50']:.1f} -> {paired['serve_tpot_ms']['p50']:.1f}"
                f" ms (median difference {paired['tpot_delta_ms']['p50']:+.1f} ms)"
            )
    finally:
        if deployment is not None:
            deployment.stop()
        if engine is not None:
            engine.shutdown()

    comparison: dict[str, Any] = {}
    if paired:
        comparison["paired"] = paired
    if ns.compare_offline:
        for rate in rates:
            off = next(r for r in runs if r["system"] == "offline-engine" and r["rate"] == rate)
            srv = next(r for r in runs if r["system"] == system and r["rate"] == rate)
            o, s = off["summary"], srv["summary"]
            comparison[str(rate)] = {
                "throughput_ratio": s["output_token_throughput"] / o["output_token_throughput"]
                if o["output_token_throughput"]
                else 0.0,
                "ttft_p50_delta_ms": s["ttft_ms"]["p50"] - o["ttft_ms"]["p50"],
                "tpot_p50_delta_ms": s["tpot_ms"]["p50"] - o["tpot_ms"]["p50"],
            }
        print("\nservices against the offline engine (same prompts, same arrival times):")
        for rate, c in comparison.items():
            if rate == "paired":
                continue
            print(
                f"  rate {rate:>5}: throughput x{c['throughput_ratio']:.3f}, "
                f"TTFT p50 {c['ttft_p50_delta_ms']:+.1f} ms, "
                f"TPOT p50 {c['tpot_p50_delta_ms']:+.1f} ms"
            )
    report = {
        "benchmark": "serving",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "args": {
            k: v for k, v in vars(ns).items() if isinstance(v, str | int | float | bool | tuple)
        },
        "workload": {
            "num_prompts": workload.num_requests,
            "prompt_tokens": sum(len(p) for p in workload.prompts),
            "output_tokens": sum(workload.output_lens),
        },
        "runs": [{k: v for k, v in r.items() if k != "samples_ms"} for r in runs],
        "comparison": comparison,
    }
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {json_path}")
    if not ns.no_plots:
        for path in plot(runs, out_dir, stem):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
