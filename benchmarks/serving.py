"""Serving benchmark: `tandem serve` against the offline engine, same workload, one run; and
disaggregated against unified serving under the same load.

CPU default: the embedded SmolLM2-135M, 64 random prompts of 64 tokens, 32 output tokens
each (ignore_eos), Poisson arrivals at 2 and 4 req/s and all at once; gRPC client. Writes
JSON and PNG plots under benchmarks/results/. Any `tandem bench serve` flag overrides; add
`--paired` for per-request latency differences measured one request at a time.

    python -m benchmarks.serving                 # disaggregated (prefill + decode workers)
    python -m benchmarks.serving --unified       # one unified worker

Disaggregated against unified: run `tandem bench serve --launch` twice with the same workload
flags and seed (one with `--unified`), then merge the two reports, rate by rate, into one JSON
(deltas and ratios: disaggregated minus / over unified) and one PNG:

    python -m benchmarks.serving compare DISAGG.json UNIFIED.json --out compare.json

Long prompts beside short chats (issue 30): `--num-prompts` requests at each `--request-rate`,
twice against one deployment: short prompts only (`tandem bench serve`'s random workload flags),
then the same arrival times with `--long-fraction` of them (10%) long, `--long-input-len` x
(1 +- `--long-range-ratio`) tokens (20,000 x (1 +- 0.6): 8k-32k), fresh short prompts (no
prefix-cache hit carries over). Reports TTFT p50 / p99 of the short and the long requests and
TPOT p50 / p99 of the short streams in each load (the H200 command: scripts/gpu_issue30.sh):

    python -m benchmarks.serving long-context --launch --unified --model random:llama-3.1-8b \
        --max-model-len 32832 --random-input-len 1000 --random-range-ratio 0.5 \
        --random-output-len 200 --num-prompts 120 --request-rate 4 --out-dir /tmp/lc

The load generator's own cost: the issue-14 load (random 500-1,500 token prompts, 100-300
output tokens, ignore_eos, 150 requests, Poisson at 5, 15, 25 req/s) from `tandem bench
serve`'s clients against `tandem_services.bench.stream_server` (a real gRPC / SSE server in its own
process that streams one message per 5 ms step per request): the client's cores used (CPU
seconds of its processes over the run's wall time), over gRPC and HTTP, 1 and 2 processes:

    python -m benchmarks.serving client-cost --out benchmarks/results/serving-client-cost.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

from tandem_services.bench.serve import percentile
from tandem_services.bench.workload import Workload, random_workload

DEFAULTS = ["--launch", "--compare-offline", "--request-rate", "2,4,inf"]


def _by_rate(report: dict[str, Any]) -> dict[float, dict[str, Any]]:
    return {float(r["rate"]): r["summary"] for r in report["runs"]}


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _round_up(x: float) -> float:
    """Up to two significant digits: 437.2 -> 440, 8.13 -> 8.2."""
    if x <= 0:
        return 0.0
    step = 10.0 ** (math.floor(math.log10(x)) - 1)
    return round(math.ceil(x / step - 1e-9) * step, 6)


def auto_goodput_limits(unified: dict[str, Any], quantile: float = 99.0) -> dict[str, Any]:
    """TTFT and TPOT limits the unified system just meets at its lowest request rate: its
    `quantile` TTFT and TPOT there, rounded up to two significant digits."""
    runs = [r for r in unified["runs"] if r.get("request_latencies_ms")]
    if not runs:
        raise ValueError("the unified report has no per-request latencies (older bench serve)")
    low = min(runs, key=lambda r: float(r["rate"]))
    lat = low["request_latencies_ms"]
    return {
        "ttft_ms": _round_up(percentile([t for t, _ in lat], quantile)),
        "tpot_ms": _round_up(percentile([p for _, p in lat], quantile)),
        "source": f"unified p{quantile:g} at {low['rate']} req/s, rounded up",
    }


def goodput(run: dict[str, Any], ttft_ms: float, tpot_ms: float) -> float:
    """Requests/s of `run` that finished within both limits."""
    lat = run["request_latencies_ms"]
    good = sum(1 for t, p in lat if t <= ttft_ms and p <= tpot_ms)
    duration = run["summary"]["duration_s"]
    return good / duration if duration else 0.0


def compare(
    disagg: dict[str, Any], unified: dict[str, Any], limits: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Per request rate present in both: TTFT / TPOT / E2E p50 and p99 of each system, the
    differences (disaggregated - unified, ms), the output-throughput ratio and goodput with
    its ratio. Goodput: requests/s within `limits` ({"ttft_ms", "tpot_ms"}, recomputed from
    both reports' per-request latencies) or, without `limits`, within the runs' own
    --goodput-ttft-ms / --goodput-tpot-ms."""
    d_runs, u_runs = _by_rate(disagg), _by_rate(unified)
    if limits is not None:
        for report in (disagg, unified):
            for run in report["runs"]:
                if "request_latencies_ms" not in run:
                    raise ValueError("goodput limits need per-request latencies in both reports")
                run["summary"]["goodput"] = goodput(run, limits["ttft_ms"], limits["tpot_ms"])
    limit_keys = ("goodput_ttft_ms", "goodput_tpot_ms")
    d_args, u_args = disagg.get("args", {}), unified.get("args", {})
    if limits is None and any(d_args.get(k) != u_args.get(k) for k in limit_keys):
        raise ValueError(
            f"the two runs had different goodput limits: "
            f"{[d_args.get(k) for k in limit_keys]} vs {[u_args.get(k) for k in limit_keys]}"
        )
    if disagg.get("workload") != unified.get("workload"):
        raise ValueError(
            f"the two runs had different workloads: {disagg.get('workload')} vs "
            f"{unified.get('workload')}"
        )
    rates: dict[str, Any] = {}
    for rate in sorted(set(d_runs) & set(u_runs)):
        d, u = d_runs[rate], u_runs[rate]
        row: dict[str, Any] = {
            "num_ok": {"disaggregated": d["num_ok"], "unified": u["num_ok"]},
            "output_token_throughput": {
                "disaggregated": d["output_token_throughput"],
                "unified": u["output_token_throughput"],
                "ratio": _ratio(d["output_token_throughput"], u["output_token_throughput"]),
            },
            "goodput": {
                "disaggregated": d.get("goodput", 0.0),
                "unified": u.get("goodput", 0.0),
                "ratio": _ratio(d.get("goodput", 0.0), u.get("goodput", 0.0)),
            },
        }
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
            row[key] = {
                q: {
                    "disaggregated": d[key][q],
                    "unified": u[key][q],
                    "delta": d[key][q] - u[key][q],
                }
                for q in ("p50", "p99")
            }
        rates["inf" if math.isinf(rate) else f"{rate:g}"] = row
    return {
        "benchmark": "serving_disaggregated_vs_unified",
        "workload": disagg.get("workload"),
        "args": {
            k: d_args.get(k)
            for k in (
                "model",
                "dtype",
                "device",
                "input_len",
                "output_len",
                "range_ratio",
                "num_prompts",
            )
        },
        "goodput_limits": limits
        or {"ttft_ms": d_args.get("goodput_ttft_ms"), "tpot_ms": d_args.get("goodput_tpot_ms")},
        "systems": {
            "disaggregated": _placement(d_args),
            "unified": _placement(u_args),
        },
        "by_rate": rates,
    }


