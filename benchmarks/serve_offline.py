"""The offline engine on the same requests `tandem bench serve` sends: the figure a served
run's throughput is held against (issue: all at once, at least 90% of this).

    python -m benchmarks.serve_offline --model random:llama-3.1-8b --dtype bfloat16 \
        --num-prompts 150 --input-len 1000 --output-len 200 --range-ratio 0.5 \
        --request-rate inf --out offline.json

The workload (prompts, output lengths, arrival times) is drawn exactly as `tandem bench serve`
draws it from the same flags and seed (`--seeds`: one per rate, so that no rate's prompts hit
the prefix cache another rate filled; the cache is also reset between rates); the engine is
built from the same engine flags, and stepped in this process with no transport
(`tandem_services.bench.serve.run_offline`).
"""

from __future__ import annotations

import argparse
import json
import math
import time

from tandem.config import EngineArgs, add_engine_args
from tandem.engine.core import EngineCore
from tandem.loader import load_hf_config, load_tokenizer, resolve_model_path
from tandem_services.bench.serve import (
    Workload,
    random_workload,
    run_offline,
    summarize,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p)
    w = p.add_argument_group("workload (as tandem bench serve)")
    w.add_argument("--num-prompts", type=int, default=64)
    w.add_argument("--input-len", type=int, default=64)
    w.add_argument("--output-len", type=int, default=32)
    w.add_argument("--range-ratio", type=float, default=0.0)
    w.add_argument("--request-rate", default="inf", help="comma-separated rates (req/s)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument(
        "--seeds",
        default="",
        help="one workload seed per rate (comma-separated; default: --seed for every rate)",
    )
    w.add_argument("--warmup", type=int, default=4, help="short requests run before timing")
    p.add_argument("--out", default="")
    ns = p.parse_args(argv)
    t0 = time.perf_counter()
    engine = EngineCore(EngineArgs.from_cli_args(ns).create_engine_config())
    startup_s = time.perf_counter() - t0
    model_path = resolve_model_path(ns.model, ns.cache_dir or None)
    vocab = int(getattr(load_hf_config(model_path), "vocab_size", len(load_tokenizer(model_path))))
    rates = [float(r) for r in ns.request_rate.split(",")]
    seeds = [int(x) for x in ns.seeds.split(",")] if ns.seeds else [ns.seed] * len(rates)
    if len(seeds) != len(rates):
        p.error("--seeds needs one seed per rate")
    warm = Workload([[100 + i for i in range(16)] for _ in range(ns.warmup)], [4] * ns.warmup)
    run_offline(engine, warm, math.inf, 0, ns.seed)
    runs = []
    for rate, seed in zip(rates, seeds, strict=True):
        workload = random_workload(
            ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio, vocab, seed
        )
        engine.scheduler.reset_prefix_cache()
        results, duration = run_offline(engine, workload, rate, 0, seed)
        summary = summarize(results, duration, None, None)
        runs.append(
            {
                "system": "offline-engine",
                "rate": rate,
                "seed": seed,
                "workload": {
                    "prompt_tokens": sum(len(x) for x in workload.prompts),
                    "output_tokens": sum(workload.output_lens),
                },
                "summary": summary,
            }
        )
        print(
            f"offline rate {rate}: {summary['output_token_throughput']:.0f} output tok/s, "
            f"TTFT p50 {summary['ttft_ms']['p50']:.1f} p99 {summary['ttft_ms']['p99']:.1f} ms, "
            f"TPOT p50 {summary['tpot_ms']['p50']:.2f} p99 {summary['tpot_ms']['p99']:.2f} ms",
            flush=True,
        )
    report = {
        "benchmark": "serve_offline",
        "startup_s": startup_s,
        "runs": runs,
    }
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
