"""FP8 weights, 16-bit activations (W8A16) for the small batches of decode.

`y = x @ (W_fp8 * s)^T`, W `[N, K]` e4m3 with a per-tensor (`[]`) or per-output-channel
(`[N, 1]`) float32 scale, x `[M, K]` in the model's dtype. Each weight tile is widened in
registers (exact: every e4m3 value is a bf16) and fed to a 16-bit tensor-core dot; the scale is
applied once to the fp32 accumulator. Activations are not quantized at all.

Why: at decode batch sizes a linear layer is bound by reading its weight. FP8 halves the bytes,
but cuBLASLt's e4m3 GEMM (`torch._scaled_mm`) was slower than the bf16 GEMM it replaces at
M <= 64 on the H200 (qkv of the 8B at M = 1: 2.1 against 2.7 TFLOP/s), before the activation
quantization pass it also needs. Which path serves which batch size is measured per weight shape
when the weights load (`tune_w8a16`): this kernel's candidate configs against the scaled-GEMM
path the layer would otherwise run, at each bucket of `M_BUCKETS`. Larger batches keep the
scaled GEMM, whose FP8 tensor cores then pay.

Reference: `w8a16_gemm_ref` (dequantize, then matmul in fp32).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# Batch sizes (rows of x) measured at load; a call with M rows uses the smallest bucket >= M.
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Config: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). BLOCK_M >= 16: tensor-core tiles (the
# rows padded to 16); BLOCK_M < 16: the GEMV form (`_w8a16_gemv_kernel`), for the few rows
# where a padded dot wastes the loads' parallelism.
Config = tuple[int, int, int, int, int]
_DOT_16: tuple[Config, ...] = (
    (16, 16, 256, 4, 4),
    (16, 32, 256, 4, 4),
    (16, 32, 512, 4, 3),
    (16, 64, 256, 4, 4),
    (16, 16, 512, 4, 3),
    (16, 64, 128, 4, 4),
    (16, 32, 128, 2, 8),
    (16, 32, 1024, 8, 3),
)


def _gemv(m: int) -> tuple[Config, ...]:
    return ((m, 8, 512, 4, 1), (m, 16, 512, 4, 1), (m, 16, 1024, 8, 1), (m, 4, 1024, 4, 1))


_CANDIDATES: dict[int, tuple[Config, ...]] = {
    1: _gemv(1) + _DOT_16,
    2: _gemv(2) + _DOT_16,
    4: _gemv(4) + _DOT_16,
    8: _DOT_16,
    16: _DOT_16,
    32: ((32, 32, 256, 4, 4), (32, 64, 256, 4, 3), (32, 64, 128, 4, 4), (32, 128, 128, 8, 3)),
    64: ((64, 64, 128, 4, 4), (64, 64, 256, 4, 3), (64, 128, 128, 8, 3), (64, 32, 256, 4, 4)),
    128: ((64, 64, 128, 4, 4), (128, 128, 128, 8, 3), (64, 128, 128, 8, 3), (128, 64, 128, 4, 4)),
    256: ((128, 128, 128, 8, 3), (128, 64, 128, 4, 4), (64, 128, 128, 8, 3), (128, 256, 64, 8, 3)),
}
# Used without tuning (TANDEM_TUNE_KERNELS=0 on CUDA, the interpreter): this kernel up to
# M = 16, the scaled GEMM above.
_DEFAULT: Config = (16, 32, 256, 4, 4)
_DEFAULT_MAX_M = 16

# (N, K, x dtype, baseline name) -> {bucket: config, or None for the baseline}.
_choices: dict[tuple[int, int, torch.dtype, str], dict[int, Config | None]] = {}
tuning_log: list[dict[str, object]] = []


@triton.jit(do_not_specialize=["M"])
def _w8a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_s,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = k0 + offs_k < K
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    scale = tl.load(s_ptr + offs_n * stride_s, mask=n_mask, other=0.0)
    out = acc * scale[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["M"])
def _w8a16_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_s,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """The few-row form: each program reads BLOCK_N weight rows once, in BLOCK_K-wide chunks
    (many programs resident per SM keep the loads in flight), and reduces each of the BLOCK_M
    activation rows against them on the CUDA cores in fp32."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_row0 = x_ptr + (pid_m * BLOCK_M).to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + offs_k < K
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0).to(tl.float32)
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            w = w.to(tl.float32)
        for i in tl.static_range(BLOCK_M):
            row_ok = offs_k * 0 + (pid_m * BLOCK_M + i) < M
            x = tl.load(x_row0 + i * stride_xm + k0 + offs_k, mask=k_mask & row_ok, other=0.0)
            part = tl.sum(w * x.to(tl.float32)[None, :], axis=1)
            acc = tl.where(tl.arange(0, BLOCK_M)[:, None] == i, acc + part[None, :], acc)
        w_ptrs += BLOCK_K
    scale = tl.load(s_ptr + offs_n * stride_s, mask=n_mask, other=0.0)
    out = acc * scale[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(
        out_ptrs,
        out.to(out_ptr.dtype.element_ty),
        mask=(offs_m < M)[:, None] & n_mask[None, :],
    )


def w8a16_gemm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, config: Config | None = None
) -> torch.Tensor:
    """`x [M, K] @ (weight [N, K] e4m3 * scale)^T` in x's dtype; `scale` float32 `[]`, `[1]`
    or `[N, 1]`. Rows contiguous. Launches one kernel; reads no device values on the host, so
    it can be captured in a CUDA graph."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    m, k = x.shape
    n = weight.shape[0]
    assert scale.numel() in (1, n), (scale.shape, n)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k, warps, stages = config or _DEFAULT
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    args = (x, weight, scale, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0))
    if block_m < 16:
        kernel, extra = _w8a16_gemv_kernel, {}
    else:
        # fp32 activations: exact products (tf32 would lose digits); ignored for 16-bit.
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        kernel, extra = _w8a16_kernel, {"INPUT_PRECISION": precision}
    kernel[grid](
        *args,
        0 if scale.numel() == 1 else 1,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        num_warps=warps,
        num_stages=stages,
        **extra,
    )
    return out


def w8a16_gemm_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Pure-torch reference: the weight dequantized to float32, then the product."""
    w = weight.to(torch.float32) * scale.to(torch.float32).reshape(-1, 1)
    return F.linear(x.to(torch.float32), w).to(x.dtype)