def _placement(args: dict[str, Any]) -> dict[str, Any]:
    """How a run's workers were placed (older reports lack these: defaults)."""
    return {
        "num_prefill_workers": args.get("num_prefill_workers", 1),
        "num_unified_workers": args.get("num_unified_workers", 1),
        "gpus": args.get("gpus", []),
        "device": args.get("device"),
    }


def _print(result: dict[str, Any]) -> None:
    print("disaggregated vs unified (same prompts, same arrival times):")
    print(
        f"{'rate':>6} {'ok d/u':>9} {'tok/s d':>9} {'tok/s u':>9} {'TTFT50 d':>9} {'TTFT50 u':>9}"
        f" {'TTFT99 d':>9} {'TTFT99 u':>9} {'TPOT50 d':>9} {'TPOT50 u':>9}"
        f" {'TPOT99 d':>9} {'TPOT99 u':>9} {'good d':>7} {'good u':>7}"
    )
    for rate, r in result["by_rate"].items():
        t, ttft, tpot = r["output_token_throughput"], r["ttft_ms"], r["tpot_ms"]
        print(
            f"{rate:>6} {r['num_ok']['disaggregated']:>4}/{r['num_ok']['unified']:<4}"
            f" {t['disaggregated']:>9.1f} {t['unified']:>9.1f}"
            f" {ttft['p50']['disaggregated']:>9.1f} {ttft['p50']['unified']:>9.1f}"
            f" {ttft['p99']['disaggregated']:>9.1f} {ttft['p99']['unified']:>9.1f}"
            f" {tpot['p50']['disaggregated']:>9.2f} {tpot['p50']['unified']:>9.2f}"
            f" {tpot['p99']['disaggregated']:>9.2f} {tpot['p99']['unified']:>9.2f}"
            f" {r['goodput']['disaggregated']:>7.2f} {r['goodput']['unified']:>7.2f}"
        )


