"""`tandem bench serve`: a load generator for the serving system, and its cost against the
offline engine.

Workload: random token-id prompts (lengths drawn in [len*(1-r), len*(1+r)]) or a prompt file,
a fixed number of output tokens (ignore_eos), Poisson arrivals at `--request-rate` (or all at
once: `inf`), optionally capped at `--max-concurrency` in flight. Per request it records
TTFT, inter-token latencies, TPOT and end-to-end latency; per run it reports mean / p50 / p99
of each, request and token throughput, and goodput (requests/s within `--goodput-ttft-ms` and
`--goodput-tpot-ms`). Results go to JSON and PNG plots.

    tandem bench serve --url 127.0.0.1:50051                  # a running frontend (gRPC)
    tandem bench serve --launch --compare-offline             # start `tandem serve`, compare
    tandem bench serve --launch --unified --request-rate 1,2,4,inf --compare-offline

`--compare-offline` runs the same prompts and arrival times through an `EngineCore` stepped in
this process (no services, no detokenization), then through the services, and reports the
throughput and TTFT differences.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import json
import math
import os
import platform
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    ok: bool = False
    error: str = ""

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.output_len - 1) if self.output_len > 1 else 0.0


# ----------------------------------------------------------------------------- workload


def random_workload(
    num: int, input_len: int, output_len: int, range_ratio: float, vocab: int, seed: int
) -> Workload:
    rng = random.Random(seed)

    def draw(n: int) -> int:
        lo, hi = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
        return rng.randint(lo, hi)

    prompts = [[rng.randrange(100, vocab) for _ in range(draw(input_len))] for _ in range(num)]
    return Workload(prompts, [draw(output_len) for _ in range(num)])


def file_workload(path: Path, tokenizer: Any, num: int, output_len: int, seed: int) -> Workload:
    """One prompt per line (.txt) or per JSON line with a "prompt" field (.jsonl)."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    texts = [json.loads(ln)["prompt"] for ln in lines] if path.suffix == ".jsonl" else lines
    rng = random.Random(seed)
    chosen = [texts[rng.randrange(len(texts))] for _ in range(num)]
    prompts = [list(tokenizer(t, add_special_tokens=True).input_ids) for t in chosen]
    return Workload(prompts, [output_len] * num)


