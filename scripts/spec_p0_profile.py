"""Diagnostic (wave 3, session 10): where a speculative engine that has stopped drafting
(p = 0, forced record, synchronous steps) spends the ~3% it loses to the engine without
speculation at batch 128 on the H200. Interleaved timings, then one torch.profiler trace of
each engine's generate: CUDA kernels and host ops, the top of each table.

    python scripts/spec_p0_profile.py --batch 128 --k 4 --out DIR
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import tandem  # noqa: F401

# isort: split
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.forced_replay import ForceRecorded, forced_params
from tandem import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--profile-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rule", default="measured")
    ap.add_argument("--out", default=".")
    ns = ap.parse_args()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    kw = dict(
        model="random:llama-3.1-8b",
        device="cuda",
        dtype="bfloat16",
        max_model_len=4096,
        gpu_memory_utilization=0.4,
        logits_processors=[ForceRecorded],
        async_scheduling="off",
    )
    base = LLM(**kw)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 128000) for _ in range(64)] for _ in range(ns.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    rec = [list(o.outputs[0].token_ids) for o in base.generate(prompts, params, use_tqdm=False)]
    fp = forced_params(params, rec)
    short = forced_params(
        SamplingParams(temperature=0.0, max_tokens=ns.profile_len, ignore_eos=True), rec
    )
    path = Path(tempfile.mkdtemp()) / "replay.json"
    path.write_text(
        json.dumps(
            [
                {"prompt_token_ids": a, "output_token_ids": b}
                for a, b in zip(prompts, rec, strict=True)
            ]
        )
    )
    spec = LLM(
        **kw,
        speculative_config={
            "method": "replay",
            "num_speculative_tokens": ns.k,
            "replay_path": str(path),
            "replay_acceptance": 0.0,
            "speculation_rule": ns.rule,
        },
    )
    spec.generate(prompts, fp, use_tqdm=False)
    times: dict[str, list[float]] = {"base": [], "spec": []}
    for _ in range(ns.repeats):
        for name, llm in (("base", base), ("spec", spec)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(prompts, fp, use_tqdm=False)
            times[name].append((time.perf_counter() - t0) * 1000 / ns.output_len)
    report = {n: statistics.median(v) for n, v in times.items()}
    print("ms per token", times, "median ratio", report["spec"] / report["base"], flush=True)
    print("rule", spec.engine.stats().spec_decode_rule, flush=True)
    for name, llm in (("base", base), ("spec", spec)):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            llm.generate(prompts, short, use_tqdm=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        ka = prof.key_averages()
        cuda_total = sum(getattr(e, "self_device_time_total", 0) for e in ka) / 1000
        print(f"==== {name}: wall {wall * 1000:.1f} ms, CUDA {cuda_total:.1f} ms", flush=True)
        print(ka.table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60))
        print(ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    (out / "times.json").write_text(json.dumps(times))


if __name__ == "__main__":
    main()