def plot(result: dict[str, Any], path: Path) -> None:
    """Throughput, goodput, TTFT and TPOT (p50 solid, p99 dashed) against request rate, both
    systems."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(result["by_rate"])
    xs = list(range(len(labels)))
    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    for system, color in (("disaggregated", "tab:red"), ("unified", "tab:blue")):
        rows = list(result["by_rate"].values())
        axes[0].plot(xs, [r["output_token_throughput"][system] for r in rows], "o-", color=color)
        axes[1].plot(xs, [r.get("goodput", {}).get(system, 0.0) for r in rows], "o-", color=color)
        for ax, key in ((axes[2], "ttft_ms"), (axes[3], "tpot_ms")):
            ax.plot(
                xs, [r[key]["p50"][system] for r in rows], "o-", color=color, label=f"{system} p50"
            )
            ax.plot(
                xs, [r[key]["p99"][system] for r in rows], "x--", color=color, label=f"{system} p99"
            )
    args = result["args"]
    lim = result.get("goodput_limits") or {}
    goodput_label = (
        f"goodput (req/s; TTFT <= {lim.get('ttft_ms')} ms, TPOT <= {lim.get('tpot_ms')} ms)"
    )
    ylabels = ("output tokens/s", goodput_label, "TTFT (ms)", "TPOT (ms)")
    for ax, ylabel in zip(axes, ylabels, strict=True):
        ax.set_xticks(xs, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
    axes[3].legend(fontsize=7)
    fig.suptitle(
        f"disaggregated (red) vs unified (blue): {args.get('model')} {args.get('dtype')}, "
        f"{args.get('input_len')} in / {args.get('output_len')} out "
        f"(range ratio {args.get('range_ratio')})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving compare")
    p.add_argument("disaggregated", help="JSON of `tandem bench serve --launch`")
    p.add_argument("unified", help="JSON of `tandem bench serve --launch --unified`")
    p.add_argument("--out", required=True, help="the comparison JSON (a PNG beside it)")
    p.add_argument("--no-plot", action="store_true")
    g = p.add_argument_group("goodput limits (default: each run's own)")
    g.add_argument("--goodput-ttft-ms", type=float, default=None)
    g.add_argument("--goodput-tpot-ms", type=float, default=None)
    g.add_argument(
        "--goodput-auto",
        action="store_true",
        help="limits = the unified run's p99 TTFT and TPOT at its lowest rate, rounded up",
    )
    ns = p.parse_args(argv)
    disagg = json.loads(Path(ns.disaggregated).read_text())
    unified = json.loads(Path(ns.unified).read_text())
    limits: dict[str, Any] | None = None
    if ns.goodput_auto:
        limits = auto_goodput_limits(unified)
    elif ns.goodput_ttft_ms is not None or ns.goodput_tpot_ms is not None:
        limits = {
            "ttft_ms": math.inf if ns.goodput_ttft_ms is None else ns.goodput_ttft_ms,
            "tpot_ms": math.inf if ns.goodput_tpot_ms is None else ns.goodput_tpot_ms,
            "source": "given",
        }
    if limits is not None:
        print(f"goodput limits: TTFT <= {limits['ttft_ms']} ms, TPOT <= {limits['tpot_ms']} ms")
    result = compare(disagg, unified, limits)
    _print(result)
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if not ns.no_plot:
        plot(result, out.with_suffix(".png"))
        print(f"wrote {out.with_suffix('.png')}")
    return 0


def client_cost_main(argv: list[str]) -> int:
    """The client's CPU per backend, rate and process count against the stream server."""
    import datetime as dt
    import os
    import platform
    import time

    from tandem_services.bench.client import Target, run_load
    from tandem_services.bench.metrics import summarize
    from tandem_services.bench.stream_server import Schedule, StreamServerProcess
    from tandem_services.bench.workload import random_workload

    p = argparse.ArgumentParser(prog="python -m benchmarks.serving client-cost")
    p.add_argument("--backends", default="grpc,http")
    p.add_argument("--request-rate", default="5,15,25")
    p.add_argument("--num-client-procs", default="1,2", help="a comma list")
    p.add_argument("--num-prompts", type=int, default=150)
    p.add_argument("--random-input-len", type=int, default=1000)
    p.add_argument("--random-output-len", type=int, default=200)
    p.add_argument("--random-range-ratio", type=float, default=0.5)
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="JSON of the figures")
    ns = p.parse_args(argv)
    workload = random_workload(
        ns.num_prompts,
        ns.random_input_len,
        ns.random_output_len,
        ns.random_range_ratio,
        49152,
        ns.seed,
    )
    schedule = Schedule(ns.step_ms, ns.ttft_ms)
    rows = []
    print(
        f"{'backend':>8} {'procs':>5} {'rate':>5} {'ok':>4} {'out tok/s':>9} {'TTFT p50':>8}"
        f" {'TPOT p50':>8} {'ITL p50':>7} {'client cores':>12} {'busiest proc':>12}"
        f" {'server cores':>12}"
    )
    with StreamServerProcess(schedule) as server:
        for backend in ns.backends.split(","):
            address = server.grpc_address if backend == "grpc" else server.http_url
            for procs in (int(x) for x in ns.num_client_procs.split(",")):
                for rate in (float(x) for x in ns.request_rate.split(",")):
                    s0, w0 = server.cpu_s(), time.perf_counter()
                    run = run_load(
                        Target(backend, address), workload, rate, seed=ns.seed, num_procs=procs
                    )
                    server_cores = (server.cpu_s() - s0) / (time.perf_counter() - w0)
                    s = summarize(run.results, run.duration_s, client_cpu=run.cpu)
                    row = {
                        "backend": backend,
                        "num_client_procs": procs,
                        "request_rate": rate,
                        "server_cores_used": server_cores,
                        **{
                            k: s[k]
                            for k in (
                                "completed",
                                "duration",
                                "output_throughput",
                                "median_ttft_ms",
                                "p99_ttft_ms",
                                "median_tpot_ms",
                                "p99_tpot_ms",
                                "median_itl_ms",
                                "client_cpu_s",
                                "client_wall_s",
                                "client_cores_used",
                                "client_max_proc_cores_used",
                            )
                        },
                    }
                    rows.append(row)
                    print(
                        f"{backend:>8} {procs:>5} {rate:>5g} {s['completed']:>4}"
                        f" {s['output_throughput']:>9.0f} {s['median_ttft_ms']:>8.1f}"
                        f" {s['median_tpot_ms']:>8.2f} {s['median_itl_ms']:>7.2f}"
                        f" {s['client_cores_used']:>12.3f} {s['client_max_proc_cores_used']:>12.3f}"
                        f" {server_cores:>12.3f}",
                        flush=True,
                    )
    if ns.out:
        report = {
            "benchmark": "serving_client_cost",
            "date": dt.datetime.now().isoformat(timespec="seconds"),
            "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "schedule": {"step_ms": ns.step_ms, "ttft_ms": ns.ttft_ms},
            "workload": {
                "num_prompts": ns.num_prompts,
                "random_input_len": ns.random_input_len,
                "random_output_len": ns.random_output_len,
                "random_range_ratio": ns.random_range_ratio,
                "prompt_tokens": sum(len(x) for x in workload.prompts),
                "output_tokens": sum(workload.output_lens),
            },
            "runs": rows,
        }
        out = Path(ns.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


# ----------------------------------------------------------------------------- long context


def long_context_workloads(
    num: int,
    short: tuple[int, int, float],
    long: tuple[int, int, float],
    long_fraction: float,
    vocab: int,
    seed: int,
) -> tuple[Workload, Workload, list[bool]]:
    """The two loads of `long-context`, `num` requests each at the same arrival offsets:
    short prompts only, and the mixed load where `round(num * long_fraction)` requests at
    seeded positions are long (`(input_len, output_len, range_ratio)` each, vLLM's random
    dataset). The two loads' short prompts are drawn apart (no prefix-cache hit carries from
    one to the other). Returns (short only, mixed, which requests of the mixed load are long)."""
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"--long-fraction must be in [0, 1], got {long_fraction}")
    num_long = round(num * long_fraction)
    rng = random.Random(seed + 7)
    is_long = [False] * num
    for i in rng.sample(range(num), num_long):
        is_long[i] = True
    short_only = random_workload(num, *short, vocab, seed)
    fresh_short = random_workload(num - num_long, *short, vocab, seed + 1)
    longs = random_workload(num_long, *long, vocab, seed + 2)
    prompts, outs = [], []
    next_short, next_long = iter(range(num - num_long)), iter(range(num_long))
    for flag in is_long:
        src, k = (longs, next(next_long)) if flag else (fresh_short, next(next_short))
        prompts.append(src.prompts[k])
        outs.append(src.output_lens[k])
    return short_only, Workload(prompts, outs), is_long


