"""What a verify step costs against a plain decode step: host time, and on CUDA device time.

A run without speculation records each prompt's greedy continuation; then plain decode and
the replay proposer (k drafts, every one right, `speculation_rule` always: each step after
the first decode verifies k) run the same prompts, sync steps (async scheduling off: as on
the GPU when a verify step waits for its tokens, all host work adds to the step).

- Per batch size: the median wall time of a decode-only step, plain and verify (one engine
  step and the LLM's output processing: the interval between consecutive steps of the
  generate loop), best of `--repeats` runs.
- `--profile`: the cProfile of both runs' loops (top functions by own and cumulative time).
  On the CPU with the default tiny random model (the model's own time small, so host work
  shows): the scheduler with drafts, the input batch, sampling (the rejection sampler), the
  proposer and output processing.
- On CUDA (`--device cuda`), also the device time of `--device-steps` steady steps of each
  kind (torch.profiler, one request set driven step by step after its prefill): ms per
  step by kernel kind (the kinds of benchmarks.step_breakdown), kernels per step and the
  top kernels, so a verify step's extra device time is located.

On CUDA every sampled token is pinned to the plain run's (`--force-record`, the default there:
bf16 verify and decode steps round apart, and unpinned the greedy tokens drift within a few
tokens on random weights, which failed this benchmark's token check on the H200).

    python -m benchmarks.spec_host_cost --batch-sizes 1,8 --k 4 --profile
    python -m benchmarks.spec_host_cost --device cuda --model random:llama-3.1-8b \\
        --batch-sizes 1,8 --k 4 --input-len 64 --output-len 64 --max-model-len 4096
    TANDEM_PREFILL_CASCADE=0 python -m benchmarks.spec_host_cost --device cuda ...  # A/B
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.forced_replay import ForceRecorded, forced_params
from tandem import LLM, SamplingParams

# The default model: what it computes per token is small next to the host's work.
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def write_tiny_llama(folder: Path) -> Path:
    """A seeded random tiny Llama saved with save_pretrained (no tokenizer: token-id prompts)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model.save_pretrained(folder)
    return folder


class StepKinds:
    """Notes the kind of each step the engine plans: "plain" (decode only, no drafts),
    "verify" (decode only, with drafts) or "other" (a prefill chunk in it)."""

    def __init__(self, llm: LLM) -> None:
        self.kinds: list[str] = []
        self._scheduler = llm.engine.scheduler
        self._schedule = self._scheduler.schedule

    def __enter__(self) -> StepKinds:
        def schedule(*args: Any, **kwargs: Any) -> Any:
            so = self._schedule(*args, **kwargs)
            spec = so.scheduled_spec_decode_tokens
            decode_only = so.total_num_scheduled_tokens == len(so.num_scheduled_tokens) + sum(
                len(d) for d in spec.values()
            )
            self.kinds.append(("verify" if spec else "plain") if decode_only else "other")
            return so

        self._scheduler.schedule = schedule  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self._scheduler.schedule


def timed_generate(
    llm: LLM,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    profile: bool,
) -> tuple[list[Any], dict[str, list[float]], pstats.Stats | None]:
    """Generate; returns (outputs, decode-only step seconds by kind, the loop's profile). A
    step's seconds: from its `get_output` call to the next one's (sync: one step each)."""
    starts: list[float] = []
    plans: list[int] = []
    get_output = llm.client.get_output
    with StepKinds(llm) as kinds:

        def get_output_timed() -> Any:
            starts.append(time.perf_counter())
            plans.append(len(kinds.kinds))
            return get_output()

        llm.client.get_output = get_output_timed  # type: ignore[method-assign]
        prof = cProfile.Profile() if profile else None
        try:
            if prof is not None:
                prof.enable()
            outs = llm.generate(prompts, params, use_tqdm=False)
            if prof is not None:
                prof.disable()
            starts.append(time.perf_counter())
        finally:
            del llm.client.get_output
    by_kind: dict[str, list[float]] = {}
    for i, (t0, t1) in enumerate(itertools.pairwise(starts)):
        # A call that planned exactly one step (sync scheduling): that step's kind.
        planned = kinds.kinds[plans[i] : plans[i + 1] if i + 1 < len(plans) else None]
        if len(planned) == 1:
            by_kind.setdefault(planned[0], []).append(t1 - t0)
    return outs, by_kind, pstats.Stats(prof) if prof is not None else None