def arrival_times(num: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent (Poisson at `rate`/s)."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ----------------------------------------------------------------------------- metrics


def percentile(values: Sequence[float], q: float, empty: float = 0.0) -> float:
    """The `q`-th percentile (0..100) of `values`, interpolated linearly between the two
    nearest ranks; `empty` when there are none."""
    if not values:
        return empty
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _stats_ms(values: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {
        "mean": sum(ms) / len(ms) if ms else 0.0,
        "p50": percentile(ms, 50),
        "p99": percentile(ms, 99),
    }


def summarize(
    results: list[RequestResult],
    duration_s: float,
    goodput_ttft_ms: float | None,
    goodput_tpot_ms: float | None,
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    good = [
        r
        for r in ok
        if (goodput_ttft_ms is None or r.ttft_s * 1000 <= goodput_ttft_ms)
        and (goodput_tpot_ms is None or r.tpot_s * 1000 <= goodput_tpot_ms)
    ]
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "output_token_throughput": out_tokens / duration_s if duration_s else 0.0,
        "total_token_throughput": (out_tokens + in_tokens) / duration_s if duration_s else 0.0,
        "goodput": len(good) / duration_s if duration_s else 0.0,
        "ttft_ms": _stats_ms([r.ttft_s for r in ok]),
        "tpot_ms": _stats_ms([r.tpot_s for r in ok if r.output_len > 1]),
        "itl_ms": _stats_ms([x for r in ok for x in r.itl_s]),
        "e2e_ms": _stats_ms([r.e2e_s for r in ok]),
    }


def _record_tokens(result: RequestResult, t_send: float, times: list[float]) -> None:
    if not times:
        return
    result.ttft_s = times[0] - t_send
    result.e2e_s = times[-1] - t_send
    result.itl_s = [b - a for a, b in itertools.pairwise(times)]


# ----------------------------------------------------------------------------- clients


async def _paced(
    workload: Workload,
    rate: float,
    max_concurrency: int,
    seed: int,
    send: Any,
) -> tuple[list[RequestResult], float]:
    arrivals = arrival_times(workload.num_requests, rate, seed)
    sem = asyncio.Semaphore(max_concurrency if max_concurrency > 0 else workload.num_requests)
    results = [RequestResult(len(p)) for p in workload.prompts]
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        delay = t0 + arrivals[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with sem:
            try:
                await send(i, results[i])
            except Exception as exc:
                results[i].ok = False
                results[i].error = f"{type(exc).__name__}: {exc}"[:200]

    await asyncio.gather(*(one(i) for i in range(workload.num_requests)))
    return results, time.perf_counter() - t0


async def run_grpc(
    address: str,
    workload: Workload,
    rate: float,
    max_concurrency: int,
    seed: int,
    api_key: str = "",
) -> tuple[list[RequestResult], float]:
    import grpc

    from tandem_protos.v1 import frontend_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = frontend_pb2_grpc.FrontendStub(channel)

        async def send(i: int, result: RequestResult) -> None:
            await grpc_send(stub, workload, i, result, api_key)

        return await _paced(workload, rate, max_concurrency, seed, send)


async def grpc_send(
    stub: Any, workload: Workload, i: int, result: RequestResult, api_key: str = ""
) -> None:
    """One streamed `Generate` of request `i`; token arrival times into `result`."""
    from tandem_protos.v1 import common_pb2, frontend_pb2

    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
    request = frontend_pb2.GenerateRequest(
        token_ids=frontend_pb2.TokenIds(ids=workload.prompts[i]),
        sampling_params=common_pb2.SamplingParams(
            temperature=0.0, max_tokens=workload.output_lens[i], ignore_eos=True
        ),
    )
    times: list[float] = []
    t_send = time.perf_counter()
    async for resp in stub.Generate(request, metadata=metadata):
        t = time.perf_counter()
        for choice in resp.choices:
            times.extend([t] * len(choice.token_ids))
    _record_tokens(result, t_send, times)
    result.output_len = len(times)
    result.ok = result.output_len == workload.output_lens[i]
    if not result.ok:
        result.error = f"got {result.output_len} tokens"


async def run_paired(
    engine: Any, address: str, workload: Workload, seed: int, api_key: str = ""
) -> tuple[list[RequestResult], list[RequestResult]]:
    """Each request alone, once through the offline engine and once through the services,
    alternating which goes first: the per-request cost of the services under the same
    machine load (the two engines never run at the same time)."""
    import grpc

    from tandem_protos.v1 import frontend_pb2_grpc

    offline: list[RequestResult] = []
    served: list[RequestResult] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = frontend_pb2_grpc.FrontendStub(channel)
        for i in range(workload.num_requests):
            one = Workload([workload.prompts[i]], [workload.output_lens[i]])
            result = RequestResult(len(workload.prompts[i]))
            if i % 2:
                await grpc_send(stub, one, 0, result, api_key)
                offline.append(run_offline(engine, one, math.inf, 1, seed)[0][0])
            else:
                offline.append(run_offline(engine, one, math.inf, 1, seed)[0][0])
                await grpc_send(stub, one, 0, result, api_key)
            served.append(result)
    return offline, served


async def run_http(
    url: str,
    workload: Workload,
    rate: float,
    max_concurrency: int,
    seed: int,
    api_key: str = "",
    model: str = "default",
) -> tuple[list[RequestResult], float]:
    """OpenAI /v1/completions with SSE. A chunk may carry several tokens (the detokenizer
    holds text back); its arrival time counts for each of them."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(workload.num_requests, 10))
    async with httpx.AsyncClient(timeout=None, limits=limits, headers=headers) as http:

        async def send(i: int, result: RequestResult) -> None:
            body = {
                "model": model,
                "prompt": workload.prompts[i],
                "max_tokens": workload.output_lens[i],
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            times: list[float] = []
            total = 0
            t_send = time.perf_counter()
            async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    t = time.perf_counter()
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        total = chunk["usage"]["completion_tokens"]
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        times.append(t)
            _record_tokens(result, t_send, times)
            result.output_len = total
            result.ok = total == workload.output_lens[i]
            if not result.ok:
                result.error = f"got {total} tokens"

        return await _paced(workload, rate, max_concurrency, seed, send)


def run_offline(
    engine: Any, workload: Workload, rate: float, max_concurrency: int, seed: int
) -> tuple[list[RequestResult], float]:
    """The same schedule through an EngineCore stepped here: the engine's own cost."""
    from tandem.request import EngineCoreRequest
    from tandem.sampling_params import SamplingParams

    arrivals = arrival_times(workload.num_requests, rate, seed)
    results = [RequestResult(len(p)) for p in workload.prompts]
    times: list[list[float]] = [[] for _ in workload.prompts]
    sent = [0.0] * workload.num_requests
    cap = max_concurrency if max_concurrency > 0 else workload.num_requests
    next_i, inflight = 0, 0
    t0 = time.perf_counter()
    while next_i < workload.num_requests or engine.has_unfinished_requests():
        now = time.perf_counter()
        while next_i < workload.num_requests and inflight < cap and t0 + arrivals[next_i] <= now:
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
            sent[i] = max(now, t0 + arrivals[i])
            next_i += 1
            inflight += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, t0 + arrivals[next_i] - time.perf_counter()))
            continue
        outputs = engine.step()
        t = time.perf_counter()
        for out in outputs:
            i = int(out.request_id.split("-", 1)[1])
            times[i].extend([t] * len(out.new_token_ids))
            if out.finished:
                inflight -= 1
    duration = time.perf_counter() - t0
    for i, r in enumerate(results):
        _record_tokens(r, sent[i], times[i])
        r.output_len = len(times[i])
        r.ok = r.output_len == workload.output_lens[i]
    return results, duration


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
    from services.launcher import add_worker_placement_args
    from tandem.config import add_engine_args

    p = argparse.ArgumentParser(prog="tandem bench serve", description=__doc__.split("\n\n")[0])
    target = p.add_argument_group("target")
    target.add_argument(
        "--url",
        default="",
        help="frontend address (gRPC host:port, or http://host:port with --backend http)",
    )
    target.add_argument("--launch", action="store_true", help="start `tandem serve` here")
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
    w.add_argument("--num-prompts", type=int, default=64)
    w.add_argument("--input-len", type=int, default=64)
    w.add_argument("--output-len", type=int, default=32)
    w.add_argument("--range-ratio", type=float, default=0.0)
    w.add_argument("--prompt-file", default="", help=".txt (one per line) or .jsonl (prompt)")
    w.add_argument(
        "--request-rate",
        default="inf",
        help="requests/s (Poisson), 'inf' for all at once; a comma list sweeps",
    )
    w.add_argument("--max-concurrency", type=int, default=0, help="0: no cap")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--goodput-ttft-ms", type=float, default=None)
    w.add_argument("--goodput-tpot-ms", type=float, default=None)
    w.add_argument("--warmup", type=int, default=2, help="requests sent before timing")
    o = p.add_argument_group("output")
    o.add_argument("--out-dir", default="benchmarks/results")
    o.add_argument("--name", default="", help="file stem (default: serving-<timestamp>)")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument(
        "--log-dir", default="", help="with --launch: the services' logs (default: a temp dir)"
    )
    add_engine_args(p)
    return p


def _rates(spec: str) -> list[float]:
    return [math.inf if s.strip() in ("inf", "") else float(s) for s in spec.split(",")]


def _table(runs: list[dict[str, Any]]) -> str:
    head = (
        f"{'system':<22}{'rate':>6}{'ok':>6}{'req/s':>8}{'out tok/s':>11}"
        f"{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'ITL p50':>9}{'E2E p50':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in runs:
        s = r["summary"]
        lines.append(
            f"{r['system']:<22}{r['rate']:>6g}{s['num_ok']:>6}{s['request_throughput']:>8.2f}"
            f"{s['output_token_throughput']:>11.1f}{s['ttft_ms']['p50']:>10.1f}"
            f"{s['ttft_ms']['p99']:>10.1f}{s['tpot_ms']['p50']:>10.1f}"
            f"{s['itl_ms']['p50']:>9.1f}{s['e2e_ms']['p50']:>10.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from services.launcher import ServeConfig, default_cpu_threads, start_deployment
    from tandem.config import EngineArgs, engine_argv, engine_kwargs_from
    from tandem.loader import load_hf_config, load_tokenizer, resolve_model_path

    parser = build_parser()
    ns = parser.parse_args(argv)
    if not ns.url and not ns.launch:
        parser.error("give --url of a running frontend or --launch")
    num_workers = ns.num_unified_workers if ns.unified else ns.num_prefill_workers + 1
    if not ns.num_threads and not ns.device.startswith("cuda") and not ns.gpus:
        # The offline engine and the workers get the same threads per engine.
        ns.num_threads = default_cpu_threads(num_workers)
    engine_kwargs = engine_kwargs_from(ns)
    model_path = resolve_model_path(ns.model, ns.cache_dir or None)
    tokenizer = load_tokenizer(model_path)
    if ns.prompt_file:
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

    def record(system: str, rate: float, res: tuple[list[RequestResult], float]) -> None:
        results, duration = res
        summary = summarize(results, duration, ns.goodput_ttft_ms, ns.goodput_tpot_ms)
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

        engine = EngineCore(EngineArgs(model=ns.model, **engine_kwargs).create_engine_config())
        run_offline(engine, warm, math.inf, 0, ns.seed)
        for rate in rates:
            engine.scheduler.reset_prefix_cache()
            record(
                "offline-engine",
                rate,
                run_offline(engine, workload, rate, ns.max_concurrency, ns.seed),
            )
        if not ns.paired:
            engine = None

    deployment = None
    paired: dict[str, Any] = {}
    system = "serve"
    url = ns.url
    if ns.launch:
        if ns.log_dir:
            Path(ns.log_dir).mkdir(parents=True, exist_ok=True)
        try:
            config = ServeConfig(
                model=ns.model,
                http_port=0,
                grpc_port=0,
                unified=ns.unified,
                api_key=ns.api_key,
                worker_args=tuple(engine_argv(ns)),
                log_dir=ns.log_dir or tempfile.mkdtemp(prefix=f"tandem-bench-{stem}-logs-"),
                num_prefill_workers=ns.num_prefill_workers,
                num_unified_workers=ns.num_unified_workers,
                gpus=ns.gpus,
            )
        except ValueError as exc:
            parser.error(str(exc))
        print(f"service logs: {config.log_dir}", flush=True)
        deployment = start_deployment(config)
        url = deployment.grpc_address if ns.backend == "grpc" else deployment.http_address
        system = "serve-unified" if ns.unified else "serve-disaggregated"
        if num_workers > (1 if ns.unified else 2):
            system += f"-{num_workers}w"
    system += f"/{ns.backend}"
    if ns.backend == "http" and not url.startswith("http"):
        url = f"http://{url}"
    try:

        def run(wl: Workload, rate: float) -> tuple[list[RequestResult], float]:
            if ns.backend == "grpc":
                coro = run_grpc(url, wl, rate, ns.max_concurrency, ns.seed, ns.api_key)
            else:
                coro = run_http(url, wl, rate, ns.max_concurrency, ns.seed, ns.api_key, ns.model)
            return asyncio.run(coro)

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