def class_summary(results: list[Any], is_long: list[bool]) -> dict[str, Any]:
    """TTFT (ms, p50 / p99) of the long and the short requests that finished, TPOT (ms, p50 /
    p99) and output tokens of the short streams, counts."""

    def stats(values: list[float]) -> dict[str, float]:
        ms = [v * 1000 for v in values]
        return {"p50": percentile(ms, 50), "p99": percentile(ms, 99)} if ms else {}

    out: dict[str, Any] = {}
    for name, want in (("short", False), ("long", True)):
        mine = [r for r, flag in zip(results, is_long, strict=True) if flag == want]
        ok = [r for r in mine if r.ok]
        out[name] = {
            "num": len(mine),
            "num_ok": len(ok),
            "ttft_ms": stats([r.ttft_s for r in ok]),
            "tpot_ms": stats([r.tpot_s for r in ok if r.output_len > 1]),
            "prompt_tokens": sum(r.prompt_len for r in mine),
        }
        errors = sorted({r.error for r in mine if not r.ok and r.error})
        if errors:
            out[name]["errors"] = errors[:5]
    return out


def long_context_main(argv: list[str]) -> int:
    """Long prompts beside short chats against short chats alone, one deployment, one run."""
    import datetime as dt

    from tandem.loader import load_hf_config, load_tokenizer, resolve_model_path
    from tandem_services.bench.client import Target, run_load
    from tandem_services.bench.ready import NotReadyError, wait_until_serving
    from tandem_services.bench.serve import build_parser, launch, set_cpu_threads

    p = build_parser()
    p.prog = "python -m benchmarks.serving long-context"
    g = p.add_argument_group("long context")
    g.add_argument("--long-fraction", type=float, default=0.1, help="share of long requests")
    g.add_argument("--long-input-len", type=int, default=20000)
    g.add_argument("--long-output-len", type=int, default=64)
    g.add_argument(
        "--long-range-ratio", type=float, default=0.6, help="20,000 x (1 +- 0.6): 8k-32k"
    )
    ns = p.parse_args(argv)
    if not ns.url and not ns.launch:
        p.error("give --url of a running frontend or --launch")
    model_path = resolve_model_path(ns.model, ns.cache_dir or None)
    tokenizer = load_tokenizer(model_path)
    vocab = int(getattr(load_hf_config(model_path), "vocab_size", len(tokenizer)))
    try:
        short_only, mixed, is_long = long_context_workloads(
            ns.num_prompts,
            (ns.input_len, ns.output_len, ns.range_ratio),
            (ns.long_input_len, ns.long_output_len, ns.long_range_ratio),
            ns.long_fraction,
            vocab,
            ns.seed,
        )
    except ValueError as exc:
        p.error(str(exc))
    rates = [math.inf if x.strip() == "inf" else float(x) for x in ns.request_rate.split(",")]
    stem = ns.name or "serving-long-context"
    rows: list[dict[str, Any]] = []
    out = Path(ns.out_dir) / f"{stem}.json"

    def write_report() -> None:
        """The JSON so far (rewritten after every load: a run cut short keeps what it did)."""
        report = {
            "benchmark": "serving_long_context",
            "date": dt.datetime.now().isoformat(timespec="seconds"),
            "args": {k: v for k, v in vars(ns).items() if isinstance(v, str | int | float | bool)},
            "workload": {
                "num_prompts": ns.num_prompts,
                "num_long": sum(is_long),
                "long_prompt_tokens": [
                    len(q) for q, f in zip(mixed.prompts, is_long, strict=True) if f
                ],
                "short_prompt_tokens": {
                    "short-only": sum(len(q) for q in short_only.prompts),
                    "mixed": sum(
                        len(q) for q, f in zip(mixed.prompts, is_long, strict=True) if not f
                    ),
                },
            },
            "runs": rows,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")

    set_cpu_threads(ns)
    deployment = launch(ns, stem) if ns.launch else None
    try:
        if deployment is not None:
            url = deployment.grpc_address if ns.backend == "grpc" else deployment.http_address
            ready_url = deployment.http_address
        else:
            url = ns.url
            ready_url = ns.ready_url or (url if ns.backend == "http" else "")
        if ns.backend == "http" and not url.startswith("http"):
            url = f"http://{url}"
        if ready_url:
            try:
                wait_until_serving(ready_url, ns.ready_check_timeout_sec, ns.api_key)
            except NotReadyError as exc:
                print(f"long-context: {exc}", file=sys.stderr, flush=True)
                return 1
        target = Target(ns.backend, url, ns.api_key, ns.model, ns.ignore_eos)
        warm_rng = random.Random(ns.seed + 99)
        warm = Workload([[warm_rng.randrange(100, 1000) for _ in range(16)]] * 2, [4, 4])
        run_load(target, warm, math.inf, seed=ns.seed)
        print(
            f"{'rate':>6} {'load':<12} {'ok':>7} {'TTFT short p50/p99':>20}"
            f" {'TTFT long p50/p99':>20} {'TPOT short p50/p99':>20}",
            flush=True,
        )
        for rate in rates:
            for load, workload, flags in (
                ("short-only", short_only, [False] * short_only.num_requests),
                ("mixed", mixed, is_long),
            ):
                run = run_load(
                    target,
                    workload,
                    rate,
                    seed=ns.seed,
                    burstiness=ns.burstiness,
                    max_concurrency=ns.max_concurrency,
                    num_procs=ns.num_client_procs,
                )
                summary = class_summary(run.results, flags)
                rows.append({"rate": rate, "load": load, "duration_s": run.duration_s, **summary})
                write_report()
                sh, lg = summary["short"], summary["long"]

                def pair(d: dict[str, float]) -> str:
                    return f"{d['p50']:.1f}/{d['p99']:.1f}" if d else "-"

                print(
                    f"{rate:>6g} {load:<12} {sh['num_ok'] + lg['num_ok']:>3}/{len(flags):<3}"
                    f" {pair(sh['ttft_ms']):>20} {pair(lg['ttft_ms']):>20}"
                    f" {pair(sh['tpot_ms']):>20}",
                    flush=True,
                )
    finally:
        if deployment is not None:
            deployment.stop()
    print(f"wrote {out}")
    failed = [r for r in rows if r["short"]["num_ok"] + r["long"]["num_ok"] == 0]
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["compare"]:
        return compare_main(argv[1:])
    if argv[:1] == ["long-context"]:
        return long_context_main(argv[1:])
    if argv[:1] == ["client-cost"]:
        return client_cost_main(argv[1:])
    from tandem_services.bench.serve import main as bench_main

    name = "serving-unified" if "--unified" in argv else "serving-disaggregated"
    return bench_main([*DEFAULTS, "--name", name, *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
