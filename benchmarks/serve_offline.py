"""The offline engine on the same requests `tandem bench serve` sends: the figure a served
run's throughput is held against (issue: all at once, at least 90% of this).

    python -m benchmarks.serve_offline --model random:llama-3.1-8b --dtype bfloat16 \
        --num-prompts 150 --input-len 1000 --output-len 200 --range-ratio 0.5 \
        --request-rate inf --out offline.json

The workload (prompts, output lengths, arrival times) is drawn exactly as `tandem bench serve`
draws it from the same flags and seed (`--seeds`: one per rate, so that no rate's prompts hit
the prefix cache another rate filled; the cache is also reset between rates); the engine is
built from the same engine flags, and stepped in this process with no transport
(`tandem_services.bench.serve.run_offline`). Its engine flags default as `tandem serve`'s do
(SERVING_ENGINE_DEFAULTS: the 8,192-token budget), so the engine is the one a served run with
the same flags gets.

`--timeline` records every step's plan (decode requests, prefill tokens) and its time (device
time from CUDA events on a GPU; see `StepTimeline`), and prints the time by kind of step:
decode-only steps by batch size, mixed steps by prefill tokens, then the prompts' phase, the
decode-only tail and, on a GPU, the device's idle time between steps.
`--keep-prefix-cache` runs the rates one after another on one cache (with one `--seed`: each
rate sends the same prompts, as a client re-run against a warm server does).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterator
from typing import Any

from tandem.config import SERVING_ENGINE_DEFAULTS, add_engine_args
from tandem.engine.core import EngineCore
from tandem.engine_args import EngineArgs
from tandem.loader import load_hf_config, load_tokenizer, resolve_model_path
from tandem_services.bench.serve import (
    Workload,
    random_workload,
    run_offline,
    summarize,
)

_DECODE_BUCKETS = (16, 32, 64, 128, 256, 1 << 30)
_PREFILL_BUCKETS = (64, 256, 1024, 2048, 4096, 1 << 30)


def _bucket(n: int, bounds: tuple[int, ...]) -> str:
    lo = 1
    for hi in bounds:
        if n <= hi:
            return f"{lo}-{hi}" if hi < 1 << 30 else f"{lo}+"
        lo = hi + 1
    return f"{lo}+"


class StepTimeline:
    """Every step's plan and time, recorded by wrapping the engine's scheduler (the plans)
    and, on a GPU whose model runner lives in this process, its executor (the times).

    - On such a GPU a step's time is its device time: CUDA events recorded just before and
      just after its launch, so from when the device reached the step (the step before it
      done) to when it finished the step's last kernel. A step whose kernels the host
      enqueues slower than the device runs them counts the device's wait inside it; the
      waits between steps are what `phases()` calls idle.
    - Elsewhere (the CPU, a multiprocess executor) it is the gap between two plans: step k's
      is the gap between plan k and plan k+1 (sync), or between plans k+1 and k+2 (async,
      where plan k+1 is made while step k runs, after step k-1 ended); the last step or two
      are not timed. Where the host is late to launch a step (one outside the CUDA graphs),
      part of its time lands on the step before it.
    """

    def __init__(self, engine: EngineCore) -> None:
        self.lag = 1 if engine.async_scheduling else 0
        self.plans: list[tuple[int, int]] = []
        self.stamps: list[float] = []
        self.events: list[tuple[Any, Any]] = []
        schedule = engine.scheduler.schedule

        def recording_schedule(*args: Any, **kwargs: Any) -> Any:
            so = schedule(*args, **kwargs)
            counts = so.num_scheduled_tokens
            decodes = sum(1 for n in counts.values() if n == 1)
            if counts:
                self.plans.append((decodes, so.total_num_scheduled_tokens - decodes))
                self.stamps.append(time.perf_counter())
            return so

        engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
        self.device_timed = _runs_cuda_here(engine)
        if self.device_timed:
            import torch

            execute = engine.executor.execute_async

            def timed_execute(*args: Any, **kwargs: Any) -> Any:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                step = execute(*args, **kwargs)
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.events.append((start, end))
                return step

            engine.executor.execute_async = timed_execute  # type: ignore[method-assign]

    def reset(self) -> None:
        self.plans.clear()
        self.stamps.clear()
        self.events.clear()

    def summary(self) -> dict[str, Any]:
        """Time by kind of step (see the class docstring). Idle gaps (no request) are not
        steps."""
        kinds: dict[str, dict[str, float]] = {}
        for (decodes, prefill), seconds in self._timed():
            ms = seconds * 1e3
            if prefill:
                name = f"mixed prefill {_bucket(prefill, _PREFILL_BUCKETS)}"
            else:
                name = f"decode {_bucket(decodes, _DECODE_BUCKETS)}"
            kd = kinds.setdefault(name, {"steps": 0, "ms": 0.0, "decodes": 0, "prefill": 0})
            kd["steps"] += 1
            kd["ms"] += ms
            kd["decodes"] += decodes
            kd["prefill"] += prefill
        for kd in kinds.values():
            n = max(int(kd["steps"]), 1)
            kd["ms_per_step"] = kd["ms"] / n
            kd["decodes_per_step"] = kd["decodes"] / n
            kd["prefill_per_step"] = kd["prefill"] / n
        return dict(sorted(kinds.items()))

    def phases(self) -> dict[str, float]:
        """The timed steps split at the end of the last one with prefill rows: `prefill_s`
        (from the first step to there: all at once, the prompts' phase, decodes riding along)
        and `tail_s` / `tail_steps` (the decode-only steps after it, set by the requests
        prefilled last and their output lengths). Device-timed, also `idle_s`: the device's
        time between the end of one step and the start of the next (no request to run, or
        the host late to launch), from the first step's start to the last step's end."""
        timed = list(self._timed())
        last = max((k for k, ((_, prefill), _) in enumerate(timed) if prefill), default=-1)
        out = {
            "prefill_s": sum(t for _, t in timed[: last + 1]),
            "tail_s": sum(t for _, t in timed[last + 1 :]),
            "tail_steps": len(timed) - last - 1,
        }
        if self.device_timed and self.events:
            span_s = self.events[0][0].elapsed_time(self.events[-1][1]) / 1e3
            out["idle_s"] = max(0.0, span_s - sum(t for _, t in timed))
        return out

    def _timed(self) -> Iterator[tuple[tuple[int, int], float]]:
        """Each timed step's plan (decodes, prefill tokens) and its seconds (see the class
        docstring)."""
        if self.device_timed:
            assert len(self.events) == len(self.plans), "one launch per non-empty plan"
            if self.events:
                self.events[-1][1].synchronize()
            for plan, (start, end) in zip(self.plans, self.events, strict=True):
                yield plan, start.elapsed_time(end) / 1e3
            return
        for k in range(len(self.plans) - 1 - self.lag):
            yield self.plans[k], self.stamps[k + 1 + self.lag] - self.stamps[k + self.lag]


def _runs_cuda_here(engine: EngineCore) -> bool:
    """Whether the engine's steps run on a GPU from this process (its model runner is here),
    so CUDA events recorded here time them."""
    if engine.executor.device.type != "cuda":
        return False
    try:
        engine.executor.model_runner  # noqa: B018 (raises where the runner is elsewhere)
    except RuntimeError:
        return False
    return True


def build_parser() -> argparse.ArgumentParser:
    """Every engine flag at the served entry points' defaults, and the workload's flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p, defaults=SERVING_ENGINE_DEFAULTS)
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
    w.add_argument(
        "--keep-prefix-cache",
        action="store_true",
        help="do not reset the prefix cache between rates",
    )
    p.add_argument("--timeline", action="store_true", help="record and print each step's time")
    p.add_argument("--out", default="")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
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
    timeline = StepTimeline(engine) if ns.timeline else None
    runs = []
    for rate, seed in zip(rates, seeds, strict=True):
        workload = random_workload(
            ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio, vocab, seed
        )
        if not ns.keep_prefix_cache:
            engine.scheduler.reset_prefix_cache()
        if timeline is not None:
            timeline.reset()
        results, duration = run_offline(engine, workload, rate, 0, seed)
        summary = summarize(results, duration, None, None)
        steps = timeline.summary() if timeline is not None else None
        phases = timeline.phases() if timeline is not None else None
        runs.append(
            {
                "steps": steps,
                "phases": phases,
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
        for name, kd in (steps or {}).items():
            print(
                f"  {name:24s} {int(kd['steps']):5d} steps {kd['ms_per_step']:7.2f} ms/step "
                f"({kd['decodes_per_step']:6.1f} decodes, {kd['prefill_per_step']:7.1f} "
                f"prefill tokens per step; {kd['ms'] / 1e3:6.2f} s)",
                flush=True,
            )
        if phases is not None:
            idle = f"; device idle {phases['idle_s']:.2f} s" if "idle_s" in phases else ""
            print(
                f"  prompts' phase {phases['prefill_s']:.2f} s, then {phases['tail_steps']} "
                f"decode-only steps in {phases['tail_s']:.2f} s{idle}",
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