def bucket(m: int) -> int | None:
    """The smallest tuned batch bucket holding `m` rows, or None above the largest."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return None


def choose(m: int, n: int, k: int, dtype: torch.dtype, baseline: str) -> Config | None:
    """This kernel's config for an `[m, k] x [n, k]^T` product, or None where the layer's
    scaled-GEMM path (`baseline`) is faster or the shape was never measured."""
    b = bucket(m)
    if b is None:
        return None
    choices = _choices.get((n, k, dtype, baseline))
    if choices is None:
        return _DEFAULT if m <= _DEFAULT_MAX_M else None
    return choices.get(b)


def _may_tune(weight: torch.Tensor) -> bool:
    return (
        weight.is_cuda
        and os.environ.get("TRITON_INTERPRET") != "1"
        and os.environ.get("TANDEM_TUNE_KERNELS", "1") != "0"
        and not torch.cuda.is_current_stream_capturing()
    )


def _time(runs: list[Callable[[], object]], reps: int = 8) -> float | None:
    """Microseconds per call, as decode runs it: the calls (`runs`, one per weight copy, so
    that together they overflow L2 and every weight comes from HBM, as each layer's does in a
    forward) captured `reps` times in one CUDA graph, the graph replayed and timed. None when
    this device cannot run it (shared memory, registers) or it cannot be captured."""
    try:
        for run in runs:  # compiles
            run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                for run in runs:
                    run()
        graph.replay()
        torch.cuda.synchronize()
    except Exception:
        torch.cuda.synchronize()
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / (3 * reps * len(runs))


# Weight copies timed in turn: at least this many bytes (twice an H200's 50 MB L2), at most
# _MAX_COPIES of them; weights under _MIN_TUNE_BYTES are not measured (the default rule serves
# them: a tiny model's GEMMs cost their launch, whatever the path).
_STREAM_BYTES = 128 << 20
_MAX_COPIES = 16
_MIN_TUNE_BYTES = 1 << 20


def tune_w8a16(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    baseline_name: str,
    baseline: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> dict[int, Config | None]:
    """Measure, once per (N, K, dtype, baseline), this kernel's candidates against `baseline`
    (the layer's own path, `baseline(x, weight)`: activation quantization + scaled GEMM) at
    every bucket of `M_BUCKETS`, on random activations and this weight, in CUDA graphs
    (`_time`); remember the winners for `choose`.
    A no-op off CUDA, under the interpreter, during capture, or with TANDEM_TUNE_KERNELS=0."""
    n, k = weight.shape
    key = (n, k, dtype, baseline_name)
    if key in _choices or not _may_tune(weight) or weight.numel() < _MIN_TUNE_BYTES:
        return _choices.get(key, {})
    gen = torch.Generator(device=weight.device).manual_seed(0)
    weight_bytes = weight.numel() * weight.element_size()
    num_copies = min(-(-_STREAM_BYTES // weight_bytes), _MAX_COPIES)
    copies = [weight] + [weight.clone() for _ in range(num_copies - 1)]
    choices: dict[int, Config | None] = {}
    record: dict[str, object] = {"n": n, "k": k, "baseline": baseline_name, "us": {}}
    for b in M_BUCKETS:
        x = torch.randn(b, k, device=weight.device, generator=gen).to(dtype)
        base_us = _time([lambda x=x, w=w: baseline(x, w) for w in copies])
        cands = _CANDIDATES[b]
        timed = {
            c: _time([lambda x=x, c=c, w=w: w8a16_gemm(x, w, scale, c) for w in copies])
            for c in cands
        }
        ok = {c: t for c, t in timed.items() if t is not None}
        best = min(ok, key=ok.__getitem__) if ok else None
        use = best if best is not None and (base_us is None or ok[best] < base_us) else None
        choices[b] = use
        record["us"][str(b)] = {  # type: ignore[index]
            "baseline": base_us,
            "best": "x".join(map(str, best)) if best else None,
            "best_us": ok.get(best) if best else None,
            "use": "w8a16" if use else "baseline",
        }
    del copies
    _choices[key] = choices
    tuning_log.append(record)
    return choices
