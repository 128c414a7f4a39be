"""GPU figures for `offline_throughput.py --device cuda` (one run, one device).

1. the device's ceilings: bf16 and e4m3 (`torch._scaled_mm`) matmul TFLOP/s (8192^3) and
   device copy bandwidth;
2. tandem on a random-weight llama-3.1-8b shape at input/output 128/128, 512/256, 1000/1000;
3. transformers' batched `generate` on a subset of one workload, and the ratio;
4. the roofline bound of each workload from its FLOPs and bytes at the measured ceilings (held
   for a second; the burst rates and the fraction of the bound they give are reported too).
   With `--quantization fp8` the linear weights count one byte each and the matmul ceiling is
   the e4m3 one; with `--kv-cache-dtype fp8` the KV cache counts one byte per value;
5. batch-1 decode latency against the time to read the weights once.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import math
import time
from typing import Any

import torch

WORKLOADS = [(128, 128, 2048), (512, 256, 2048), (1000, 1000, 1024)]


def _w8a16_pick(pick: dict[str, Any]) -> str:
    """One row bucket of the W8A16 tuner's log: what runs and its time."""
    w8a16 = pick["use"] == "w8a16"
    us = pick["best_us"] if w8a16 else pick["baseline"]
    name = pick["best"] if w8a16 else "baseline"
    return f"{name} {us:.1f} us" if us is not None else f"{name} -"


def device_ms(fn: Any, iters: int) -> float:
    """Device milliseconds of `iters` back-to-back calls of `fn` (CUDA events; no warm-up)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _burst_and_held_ms(fn: Any, sustain_s: float) -> tuple[float, float]:
    """ms per call of `fn`: over ten calls after three warm-ups, and held (back to back for
    `sustain_s`, timed over the second half)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    burst_ms = device_ms(fn, 10) / 10
    iters = max(int(sustain_s / 2 / (burst_ms / 1e3)), 10)
    device_ms(fn, iters)  # the first half brings the device to its held clocks
    return burst_ms, device_ms(fn, iters) / iters


def measure_ceilings(sustain_s: float = 1.0) -> dict[str, Any]:
    """The device's bf16 matmul rate (8192^3 products) and copy bandwidth (2 GiB copies).

    Each twice: a burst (ten timed calls after three warm-ups, ~15 ms of matmuls) and held
    (calls back to back for `sustain_s`, timed over the second half). The H200 runs products
    faster in a burst than over a second (its clocks come down under a long matrix load), and
    a run of these workloads lasts tens of seconds: the held rates are its ceilings, the bound
    uses them; the burst rates are kept beside them.
    """
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm_burst, mm_held = _burst_and_held_ms(lambda: a @ b, sustain_s)
    from tandem_kernels import fp8 as fp8_ops

    (aq, a_s), (bq, b_s) = fp8_ops.quantize_per_tensor(a), fp8_ops.quantize_per_tensor(b)
    f8_burst, f8_held = _burst_and_held_ms(
        lambda: fp8_ops.fp8_scaled_mm(aq, bq, a_s, b_s), sustain_s
    )
    a = b = aq = bq = torch.empty(0)
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy_burst, copy_held = _burst_and_held_ms(lambda: y.copy_(x), sustain_s)
    moved = 2 * x.numel()  # bytes read plus bytes written
    x = y = torch.empty(0)
    torch.cuda.empty_cache()
    flops = 2 * n**3
    return {
        "bf16_matmul_tflops": flops / mm_held / 1e9,
        "fp8_matmul_tflops": flops / f8_held / 1e9,
        "copy_bandwidth_gbs": moved / copy_held / 1e6,
        "sustain_s": sustain_s,
        "burst": {
            "bf16_matmul_tflops": flops / mm_burst / 1e9,
            "fp8_matmul_tflops": flops / f8_burst / 1e9,
            "copy_bandwidth_gbs": moved / copy_burst / 1e6,
        },
    }


