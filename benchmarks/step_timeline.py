"""Where a whole offline run's time goes, step by step (GPU).

Runs one workload (default 1024 prompts of 512 tokens, 256 output tokens, llama-3.1-8b shape,
bf16) through the engine one `step()` at a time, as the offline benchmark does, and records for
every step its plan (decode requests, prefill tokens, requests) and the wall time until the
next step returned. Under async scheduling a step's call returns the previous step's tokens,
so the time between two returns is the device time of the step launched in between.

Prints the time by phase: mixed steps (prefill tokens present), full-batch decode steps, and
the tail (decode batches below the peak), with tokens and ms per step in each.

    python -m benchmarks.step_timeline --out timeline.json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch


def summarise(plans: list[tuple[int, int, int]], stamps: list[float]) -> dict[str, Any]:
    """Per-step times and the time by phase. Step k (plans[k]) was launched by call k and
    waited for by call k + 1; stamps[0] is the start, stamps[k + 1] call k's return."""
    steps = []
    for k, (dec, pre, reqs) in enumerate(plans):
        end = stamps[min(k + 2, len(stamps) - 1)]
        steps.append(
            {"decodes": dec, "prefill_tokens": pre, "reqs": reqs, "ms": (end - stamps[k + 1]) * 1e3}
        )
    peak = max((s["decodes"] for s in steps if s["prefill_tokens"] == 0), default=0)
    phases: dict[str, dict[str, float]] = {}
    for s in steps:
        if s["prefill_tokens"]:
            name = "mixed"
        elif s["decodes"] >= peak:
            name = "decode_full"
        elif s["decodes"] >= 256:
            name = "decode_tail_256+"
        else:
            name = "decode_tail_<256"
        ph = phases.setdefault(
            name, {"steps": 0, "s": 0.0, "decode_tokens": 0, "prefill_tokens": 0}
        )
        ph["steps"] += 1
        ph["s"] += s["ms"] / 1e3
        ph["decode_tokens"] += s["decodes"]
        ph["prefill_tokens"] += s["prefill_tokens"]
    return {
        "elapsed_s": stamps[-1] - stamps[0],
        "peak_decode_batch": peak,
        "phases": phases,
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> int:
    from benchmarks.offline_workload import make_prompts
    from tandem import LLM, SamplingParams
    from tandem.request import EngineCoreRequest

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=1, help="runs of the workload, in turn")
    ap.add_argument("--out", default="")
    ns = ap.parse_args(argv)

    llm = LLM(
        model=ns.model,
        dtype=ns.dtype,
        device=ns.device,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
    )
    eng = llm.engine
    vocab = eng.model_runner.hf_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    warm = make_prompts(4, ns.input_len, vocab, 7)
    llm.generate([{"prompt_token_ids": p} for p in warm], params.clone(max_tokens=4))

    plans: list[tuple[int, int, int]] = []
    schedule = eng.scheduler.schedule

    def recording_schedule() -> Any:
        so = schedule()
        counts = so.num_scheduled_tokens
        decodes = sum(1 for n in counts.values() if n == 1)
        plans.append((decodes, so.total_num_scheduled_tokens - decodes, len(counts)))
        return so

    eng.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    runs = []
    for run_idx in range(ns.repeat):
        eng.scheduler.kv_cache_manager.reset_prefix_cache()
        plans.clear()
        prompts = make_prompts(ns.num_prompts, ns.input_len, vocab, ns.input_len + run_idx)
        for i, p in enumerate(prompts):
            eng.add_request(EngineCoreRequest(f"run{run_idx}-{i}", p, params, eos_token_id=None))
        eng.model_runner.synchronize()
        stamps = [time.perf_counter()]
        while eng.has_unfinished_requests():
            eng.step()
            stamps.append(time.perf_counter())
        eng.model_runner.synchronize()
        stamps.append(time.perf_counter())
        run = summarise(plans, stamps)
        runs.append(run)
        print(
            f"run {run_idx}: elapsed {run['elapsed_s']:.2f} s over "
            f"{len(run['steps'])} steps (peak decode batch {run['peak_decode_batch']})"
        )
        for name, ph in run["phases"].items():
            print(
                f"  {name:18s} {ph['steps']:4d} steps {ph['s']:7.2f} s "
                f"({1e3 * ph['s'] / max(ph['steps'], 1):6.1f} ms/step) decode tokens "
                f"{ph['decode_tokens']:7d} prefill tokens {ph['prefill_tokens']:7d}",
                flush=True,
            )
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(
                {
                    "benchmark": "step_timeline",
                    "device": torch.cuda.get_device_name() if ns.device != "cpu" else "cpu",
                    "torch": torch.__version__,
                    "model": ns.model,
                    "workload": vars(ns),
                    "runs": runs,
                },
                f,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
