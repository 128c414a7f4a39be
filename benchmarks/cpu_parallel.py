"""Tensor and pipeline parallel on the CPU against one rank (issue 27): the embedded model's
offline throughput at TP = 1 (in-process), PP = 2 and TP = 3 (gloo ranks, the cores split
between them), same prompts, same greedy tokens. Prints output tok/s and writes JSON.

    python -m benchmarks.cpu_parallel --out benchmarks/results/cpu_parallel.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import time
from pathlib import Path
from typing import Any

LAYOUTS: dict[str, dict[str, Any]] = {
    "tp1": {},
    "pp2": {"pipeline_parallel_size": 2},
    "tp3": {"tensor_parallel_size": 3},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--layouts", default="tp1,pp2,tp3")
    p.add_argument("--out", default="")
    ns = p.parse_args()
    from tandem import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(ns.input_len)]}
        for _ in range(ns.num_prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
    results: dict[str, Any] = {}
    tokens: dict[str, list[list[int]]] = {}
    for name in ns.layouts.split(","):
        t0 = time.perf_counter()
        llm = LLM("default", device="cpu", dtype=ns.dtype, **LAYOUTS[name])
        load_s = time.perf_counter() - t0
        llm.generate(prompts[:2], params.clone(max_tokens=4), use_tqdm=False)  # warm up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        llm.shutdown()
        tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
        n = sum(len(t) for t in tokens[name])
        results[name] = {"output_tok_s": n / elapsed, "elapsed_s": elapsed, "load_s": load_s}
        print(f"{name}: {n / elapsed:.1f} output tok/s ({elapsed:.1f} s, loaded in {load_s:.1f} s)")
    base = results.get("tp1", {}).get("output_tok_s")
    for name, r in results.items():
        if base:
            r["vs_tp1"] = r["output_tok_s"] / base
        r["same_tokens_as_tp1"] = tokens.get("tp1") == tokens[name] if "tp1" in tokens else None
    print(
        json.dumps(
            {
                k: {kk: round(v, 3) if isinstance(v, float) else v for kk, v in r.items()}
                for k, r in results.items()
            }
        )
    )
    out = ns.out or f"benchmarks/results/cpu_parallel_{dt.date.today()}.json"
    Path(out).write_text(
        json.dumps(
            {
                "benchmark": "cpu_parallel",
                "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "workload": vars(ns),
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