def model_numbers(
    hf: Any, dtype_bytes: int = 2, linear_bytes: int | None = None, kv_bytes: int | None = None
) -> dict[str, float]:
    """FLOP and byte counts of the model: the layers' linear weights at `linear_bytes` per
    value (1 in FP8), the LM head at `dtype_bytes` (it stays bf16; the embedding table is not
    read by a step beyond its tokens' rows, so it is not counted: until 2026-12-04 it was,
    which put the 8B's weight read at 9.1 GB instead of 8.0), the KV cache at `kv_bytes` (1
    with an FP8 cache).

    Mixtures of experts (Qwen3-MoE's `num_experts` / `moe_intermediate_size`, Mixtral's
    `num_local_experts`): `matmul_params` counts what one token runs through (its top-k
    experts and the router), `weight_bytes` what a large batch reads (every expert), and
    `active_weight_bytes` what one token reads (batch 1); dense models have both equal."""
    linear_bytes = dtype_bytes if linear_bytes is None else linear_bytes
    kv_bytes = dtype_bytes if kv_bytes is None else kv_bytes
    h, inter, layers = hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers
    heads, kvh = hf.num_attention_heads, hf.num_key_value_heads
    hd = getattr(hf, "head_dim", None) or h // heads
    attn = h * (heads * hd) + 2 * h * (kvh * hd) + (heads * hd) * h
    num_experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None)
    if num_experts:
        top_k = hf.num_experts_per_tok
        expert_inter = getattr(hf, "moe_intermediate_size", None) or inter
        router = h * num_experts
        per_layer_all = attn + router + num_experts * 3 * h * expert_inter
        per_layer_active = attn + router + top_k * 3 * h * expert_inter
    else:
        per_layer_all = per_layer_active = attn + 3 * h * inter
    matmul_params = layers * per_layer_active + hf.vocab_size * h  # + lm_head
    head_bytes = hf.vocab_size * h * dtype_bytes
    return {
        "matmul_params": float(matmul_params),
        "weight_bytes": float(layers * per_layer_all * linear_bytes + head_bytes),
        "active_weight_bytes": float(layers * per_layer_active * linear_bytes + head_bytes),
        "kv_bytes_per_token": float(layers * 2 * kvh * hd * kv_bytes),
        "attn_flops_per_token_ctx": float(layers * 4 * heads * hd),  # QK^T and PV per ctx pos
    }


def roofline_seconds(
    nums: dict[str, float],
    n_req: int,
    inp: int,
    out: int,
    batch: int,
    budget: int,
    peak_flops: float,
    bw: float,
) -> dict[str, float]:
    """Lower bound on time: prefill and decode phases, each max(compute, memory)."""
    # Prefill: every prompt token through the matmuls, causal attention over ~inp/2.
    f_pre = n_req * inp * (2 * nums["matmul_params"] + nums["attn_flops_per_token_ctx"] * inp / 2)
    pre_steps = math.ceil(n_req * inp / budget)
    b_pre = pre_steps * nums["weight_bytes"] + n_req * inp * nums["kv_bytes_per_token"]
    # Decode: out - 1 steps per wave of `batch` requests; each reads the weights once and
    # every running request's whole context.
    waves = math.ceil(n_req / batch)
    dec_steps = waves * (out - 1)
    ctx_sum = n_req * sum(inp + t for t in range(1, out))
    f_dec = (
        n_req * (out - 1) * 2 * nums["matmul_params"] + ctx_sum * nums["attn_flops_per_token_ctx"]
    )
    b_dec = dec_steps * nums["weight_bytes"] + ctx_sum * nums["kv_bytes_per_token"]
    t_pre = max(f_pre / peak_flops, b_pre / bw)
    t_dec = max(f_dec / peak_flops, b_dec / bw)
    return {"prefill_s": t_pre, "decode_s": t_dec, "total_s": t_pre + t_dec}


