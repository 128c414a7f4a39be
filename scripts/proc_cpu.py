"""Samples the CPU time of every tandem service process (and its engine-core child) until
stopped (SIGTERM/SIGINT), then writes one JSON summary: per process, CPU seconds (user +
system) over the sampled window and the cores that makes.

    python scripts/proc_cpu.py OUT.json [--interval-s 0.5]

A process is a service when its command line names `tandem_services.<name>` (the module
`tandem serve` starts it as); its children (the engine-core process) are reported as
`<name>/engine`. The benchmark's own client is the `bench` process (command line with
`bench serve`): its figure here spans its whole life (imports, workload set-up), while the
cores it reports itself (`client_cores_used`) span the load only.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from typing import Any

import psutil


def _label(p: psutil.Process) -> str | None:
    try:
        cmd = " ".join(p.cmdline())
    except (psutil.Error, OSError):
        return None
    for part in cmd.split():
        if part.startswith("tandem_services."):
            name = part.removeprefix("tandem_services.")
            for flag in ("--worker-id",):
                if flag in cmd:
                    name += ":" + cmd.split(flag, 1)[1].split()[0]
            return name
    if "bench serve" in cmd or "bench.serve" in cmd:
        return "bench"
    return None


def _sample() -> dict[int, tuple[str, float]]:
    out: dict[int, tuple[str, float]] = {}
    for p in psutil.process_iter():
        label = _label(p)
        if label is None:
            continue
        try:
            t = p.cpu_times()
            out[p.pid] = (label, t.user + t.system)
            for c in p.children():
                if c.pid in out:
                    continue
                ct = c.cpu_times()
                sub = "engine" if "multiprocessing" in " ".join(c.cmdline()) else c.name()
                if "resource_tracker" in " ".join(c.cmdline()):
                    continue
                out[c.pid] = (f"{label}/{sub}", ct.user + ct.system)
        except (psutil.Error, OSError):
            continue
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--interval-s", type=float, default=0.5)
    ns = ap.parse_args()
    first: dict[int, tuple[str, float, float]] = {}
    last: dict[int, tuple[str, float, float]] = {}
    stop = False

    def on_signal(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop:
        now = time.monotonic()
        for pid, (label, cpu) in _sample().items():
            first.setdefault(pid, (label, cpu, now))
            last[pid] = (label, cpu, now)
        time.sleep(ns.interval_s)
    report = []
    for pid, (label, cpu1, t1) in last.items():
        _, cpu0, t0 = first[pid]
        wall = t1 - t0
        report.append(
            {
                "pid": pid,
                "process": label,
                "cpu_s": round(cpu1 - cpu0, 3),
                "wall_s": round(wall, 3),
                "cores": round((cpu1 - cpu0) / wall, 3) if wall > 0 else 0.0,
            }
        )
    report.sort(key=lambda r: r["process"])
    with open(ns.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
