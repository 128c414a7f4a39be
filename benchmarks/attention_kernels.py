"""Issue 30's kernel table: every attention backend on the 8B's attention shape (32 query
heads, 8 KV heads, head 128, bf16, paged cache of 16-token blocks), one run.

Shapes (requests x tokens): causal prefill at 8 x 1,024, 4 x 4,096, 1 x 32,768 and
1 x 131,072 (no cached context), and decode at 64 x 32,768 (one query row per request over
32,768 cached tokens).

Backends, each over the same paged cache and block table (blocks dealt in a shuffled order):
- `triton`: tandem's kernels with their tuned config (prefill: the path the Triton backend
  takes, all-paged kernel or cascade, and the all-paged kernel's config, both timed on the
  first prefill shape of at least 1,024 rows inside `prefill_tuning()`, as an engine's
  start-up forward does; decode by `tune_decode_attention` on the decode shape itself);
- `flashinfer`: FlashInfer's batch prefill / decode wrappers (NHD pages, planned once, the
  plan outside the timing), where `flashinfer-python` imports; `flashinfer_tc`: its decode
  wrapper with `use_tensor_cores` (decode shapes only);
- `flash_attn`: FlashAttention's varlen kernel with a block table, where vLLM's build imports
  (Dao-AILab's FA2 needs 256-token pages: a line says so);
- `sdpa`: torch SDPA on dense K/V (gathered through the block table, outside the timing).
  On CUDA the math backend is excluded (it would materialize a 131k x 131k score matrix per
  head), so a memory-safe kernel (flash, cuDNN or efficient) runs or the row says why not.

Figures: median time (triton.testing.do_bench on CUDA), TFLOP/s of the causal FLOPs (QK^T and
PV over visible keys), each as a share of the held bf16 matmul ceiling
(`gpu_throughput.measure_ceilings`); for decode also GB/s of KV read (every K and V byte of the
contexts once) as a share of the held copy bandwidth. Each result is checked against the torch
reference (`paged_attention_ref`, fp32) on a slice: the first and last `--check-rows` query
rows of a prefill batch (the last ones attend to the whole context), two requests of decode.

    python -m benchmarks.attention_kernels --out attention_kernels.json       # H200, < 3 min

CPU dry run (Triton's interpreter, whose bf16 dot is wrong: float16; tiny shapes):

    TRITON_INTERPRET=1 python -m benchmarks.attention_kernels --device cpu --dtype float16 \
        --prefill 2x64,1x160 --decode 3x200 --check-rows 16 --out /tmp/attention_kernels.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.prefill_attention import (
    BLOCK_SIZE,
    NUM_HEADS,
    NUM_KV_HEADS,
    PagedBatch,
    causal_flops,
    make_paged_batch,
)
from tandem.config import ConfigError

PREFILL_SHAPES = "8x1024,4x4096,1x32768,1x131072"
DECODE_SHAPES = "64x32768"
BACKENDS = "triton,flashinfer,flashinfer_tc,flash_attn,sdpa"
# bf16 outputs against the fp32 reference (prefill_attention.py's tolerance).
ATOL = RTOL = 2e-2

Run = Callable[[], torch.Tensor]


def parse_shapes(spec: str) -> list[tuple[int, int]]:
    """'8x1024,1x32768' -> [(8, 1024), (1, 32768)] (requests x tokens)."""
    shapes = []
    for item in spec.split(","):
        if not item.strip():
            continue
        reqs, _, tokens = item.strip().partition("x")
        if not reqs.isdigit() or not tokens.isdigit() or int(reqs) < 1 or int(tokens) < 1:
            raise ValueError(f"a shape is REQUESTSxTOKENS (e.g. 8x1024), got {item!r}")
        shapes.append((int(reqs), int(tokens)))
    return shapes


def time_ms(fn: Run, dev: torch.device) -> float:
    """Median milliseconds per call: do_bench on CUDA (it flushes L2 between calls); on the
    CPU (a dry run) one call after a warm-up."""
    if dev.type == "cuda":
        import triton

        return float(triton.testing.do_bench(fn, return_mode="median"))
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


# ----------------------------------------------------------------------------- backends


class Unavailable(Exception):
    """A backend that cannot run here (its package, a layout it needs); the message says why."""


def flashinfer_module() -> Any:
    """The flashinfer module, or Unavailable naming the package (the backend's own check)."""
    from tandem.layers.attention.flashinfer_backend import FlashInferAttentionBackend

    try:
        FlashInferAttentionBackend()
    except ConfigError as exc:
        raise Unavailable(str(exc)) from None
    import flashinfer

    return flashinfer


def flash_attn_varlen(block_size: int) -> Callable[..., Any]:
    """vLLM's flash_attn_varlen_func, or Unavailable naming what is missing."""
    from tandem.layers.attention.flash_attn_backend import FA2_PAGE_MULTIPLE, import_flash_attn

    try:
        build, varlen = import_flash_attn()
    except ConfigError as exc:
        raise Unavailable(str(exc)) from None
    if build == "fa2" and block_size % FA2_PAGE_MULTIPLE:
        raise Unavailable(
            f"flash-attn (FA2) pages need a multiple of {FA2_PAGE_MULTIPLE} tokens, the table's "
            f"cache has {block_size}: install vllm-flash-attn"
        )
    return varlen


def _probe_flash_attn() -> None:
    flash_attn_varlen(BLOCK_SIZE)


def triton_runs(batch: PagedBatch, decode: bool) -> Run:
    """Decode: the split-K kernel. Prefill: the path the Triton backend takes
    (`prefill_path`: the all-paged kernel or the cascade, timed on the first call inside
    `prefill_tuning()`), from the new tokens' dense K/V and the paged cache."""
    from tandem_kernels.cascade_attention import cascade_prefill_attention, prefill_path
    from tandem_kernels.paged_attention import paged_decode_attention, paged_prefill_attention

    b = batch
    out = torch.empty_like(b.query)
    if decode:
        return lambda: paged_decode_attention(
            b.query, b.kv_cache, b.seq_lens, b.block_table, b.scale, max_seq_len=b.seq_len,
            out=out,
        )  # fmt: skip
    key, value = b.new_kv()
    args = (b.query, key, value, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_table)
    # As the engine's step plan knows it from its host lists: no cached prefix, no context
    # part in the cascade.
    has_context = b.ctx > 0

    def run() -> torch.Tensor:
        path = prefill_path(*args, b.scale, max_query_len=b.new, has_context=has_context)
        if path == "paged":
            return paged_prefill_attention(
                b.query, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_table, b.scale,
                out=out,
            )  # fmt: skip
        return cascade_prefill_attention(
            *args, b.scale, max_query_len=b.new, dense_impl=path, has_context=has_context
        )

    return run


def flashinfer_runs(batch: PagedBatch, decode: bool, tensor_cores: bool = False) -> Run:
    """FlashInfer's wrappers, planned outside the timing. Decode with `tensor_cores`: the
    decode wrapper's `use_tensor_cores` form (its prefill kernel over one query row a request,
    which FlashInfer recommends for large GQA groups; the table's group is 4)."""
    from tandem.layers.attention.flashinfer_backend import page_table

    fi = flashinfer_module()
    b = batch
    _, _, block_size, num_kv_heads, head_size = b.kv_cache.shape
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=b.query.device)
    indptr, indices, last = page_table(b.block_table, b.seq_lens.tolist(), block_size)
    common = dict(sm_scale=b.scale, q_data_type=b.query.dtype, kv_data_type=b.kv_cache.dtype)
    heads = (b.query.shape[1], num_kv_heads, head_size, block_size)
    if decode:
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace, kv_layout="NHD", use_tensor_cores=tensor_cores
        )
        wrapper.plan(indptr, indices, last, *heads, **common)
    else:
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
        qo_indptr = b.query_start_loc.cpu()
        wrapper.plan(qo_indptr, indptr, indices, last, *heads, causal=True, **common)
    return lambda: wrapper.run(b.query, b.kv_cache)