def cuda_main(ns: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.offline_workload import make_prompts, run_transformers
    from tandem import LLM, SamplingParams
    from tandem.config import engine_kwargs_from

    assert torch.cuda.is_available(), "--device cuda needs a CUDA device"
    model = ns.model if ns.model != "default" else "random:llama-3.1-8b"
    result: dict[str, Any] = {
        "benchmark": "offline_throughput",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": model,
        "dtype": ns.dtype,
    }
    ceilings = measure_ceilings()
    result["ceilings"] = ceilings
    print(f"ceilings: {ceilings}", flush=True)
    fp8_weights = getattr(ns, "quantization", "auto") in ("fp8", "ptpc_fp8")
    fp8_kv = getattr(ns, "kv_cache_dtype", "auto") in ("fp8", "fp8_e4m3")
    result["quantization"] = getattr(ns, "quantization", "auto")
    result["kv_cache_dtype"] = getattr(ns, "kv_cache_dtype", "auto")
    # FP8 linear layers: the e4m3 ceiling (a lower bound on time: the LM head and attention
    # run in bf16, slower).
    mm_key = "fp8_matmul_tflops" if fp8_weights else "bf16_matmul_tflops"
    peak, bw = ceilings[mm_key] * 1e12, ceilings["copy_bandwidth_gbs"] * 1e9
    burst = ceilings["burst"]
    peak_burst = burst[mm_key] * 1e12
    bw_burst = burst["copy_bandwidth_gbs"] * 1e9

    # Every engine flag of offline_throughput's parser (its GPU defaults: bfloat16, 1024
    # sequences, 8192 tokens a step).
    llm = LLM(model=model, **engine_kwargs_from(ns))
    result["async_scheduling"] = llm.engine.async_scheduling
    hf = llm.engine.config.model.hf_config
    nums = model_numbers(hf, linear_bytes=1 if fp8_weights else 2, kv_bytes=1 if fp8_kv else 2)
    result["model_numbers"] = nums
    # As vLLM logs it ("GPU KV cache size"): for a model with sliding-window layers, a
    # sliding group counts only its window's blocks.
    kv_capacity = llm.engine.kv_cache_size_tokens
    result["kv_capacity_tokens"] = kv_capacity
    print(
        f"KV capacity: {kv_capacity} tokens; weights read a step {nums['weight_bytes'] / 1e9:.1f}"
        f" GB ({nums['active_weight_bytes'] / 1e9:.1f} GB by one token)",
        flush=True,
    )
    vocab = hf.vocab_size

    # 5. batch-1 decode latency.
    params = SamplingParams(temperature=0.0, max_tokens=257, ignore_eos=True)
    prompt = make_prompts(1, 128, vocab, 1)[0]
    llm.generate([{"prompt_token_ids": prompt}], params.clone(max_tokens=8), use_tqdm=False)
    eng = llm.engine
    from tandem.request import EngineCoreRequest

    eng.add_request(EngineCoreRequest("b1", prompt, params, eos_token_id=None))
    # TPOT: from the first token's arrival to the last's, over the tokens in between.
    stamps: list[float] = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            stamps.extend([time.perf_counter()] * len(o.new_token_ids))
    tpot = (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)
    # Bytes moved per second as the copy counts them; the faster of the two copy figures, so
    # the held ceilings never make this ratio look better.
    weight_read = nums["active_weight_bytes"] / max(bw, bw_burst)
    result["batch1"] = {
        "tpot_ms": tpot * 1e3,
        "weight_read_ms": weight_read * 1e3,
        "ratio": tpot / weight_read,
    }
    print(
        f"batch-1 TPOT {tpot * 1e3:.2f} ms; weight read {weight_read * 1e3:.2f} ms "
        f"({tpot / weight_read:.2f}x)",
        flush=True,
    )

    runs = []
    base_config = eng.scheduler.scheduler_config
    wanted = {w.strip() for w in getattr(ns, "workloads", "").split(",") if w.strip()}
    for inp, out, n_req in WORKLOADS:
        if wanted and f"{inp}/{out}" not in wanted:
            continue
        n_req = min(n_req, ns.max_requests)
        prompts = make_prompts(n_req, inp, vocab, inp)
        p = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
        eng.scheduler.kv_cache_manager.reset_prefix_cache()
        # The roofline's batch is what the KV pool allows at full length. tandem runs at most
        # that many too (capped by --max-num-seqs): admitting more only preempts later.
        kv_spec = eng.kv_cache_spec
        batch = min(int(kv_spec.max_concurrency(eng.num_blocks, inp + out)), n_req)
        max_seqs = min(ns.max_num_seqs, max(batch, 1))
        eng.scheduler.scheduler_config = dataclasses.replace(base_config, max_num_seqs=max_seqs)
        preempted_before = eng.stats().num_preemptions
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": q} for q in prompts], p, use_tqdm=False)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        bound = roofline_seconds(nums, n_req, inp, out, batch, ns.max_num_batched_tokens, peak, bw)
        bound_burst = roofline_seconds(
            nums, n_req, inp, out, batch, ns.max_num_batched_tokens, peak_burst, bw_burst
        )
        r = {
            "input_len": inp,
            "output_len": out,
            "num_requests": n_req,
            "elapsed_s": elapsed,
            "output_tokens_per_s": n_out / elapsed,
            "total_tokens_per_s": (n_out + n_req * inp) / elapsed,
            "roofline_batch": batch,
            "max_num_seqs": max_seqs,
            "num_preemptions": eng.stats().num_preemptions - preempted_before,
            "roofline": bound,
            "fraction_of_roofline": bound["total_s"] / elapsed,
            "roofline_burst": bound_burst,
            "fraction_of_roofline_burst": bound_burst["total_s"] / elapsed,
        }
        runs.append(r)
        print(
            f"tandem {inp}/{out} x{n_req}: {r['output_tokens_per_s']:.0f} out tok/s, "
            f"{r['total_tokens_per_s']:.0f} total tok/s, "
            f"{100 * r['fraction_of_roofline']:.0f}% of roofline "
            f"({100 * r['fraction_of_roofline_burst']:.0f}% at the burst ceilings)",
            flush=True,
        )
    result["tandem"] = runs
    eng.scheduler.scheduler_config = base_config
    from tandem_kernels.cascade_attention import prefill_path_log
    from tandem_kernels.paged_attention import decode_tuning_log, prefill_tuning_log

    result["prefill_attention_tuning"] = prefill_tuning_log
    result["prefill_path_timing"] = prefill_path_log
    result["decode_attention_tuning"] = decode_tuning_log
    from tandem_kernels.fp8_w8a16 import tuning_log as w8a16_tuning_log

    # The W8A16 GEMV's picks per weight shape and row bucket (FP8 weights; empty otherwise).
    result["w8a16_tuning"] = w8a16_tuning_log
    for record in w8a16_tuning_log:
        picks = record["us"]
        assert isinstance(picks, dict)
        print(
            f"w8a16 {record['n']}x{record['k']}: "
            + ", ".join(f"M={m} {_w8a16_pick(p)}" for m, p in picks.items()),
            flush=True,
        )
    for path_entry in prefill_path_log:
        print(
            f"prefill paths at {path_entry['num_tokens']} tokens (ms): {path_entry['ms']}; "
            f"Hopper dense configs: {path_entry.get('hopper_dense_ms', '-')}; "
            f"using {path_entry['best']}",
            flush=True,
        )
    for entry in decode_tuning_log:
        rates = entry["kv_read_GBps"]
        assert isinstance(rates, dict)
        print(
            f"decode attention {entry['num_reqs']} x {entry['seq_len']} tokens: "
            + ", ".join(f"{name} {rate:.0f} GB/s" for name, rate in rates.items())
            + f"; using {entry['best']}",
            flush=True,
        )

    if not ns.skip_peer:
        model_path = llm.engine.model_path
        seed = llm.engine.config.model.seed
        del llm, eng
        gc.collect()
        torch.cuda.empty_cache()
        inp, out, n_req = 512, 256, ns.peer_requests
        prompts = make_prompts(n_req, inp, vocab, inp)
        peer = run_transformers(
            model_path, prompts, out, getattr(torch, ns.dtype), "cuda", seed=seed
        )
        same = next(r for r in runs if r["input_len"] == 512)
        peer["ratio_tandem_over_transformers"] = (
            same["output_tokens_per_s"] / peer["output_tokens_per_s"]
        )
        result["transformers"] = {
            "input_len": inp,
            "output_len": out,
            "num_requests": n_req,
            **peer,
        }
        print(
            f"transformers 512/256 x{n_req}: {peer['output_tokens_per_s']:.0f} out tok/s; "
            f"tandem/transformers {peer['ratio_tandem_over_transformers']:.1f}x",
            flush=True,
        )
    return result
