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
import sys
from pathlib import Path
from typing import Any

from tandem_services.bench.serve import percentile

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


def main(argv: list[str]) -> int:
    if argv[:1] == ["compare"]:
        return compare_main(argv[1:])
    if argv[:1] == ["client-cost"]:
        return client_cost_main(argv[1:])
    from tandem_services.bench.serve import main as bench_main

    name = "serving-unified" if "--unified" in argv else "serving-disaggregated"
    return bench_main([*DEFAULTS, "--name", name, *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