def device_profile(
    llm: LLM,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    num_steps: int,
) -> dict[str, Any]:
    """Device time of `num_steps` steady steps (after the prefill and 3 decode steps) of
    `prompts`, by kernel kind; the steps' kinds as planned."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.step_breakdown import kind_of
    from tandem.request import EngineCoreRequest

    engine = llm.engine
    ids = [f"devprof{i}" for i in range(len(prompts))]
    each = params if isinstance(params, list) else [params] * len(prompts)
    for rid, q, sp in zip(ids, prompts, each, strict=True):
        engine.add_request(EngineCoreRequest(rid, q, sp, eos_token_id=None))
    with StepKinds(llm) as kinds:
        while "other" in kinds.kinds[-1:] or len(kinds.kinds) < 4:
            engine.step()
        first = len(kinds.kinds)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(num_steps):
                engine.step()
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        planned = kinds.kinds[first:]
    engine.abort_requests(ids)
    while engine.has_unfinished_requests():
        engine.step()
    by_kind: dict[str, float] = {}
    kernels: list[tuple[str, float, int]] = []
    num_kernels = 0
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", 0.0) or getattr(evt, "self_cuda_time_total", 0.0)
        if t <= 0 or evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        by_kind[kind_of(evt.key)] = by_kind.get(kind_of(evt.key), 0.0) + t / 1e3
        kernels.append((evt.key, t / 1e3, evt.count))
        num_kernels += evt.count
    kernels.sort(key=lambda k: -k[1])
    return {
        "steps": {k: planned.count(k) for k in sorted(set(planned))},
        "wall_ms_per_step_profiled": 1e3 * wall / num_steps,
        "device_ms_per_step": sum(by_kind.values()) / num_steps,
        "kernels_per_step": num_kernels / num_steps,
        "by_kind_ms_per_step": {k: v / num_steps for k, v in sorted(by_kind.items())},
        "top_kernels": [
            {"name": n[:120], "ms_per_step": t / num_steps, "calls_per_step": c / num_steps}
            for n, t, c in kernels[:12]
        ],
    }


def print_device(name: str, d: dict[str, Any]) -> None:
    print(
        f"  {name}: device {d['device_ms_per_step']:.3f} ms/step, "
        f"{d['kernels_per_step']:.0f} kernels/step, wall (profiled) "
        f"{d['wall_ms_per_step_profiled']:.3f} ms/step, steps {d['steps']}"
    )
    from benchmarks.step_breakdown import print_kernel_table

    print_kernel_table(d, indent="      ")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default=None, help="default: a tiny random Llama (CPU figures)")
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row (best median)")
    p.add_argument("--profile", action="store_true", help="cProfile both runs' loops")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--device-steps", type=int, default=8, help="CUDA: steps profiled")
    p.add_argument(
        "--engine-json",
        default="{}",
        help="more engine arguments, e.g. '{\"piecewise_cuda_graph_sizes\": [8, 16, 32, 64]}'",
    )
    p.add_argument(
        "--force-record",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pin every sampled token to the plain run's (benchmarks/forced_replay.py; default: "
        "on CUDA, where bf16 verify and decode steps round apart and the greedy tokens drift)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    ns = p.parse_args(argv)
    cuda = ns.device.startswith("cuda")
    force = cuda if ns.force_record is None else ns.force_record
    if not cuda:
        torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = ns.model or str(write_tiny_llama(Path(tmp) / "tiny"))
        for batch in [int(b) for b in ns.batch_sizes.split(",")]:
            rng = np.random.default_rng(batch)
            prompts = [rng.integers(3, 500, size=ns.input_len).tolist() for _ in range(batch)]
            params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
            engine: dict[str, Any] = dict(
                device=ns.device,
                dtype=ns.dtype or ("bfloat16" if cuda else "float32"),
                max_num_seqs=max(batch, 1),
                max_num_batched_tokens=max(256, batch * (ns.k + 1), batch * ns.input_len),
                max_model_len=ns.max_model_len,
                async_scheduling="off",
                skip_tokenizer_init=True,
            )
            if cuda:
                engine["gpu_memory_utilization"] = 0.4
            else:
                engine["num_gpu_blocks"] = max(64, batch * 32)
            engine.update(json.loads(ns.engine_json))
            if force:
                engine["logits_processors"] = [ForceRecorded]
            row: dict[str, Any] = {"batch": batch, "k": ns.k, "forced_record": force}
            with LLM(model=model, **engine) as llm:
                warm = llm.generate(prompts, params, use_tqdm=False)  # warm-up, the record
                run_params: SamplingParams | list[SamplingParams] = (
                    forced_params(params, [list(o.outputs[0].token_ids) for o in warm])
                    if force
                    else params
                )
                plain = []
                for i in range(ns.repeats):
                    ref, times, plain_stats = timed_generate(
                        llm, prompts, run_params, ns.profile and i == ns.repeats - 1
                    )
                    plain.append(statistics.median(times["plain"]))
                if cuda:
                    row["plain_device"] = device_profile(llm, prompts, run_params, ns.device_steps)
            record = Path(tmp) / f"replay_{batch}.json"
            record.write_text(
                json.dumps(
                    [
                        {"prompt_token_ids": q, "output_token_ids": list(o.outputs[0].token_ids)}
                        for q, o in zip(prompts, ref, strict=True)
                    ]
                )
            )
            spec = {
                "method": "replay",
                "num_speculative_tokens": ns.k,
                "replay_path": str(record),
                "replay_acceptance": 1.0,
                "speculation_rule": "always",
            }
            with LLM(model=model, speculative_config=spec, **engine) as llm:
                llm.generate(prompts, run_params, use_tqdm=False)
                verify = []
                for i in range(ns.repeats):
                    got, times, stats = timed_generate(
                        llm, prompts, run_params, ns.profile and i == ns.repeats - 1
                    )
                    assert [o.outputs[0].token_ids for o in got] == [
                        o.outputs[0].token_ids for o in ref
                    ], "speculation changed the greedy tokens"
                    verify.append(statistics.median(times["verify"]))
                if cuda:
                    row["verify_device"] = device_profile(llm, prompts, run_params, ns.device_steps)
            row["plain_step_ms"] = 1e3 * min(plain)
            row["verify_step_ms"] = 1e3 * min(verify)
            row["verify_over_plain"] = row["verify_step_ms"] / row["plain_step_ms"]
            rows.append(row)
            print(
                f"B={batch:4d} k={ns.k}  plain step {row['plain_step_ms']:.3f} ms  "
                f"verify step {row['verify_step_ms']:.3f} ms  "
                f"({row['verify_over_plain']:.2f}x)",
                flush=True,
            )
            for name in ("plain_device", "verify_device"):
                if name in row:
                    print_device(name, row[name])
            for name, prof in (("plain decode", plain_stats), ("speculative", stats)):
                if prof is not None:
                    print(f"---- B={batch} {name}: the generate loop's profile", flush=True)
                    prof.sort_stats("tottime").print_stats(ns.top)
                    prof.sort_stats("cumulative").print_stats(ns.top)
    if ns.out is not None:
        result = {"benchmark": "spec_host_cost", "device": ns.device, "model": model, "rows": rows}
        ns.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