def flash_attn_runs(batch: PagedBatch, decode: bool) -> Run:
    b = batch
    varlen = flash_attn_varlen(b.kv_cache.shape[2])
    kwargs = dict(
        q=b.query,
        k=b.kv_cache[:, 0],
        v=b.kv_cache[:, 1],
        cu_seqlens_q=b.query_start_loc,
        max_seqlen_q=1 if decode else b.new,
        max_seqlen_k=b.seq_len,
        softmax_scale=b.scale,
        causal=True,
        block_table=b.block_table,
        seqused_k=b.seq_lens,
    )
    return lambda: varlen(**kwargs)


def sdpa_rows(out: torch.Tensor) -> torch.Tensor:
    """SDPA's `[R, H, new, D]` output as the flattened batch's `[R * new, H, D]` rows (a copy
    made for the check only: the timed call returns SDPA's own layout)."""
    return out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3])


def sdpa_runs(batch: PagedBatch, decode: bool) -> tuple[Run, str]:
    """SDPA on dense K/V (its output `[R, H, new, D]`, see `sdpa_rows`), and which path: `gqa`
    (enable_gqa) or `expanded` (K/V heads repeated, for kernels without GQA). On CUDA only
    memory-safe kernels may run (no math backend)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b = batch
    k, v = b.dense_kv()
    q = b.dense_query()
    causal = not decode  # decode: the one row sees every key
    safe = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    backends = safe if q.is_cuda else [*safe, SDPBackend.MATH]
    groups = q.shape[1] // k.shape[1]

    def call(kk: torch.Tensor, vv: torch.Tensor, gqa: bool) -> torch.Tensor:
        with sdpa_kernel(backends):
            return torch.nn.functional.scaled_dot_product_attention(
                q, kk, vv, scale=b.scale, is_causal=causal, enable_gqa=gqa
            )

    try:
        call(k, v, True)
        return (lambda: call(k, v, True)), "gqa"
    except RuntimeError as exc:  # no memory-safe kernel takes enable_gqa here
        print(f"  sdpa with enable_gqa: {str(exc)[:160]}; K/V heads repeated instead", flush=True)
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return (lambda: call(k, v, False)), "expanded"


# ----------------------------------------------------------------------------- table


def check_slices(batch: PagedBatch, decode: bool, rows: int) -> list[tuple[torch.Tensor, Any]]:
    """(output row indices, fp32 reference of those rows) for the checked slices: decode, the
    first two requests; prefill, the first `rows` rows of request 0 (a context of `rows`) and
    the last `rows` rows of the last request (the whole context, as a continuation chunk)."""
    from tandem_kernels.paged_attention import paged_attention_ref

    b = batch
    dev = b.query.device

    def ref(q_rows: torch.Tensor, req: int, seq_len: int) -> torch.Tensor:
        n = q_rows.shape[0]
        return paged_attention_ref(
            b.query[q_rows],
            b.kv_cache,
            torch.tensor([0, n], dtype=torch.int32, device=dev),
            torch.tensor([seq_len], dtype=torch.int32, device=dev),
            b.block_table[req : req + 1],
            b.scale,
        )

    if decode:
        return [(torch.tensor([r], device=dev), ref(torch.tensor([r], device=dev), r, b.seq_len))
                for r in range(min(2, b.num_reqs))]  # fmt: skip
    rows = min(rows, b.new)
    first = torch.arange(0, rows, device=dev)
    last_start = (b.num_reqs - 1) * b.new + b.new - rows
    last = torch.arange(last_start, last_start + rows, device=dev)
    return [(first, ref(first, 0, rows)), (last, ref(last, b.num_reqs - 1, b.seq_len))]


def run_shape(
    kind: str,
    num_reqs: int,
    tokens: int,
    backends: list[str],
    dev: torch.device,
    dtype: torch.dtype,
    ceilings: dict[str, Any] | None,
    check_rows: int,
    missing: dict[str, str],
) -> dict[str, Any]:
    from tandem_kernels.paged_attention import prefill_tuning

    decode = kind == "decode"
    new, ctx = (1, tokens - 1) if decode else (tokens, 0)
    batch = make_paged_batch(num_reqs, new, ctx, dev, dtype)
    flops = causal_flops(num_reqs, new, ctx)
    kv_bytes = num_reqs * batch.seq_len * NUM_KV_HEADS * batch.query.shape[2] * 2
    kv_bytes *= batch.kv_cache.element_size()
    row: dict[str, Any] = {
        "kind": kind,
        "num_reqs": num_reqs,
        "seq_len": batch.seq_len,
        "query_rows": num_reqs * new,
        "flops": flops,
        "kv_bytes": kv_bytes,
        "backends": {},
    }
    checks = check_slices(batch, decode, check_rows)
    label = f"{kind} {num_reqs} x {tokens}"
    for name in backends:
        res: dict[str, Any] = {}
        row["backends"][name] = res
        if name in missing:
            res["unavailable"] = missing[name]
            print(f"{label:<22} {name:<11} not run: {missing[name]}", flush=True)
            continue
        try:
            if name == "triton":
                if decode and dev.type == "cuda":
                    from tandem_kernels.paged_attention import tune_decode_attention

                    tune_decode_attention(
                        batch.kv_cache, NUM_HEADS, num_reqs=num_reqs, seq_len=batch.seq_len
                    )
                run = triton_runs(batch, decode)
                if not decode:
                    with prefill_tuning():  # tunes once per process, on >= 1,024 rows
                        run()
            elif name == "flashinfer":
                run = flashinfer_runs(batch, decode)
            elif name == "flashinfer_tc":
                if not decode:
                    res["unavailable"] = "decode only (its prefill is flashinfer's)"
                    continue
                run = flashinfer_runs(batch, decode, tensor_cores=True)
            elif name == "flash_attn":
                run = flash_attn_runs(batch, decode)
            elif name == "sdpa":
                run, res["sdpa_path"] = sdpa_runs(batch, decode)
            else:
                raise ValueError(f"unknown backend {name!r}")
            out = run()
            if name == "sdpa":
                out = sdpa_rows(out)
            err = 0.0
            ok = True
            for idx, ref in checks:
                got = out[idx].float()
                err = max(err, (got - ref.float()).abs().max().item())
                ok = ok and torch.allclose(got, ref.float(), atol=ATOL, rtol=RTOL)
            del out
            ms = time_ms(run, dev)
        except Unavailable as exc:
            missing[name] = str(exc)
            res["unavailable"] = str(exc)
            print(f"{label:<22} {name:<11} not run: {exc}", flush=True)
            continue
        except Exception as exc:  # an unsupported shape or dtype, out of memory: say so, go on
            res["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"{label:<22} {name:<11} failed: {res['error']}", flush=True)
            continue
        res.update(ms=ms, tflops=flops / ms / 1e9, max_abs_err=err, matches_reference=ok)
        line = f"{label:<22} {name:<11} {ms:9.3f} ms {res['tflops']:7.1f} TFLOP/s"
        if ceilings:
            res["share_of_matmul"] = res["tflops"] / ceilings["bf16_matmul_tflops"]
            line += f" ({100 * res['share_of_matmul']:4.1f}% of matmul)"
        if decode:
            res["kv_read_gbs"] = kv_bytes / ms / 1e6
            line += f" {res['kv_read_gbs']:7.0f} GB/s KV"
            if ceilings:
                res["share_of_copy"] = res["kv_read_gbs"] / ceilings["copy_bandwidth_gbs"]
                line += f" ({100 * res['share_of_copy']:4.1f}% of copy)"
        line += f"  max|err| {err:.4f} {'ok' if ok else 'MISMATCH'}"
        if "sdpa_path" in res:
            line += f" [{res['sdpa_path']}]"
        print(line, flush=True)
    del batch, checks
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--prefill", default=PREFILL_SHAPES, help="REQSxTOKENS list ('' for none)")
    ap.add_argument("--decode", default=DECODE_SHAPES, help="REQSxCONTEXT list ('' for none)")
    ap.add_argument("--backends", default=BACKENDS)
    ap.add_argument("--check-rows", type=int, default=64, help="prefill rows checked per slice")
    ap.add_argument("--sustain-s", type=float, default=1.0, help="the ceilings' held time")
    ap.add_argument("--out", default="")
    ns = ap.parse_args(argv)
    try:
        prefill, decode = parse_shapes(ns.prefill), parse_shapes(ns.decode)
    except ValueError as exc:
        ap.error(str(exc))
    backends = [b.strip() for b in ns.backends.split(",") if b.strip()]
    unknown = set(backends) - set(BACKENDS.split(","))
    if unknown:
        ap.error(f"unknown backends {sorted(unknown)}; known: {BACKENDS}")
    dev = torch.device(ns.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, ns.dtype)
    t0 = time.perf_counter()
    ceilings: dict[str, Any] | None = None
    if dev.type == "cuda":
        from benchmarks.gpu_throughput import measure_ceilings

        ceilings = measure_ceilings(ns.sustain_s)
        print(
            f"held ceilings: bf16 matmul {ceilings['bf16_matmul_tflops']:.0f} TFLOP/s, copy "
            f"{ceilings['copy_bandwidth_gbs']:.0f} GB/s (burst "
            f"{ceilings['burst']['bf16_matmul_tflops']:.0f}, "
            f"{ceilings['burst']['copy_bandwidth_gbs']:.0f})",
            flush=True,
        )
    else:
        print("no ceilings on the CPU (a dry run): times and errors only", flush=True)
    # Backends that cannot run here, found once (their package) or on the first shape.
    missing: dict[str, str] = {}
    for name, probe in (("flashinfer", flashinfer_module), ("flash_attn", _probe_flash_attn)):
        try:
            probe()
            if dev.type != "cuda":
                missing[name] = "CUDA only"
        except Unavailable as exc:
            missing[name] = str(exc)
    if "flashinfer" in missing:
        missing["flashinfer_tc"] = missing["flashinfer"]
    from tandem_kernels import cascade_attention, paged_attention

    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "benchmark": "attention_kernels",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": ns.dtype,
        "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_size": 128},
        "ceilings": ceilings,
        "unavailable": missing,
        "tuning": {
            "prefill_path": cascade_attention.prefill_path_log,
            "prefill": paged_attention.prefill_tuning_log,
            "decode": paged_attention.decode_tuning_log,
        },
        "shapes": rows,
    }
    for kind, shapes in (("prefill", prefill), ("decode", decode)):
        for r, n in shapes:
            rows.append(
                run_shape(kind, r, n, backends, dev, dtype, ceilings, ns.check_rows, missing)
            )
            result["wall_s"] = time.perf_counter() - t0
            if ns.out:  # after every shape: a run cut short keeps what it measured
                with open(ns.out, "w") as f:
                    json.dump(result, f, indent=1)
    for entry in cascade_attention.prefill_path_log:
        timed: dict[str, float] = entry["ms"]  # type: ignore[assignment]
        times = ", ".join(f"{name} {ms:.3f}" for name, ms in timed.items())
        long = "long" if entry.get("long") else "short"
        print(f"path timing ({long}, {entry['num_tokens']} rows, ms): {times}; {entry['best']}")
    mismatched = [
        f"{r['kind']} {r['num_reqs']}x{r['seq_len']} {name}"
        for r in rows
        for name, res in r["backends"].items()
        if res.get("matches_reference") is False
    ]
    print(f"wall {time.perf_counter() - t0:.0f} s; mismatches: {', '.join(mismatched) or 'none'}")
    if ns.out:
        print(f"wrote {ns.out}")
    return 1 if mismatched else 0


if __name__ == "__main__":
    raise SystemExit(main())
