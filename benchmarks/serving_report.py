"""Merges one `scripts/gpu_issue14.sh` run into one JSON and a table against vLLM's figures.

    python -m benchmarks.serving_report RESULTS_DIR OUT.json [--same-prompts]  # OUT.png too
    python -m benchmarks.serving_report --plot-only OUT.json        # the PNG of a merged JSON

RESULTS_DIR holds `offline_<when>.json` (benchmarks.serve_offline), and per served run NAME:
`NAME_startup.json`, `NAME_<rate>.json` (tandem bench serve) and `NAME_cpu_<rate>.json`
(scripts/proc_cpu.py). vLLM's figures are an issue's (vLLM 0.26 `vllm serve` at its defaults,
`vllm bench serve` with the same load, on one H200); they were not measured here, and a ratio
to them holds only for a run on an H200. Which issue's: the load's prompts decide. Fresh
prompts per rate (gpu_issue14.sh's default) are issue 30's workload; `--same-prompts` (its
SAME_PROMPTS=1: every rate sends the first rate's prompts, which later rates find in the
prefix cache) is issue 14's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# rate -> TTFT p50, TTFT p99, TPOT p50, TPOT p99 (ms), output tok/s of vLLM 0.26 on one H200;
# None where the issue does not give it.
VllmRow = tuple[float | None, float | None, float | None, float | None, float | None]
# Issue 14: the same prompts at every rate (later rates hit the prefix cache).
VLLM_H200_SAME_PROMPTS: dict[str, VllmRow] = {
    "5": (53, 106, 6.04, 7.47, None),
    "15": (33, 58, 6.29, 7.34, None),
    "25": (36, 56, 7.15, 7.84, None),
}
# Issue 30: fresh prompts per rate.
VLLM_H200_FRESH_PROMPTS: dict[str, VllmRow] = {
    "5": (None, 116, 6.11, None, None),
    "15": (None, 114, 9.41, None, None),
    "25": (None, 200, 17.60, None, None),
    "inf": (None, 3820, 18.93, None, 4539),
}


def vllm_figures(same_prompts: bool) -> tuple[str, dict[str, VllmRow]]:
    """The issue whose vLLM figures match the load (module docstring), and its table."""
    if same_prompts:
        return "issue 14, same prompts every rate", VLLM_H200_SAME_PROMPTS
    return "issue 30, fresh prompts per rate", VLLM_H200_FRESH_PROMPTS


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _rate_key(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}"


def _load(path: Path) -> Any:
    return json.loads(path.read_text())


def _by_process(samples: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """CPU seconds and cores summed over the processes of one label."""
    out: dict[str, dict[str, float]] = {}
    for c in samples:
        entry = out.setdefault(c["process"], {"cores": 0.0, "cpu_s": 0.0})
        entry["cores"] = round(entry["cores"] + c["cores"], 3)
        entry["cpu_s"] = round(entry["cpu_s"] + c["cpu_s"], 3)
    return out


def plot(report: dict[str, Any], path: Path) -> bool:
    """TTFT p99 and TPOT p50/p99 by rate for every served run beside vLLM's (the issue's
    table); False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    # A report merged before the two tables (its key "vllm_h200_issue14") had issue 14's.
    vllm = report.get("vllm_h200") or {
        "workload": "issue 14, same prompts every rate",
        "rates": report["vllm_h200_issue14"],
    }
    workload, table = vllm["workload"], vllm["rates"]
    rates = sorted((r for r in table if r != "inf"), key=float)
    panels = [("TTFT p99 (ms)", "ttft_ms", "p99", 1), ("TPOT p50 (ms)", "tpot_ms", "p50", 2)]
    panels.append(("TPOT p99 (ms)", "tpot_ms", "p99", 3))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (title, metric, pct, vllm_col) in zip(axes, panels, strict=True):
        xs = [float(r) for r in rates]
        known = [r for r in rates if table[r][vllm_col] is not None]
        ax.plot(
            [float(r) for r in known], [table[r][vllm_col] for r in known], "k--o",
            label="vLLM 0.26, H200 (issue)",
        )  # fmt: skip
        for name, entry in report["served"].items():
            got = [r for r in rates if r in entry["rates"]]
            ys = [entry["rates"][r]["summary"][metric][pct] for r in got]
            ax.plot([float(r) for r in got], ys, "-o", label=f"tandem {name}")
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.set_xticks(xs)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"tandem serve, random 8B shape; vLLM: {workload}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--plot-only":
        merged = Path(argv[1])
        ok = plot(_load(merged), merged.with_suffix(".png"))
        print(f"wrote {merged.with_suffix('.png')}" if ok else "matplotlib is missing")
        return 0 if ok else 1
    res, out = Path(argv[0]), Path(argv[1])
    workload, table = vllm_figures("--same-prompts" in argv[2:])
    report: dict[str, Any] = {
        "vllm_h200": {"workload": workload, "rates": table},
        "served": {},
        "offline": {},
    }
    for offline_path in sorted(res.glob("offline*.json")):
        off = _load(offline_path)
        label = offline_path.stem.removeprefix("offline").removeprefix("_") or "first"
        for run in off["runs"]:
            report["offline"][f"{label}/{_rate_key(run['rate'])}"] = run["summary"]
    for startup in sorted(res.glob("*_startup.json")):
        name = _load(startup)["name"]
        entry: dict[str, Any] = {"startup_s": _load(startup)["startup_s"], "rates": {}}
        for bench in sorted(res.glob(f"{name}_*.json")):
            stem = bench.stem.removeprefix(f"{name}_")
            if stem == "startup" or stem.startswith("cpu_") or "_" in stem:
                continue
            data = _load(bench)
            served = next(r for r in data["runs"] if r["system"].startswith("serve"))
            s = served["summary"]
            cpu_path = res / f"{name}_cpu_{stem}.json"
            cpu = _load(cpu_path) if cpu_path.exists() else []
            entry["rates"][stem] = {
                "summary": s,
                "cpu": _by_process(cpu),
            }
        report["served"][name] = entry
    out.write_text(json.dumps(report, indent=1))
    lines = [
        "| run | req/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | out tok/s | cores (process) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, entry in report["served"].items():
        for rate, r in sorted(entry["rates"].items(), key=lambda kv: float(kv[0])):
            s = r["summary"]
            cores = ", ".join(
                f"{'bench (its whole life)' if p == 'bench' else p} {c['cores']:.2f}"
                for p, c in sorted(r["cpu"].items())
            )
            if "client_cores_used" in s:  # the load generator's own, over the load only
                cores = (
                    f"bench (load) {s['client_cores_used']:.2f}" + (", " if cores else "") + cores
                )
            lines.append(
                f"| {name} | {rate} | {s['ttft_ms']['p50']:.1f} | {s['ttft_ms']['p99']:.1f} | "
                f"{s['tpot_ms']['p50']:.2f} | {s['tpot_ms']['p99']:.2f} | "
                f"{s['output_token_throughput']:.0f} | {cores} |"
            )
            if rate in table:
                cells = " | ".join(_cell(v) for v in table[rate])
                lines.append(f"| vLLM, H200 ({workload.split(',')[0]}) | {rate} | {cells} | |")
    for rate, s in report["offline"].items():
        lines.append(
            f"| offline engine | {rate} | {s['ttft_ms']['p50']:.1f} | {s['ttft_ms']['p99']:.1f} "
            f"| {s['tpot_ms']['p50']:.2f} | {s['tpot_ms']['p99']:.2f} | "
            f"{s['output_token_throughput']:.0f} | |"
        )
    for name, entry in report["served"].items():
        lines.append(f"{name}: answered {entry['startup_s']}s after start")
        inf = entry["rates"].get("inf")
        for key, off in report["offline"].items():
            if inf and key.endswith("/inf") and off["output_token_throughput"]:
                ratio = inf["summary"]["output_token_throughput"] / off["output_token_throughput"]
                lines.append(
                    f"{name}: all at once {ratio:.1%} of the offline engine's throughput "
                    f"({key.split('/')[0]} run)"
                )
    print("\n".join(lines))
    if plot(report, out.with_suffix(".png")):
        print(f"wrote {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
