"""Cascade prefill attention: a step's new tokens attend to themselves from the step's dense
K/V, and to their cached prefix through the paged cache; the two results are merged by their
log-sum-exp.

For request r with `q_len` new tokens (rows `query_start_loc[r]:query_start_loc[r+1]`) and a
context of `seq_len` tokens, `context_len = seq_len - q_len`:

    key positions  0 ................ context_len - 1 | context_len ........... seq_len - 1
                   cached prefix, read paged            | this step's K/V, dense (not the cache)
    part 2:        every new row sees all of it         |
    part 1:                                             | row j sees keys 0..j (causal)
    (a sliding window cuts both on the left, per row)

- Part 1, `dense_causal_attention`: varlen causal self-attention over `key`/`value` as
  `forward` receives them (`[num_tokens, Hkv, D]`, request r's rows at the same offsets as
  its queries). Three kernels: torch's built-in FlashAttention-2
  (`aten._flash_attention_forward`, CUDA, fp16/bf16), our Triton kernel (any device, the
  Triton interpreter included) and our Hopper one (`tandem_kernels.dense_attention_hopper`:
  TMA loads, scale inside the exponent; 16-bit K/V without a window; a candidate on sm_90
  only). It returns the output and the LSE.
- Part 2, `paged_context_attention`: one program per (block of query rows, KV head), GQA rows
  packed as in `paged_prefill_attention`, over keys `[0, context_len)` read through the block
  table, no causal mask; its epilogue merges its (out, lse) into part 1's output in place.
  Programs of requests with no cached prefix return at once: their rows keep part 1's result.
- `merge_attn_states`: the same merge as a kernel of its own (two (out, lse) pairs -> one).

LSE convention: natural log of the sum over visible keys of exp(scale * q.k), fp32, laid out
`[num_heads, num_tokens]` (FlashAttention's varlen layout); the kernels take its strides.

Capturable in CUDA graphs: no host syncs; grids depend on the token count, `num_reqs` and the
head counts; `max_query_len` (FlashAttention's grid) may be an upper bound.

FP8 caches (`float8_e4m3fn`, per-tensor `k_scale` / `v_scale`): part 1 reads the step's K/V
rounded exactly as `reshape_and_cache` stores them (`fp8_rounded_kv`: that kernel run into a
scratch of the step's rows), widened to the query's dtype as loaded, `k_scale` folded into the
softmax scale and `v_scale` into the output, as the all-paged kernel does over the cache; part 2
reads the cache the same way. The result equals the all-paged kernel's over the FP8 cache up
to fp32 summation order (and part 1's rows rounded to the query's dtype before the merge).
FlashAttention-2 is not a dense kernel for FP8 caches.

Sliding windows (`sliding_window` W, transformers' and the all-paged kernel's convention: the
row at position p sees keys p - W < k <= p): part 1 masks keys j - k >= W and skips tiles
wholly left of its q-block's window; part 2 reads only the prefix from the window start of its
q-block's first row (blocks left of it may be the null block: never read), masks per row, and
returns at once when no prefix key is in sight. FlashAttention-2 is not a dense kernel with a
window here (`layer_prefill_path` swaps in ours).

Not covered: decode-only batches (the split-K decode kernel).

Which path runs (`prefill_path`): on CUDA, the fastest of the all-paged kernel, the cascade
with FlashAttention-2, the cascade with our dense kernel and, on sm_90, the cascade with our
Hopper dense kernel (its config timed first), timed once per attention shape in the engine's
start-up profile forward; untimed, the cascade with `default_dense_impl`.
TANDEM_PREFILL_CASCADE=0|1 forces the all-paged kernel or the cascade;
TANDEM_PREFILL_DENSE=flash|triton|triton_hopper forces the dense kernel.
`planned_prefill_path` gives the same answer from host values alone (the shape key, the
device, the token count), so an engine decides it once per step, before any layer runs; only
the one start-up call that times the candidates needs the tensors.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from tandem_kernels.dense_attention_hopper import (
    HOPPER_CONFIGS,
    HopperConfig,
    default_hopper_config,
    dense_hopper_attention,
    hopper_config_name,
)
from tandem_kernels.paged_attention import (
    FP8_KV_DTYPE,
    MIN_TUNE_TOKENS,
    ShapeKey,
    attend_tile,
    check_common,
    check_kv_scales,
    find_request,
    input_precision,
    key_json,
    load_q_tile,
    may_tune,
    online_softmax_step,
    paged_prefill_attention,
    prefill_tuning_active,
    shape_key,
    store_out_tile,
    time_config,
    time_device,
    window_arg,
)
from tandem_kernels.reshape_and_cache import reshape_and_cache

logger = logging.getLogger(__name__)

_LOG2E = 1.4426950408889634
_NEG_INIT = tl.constexpr(-1.0e30)

# Dense-part kernels: "flash" (torch's FlashAttention-2), "triton" (ours), "triton_hopper"
# (ours for sm_90, `dense_attention_hopper`), "cudnn" (torch's cuDNN attention, for steps whose
# prefill requests all have one length; `_dense_cudnn`).
DENSE_IMPLS = ("flash", "triton", "triton_hopper", "cudnn")


# The "cudnn" dense part takes requests of one length that is a multiple of this.
CUDNN_LENGTH_MULTIPLE = 256


# How prefill rows are computed: the all-paged kernel, or the cascade with a dense part.
PREFILL_PATHS = ("paged", "flash", "triton", "triton_hopper", "cudnn")


def prefill_cascade_setting() -> bool | None:
    """TANDEM_PREFILL_CASCADE: "0" forces the all-paged kernel (A/B), "1" the cascade on any
    device (the CPU interpreter included); unset: None, the choice is `prefill_path`'s."""
    flag = os.environ.get("TANDEM_PREFILL_CASCADE", "")
    return None if flag not in ("0", "1") else flag == "1"


def flash_dense_supported(query: torch.Tensor, num_kv_heads: int | None = None) -> bool:
    """torch's FlashAttention-2 takes this query: CUDA sm80+, fp16/bf16, head size a multiple
    of 8 up to 256, torch built with it, and a tiny varlen GQA call of this shape ran once
    (probed eagerly, once per process and shape; assumed to run while a graph is captured)."""
    head_size = query.shape[-1]
    if not (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and head_size % 8 == 0
        and head_size <= 256
        and os.environ.get("TRITON_INTERPRET") != "1"
        and torch.backends.cuda.is_flash_attention_available()
        and torch.cuda.get_device_capability(query.device)[0] >= 8
    ):
        return False
    num_heads = query.shape[1]
    key = (query.device, query.dtype, num_heads, num_kv_heads or num_heads, head_size)
    if key not in _flash_probes:
        if torch.cuda.is_current_stream_capturing():  # no probe here: an eager call probes
            return True
        _flash_probes[key] = _flash_runs(*key)
    return _flash_probes[key]


# (device, dtype, heads, KV heads, head size) -> whether FlashAttention-2 ran it correctly.
_flash_probes: dict[tuple[torch.device, torch.dtype, int, int, int], bool] = {}


def _flash_runs(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_size: int
) -> bool:
    """One varlen causal call (two requests of 3 and 5 tokens) runs, and its LSE is in the
    layout and base this module uses: the first row of each request sees one key, so its
    LSE is scale * q.k and its output that key's value."""
    try:
        q = torch.randn(8, num_heads, head_size, device=device, dtype=dtype)
        kv = torch.randn(8, num_kv_heads, head_size, device=device, dtype=dtype)
        cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
        scale = head_size**-0.5
        out, lse = _dense_flash(q, kv, kv, cu, 5, scale)
        return _first_rows_right(q, kv, kv, out, lse, [0, 3], scale)
    except Exception:  # a build without this kernel, an unsupported shape
        return False


def _first_rows_right(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    firsts: list[int],
    scale: float,
) -> bool:
    """A dense probe's answer is in this module's layout and base: `out [T, H, D]`, `lse
    [H, T]`, and at each request's first row (`firsts`), which sees one key, the LSE is
    scale * q.k and the output that key's value."""
    group = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(group, dim=1)[firsts]  # [R, H, D]
    vv = v.float().repeat_interleave(group, dim=1)[firsts]
    want = (q.float()[firsts] * kk).sum(-1).t() * scale  # [H, R]
    return bool(
        out.shape == q.shape
        and lse.shape == (q.shape[1], q.shape[0])
        and torch.allclose(lse[:, firsts], want, atol=0.05, rtol=0.02)
        and torch.allclose(out[firsts].float(), vv, atol=0.05, rtol=0.02)
    )


def cudnn_dense_supported(query: torch.Tensor, key: torch.Tensor, window: int = 0) -> bool:
    """torch's cuDNN attention is a start-up candidate for this call: CUDA sm80+, a 16-bit
    query with K/V in its dtype (not FP8), no sliding window, cuDNN present, not the
    interpreter, and a tiny call of this shape, K/V as strided views of one qkv tensor as
    the engine's are, gave the right output and LSE (probed once per process and shape)."""
    if not (
        query.is_cuda
        and os.environ.get("TRITON_INTERPRET") != "1"
        and query.dtype in (torch.float16, torch.bfloat16)
        and key.dtype == query.dtype
        and not window
        and torch.backends.cudnn.is_available()
        and torch.cuda.get_device_capability(query.device)[0] >= 8
    ):
        return False
    probe = (query.device, query.dtype, query.shape[1], key.shape[1], query.shape[2])
    if probe not in _cudnn_probes:
        if torch.cuda.is_current_stream_capturing():
            return False
        _cudnn_probes[probe] = _cudnn_runs(*probe)
    return _cudnn_probes[probe]


# (device, dtype, heads, KV heads, head size) -> whether cuDNN attention ran it correctly.
_cudnn_probes: dict[tuple[torch.device, torch.dtype, int, int, int], bool] = {}


def _cudnn_runs(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_size: int
) -> bool:
    """Two requests of 4 tokens through `_dense_cudnn`, Q/K/V views of one qkv tensor: the
    first row of each request sees one key, so its LSE is scale * q.k and its output that
    key's value (the layout and base this module uses)."""
    try:
        width = num_heads + 2 * num_kv_heads
        qkv = torch.randn(8, width, head_size, device=device, dtype=dtype)
        q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
        v = qkv[:, num_heads + num_kv_heads :]
        scale = head_size**-0.5
        out, lse = _dense_cudnn(q, k, v, 2, 4, scale)
        return _first_rows_right(q, k, v, out, lse, [0, 4], scale)
    except Exception:  # a build without it, an unsupported shape or layout
        return False


def _dense_cudnn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    num_reqs: int,
    seq_len: int,
    scale: float,
    need_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of `num_reqs` requests of `seq_len` tokens each (rows r * seq_len ..
    of `query [T, H, D]`, `key`/`value [T, Hkv, D]`) through torch's cuDNN attention: the
    batch as `[R, H, L, D]` views (no copy in), the output copied back to `[T, H, D]` and
    the LSE (natural log, `[R, H, L]`) to `[H, T]` fp32; without `need_lse` cuDNN writes no
    LSE and an empty `[H, 0]` stands in. cuDNN builds a graph per shape and keeps it, so a
    step of a new length pays one build."""
    t = num_reqs * seq_len
    h, d = query.shape[1], query.shape[2]
    hkv = key.shape[1]
    q = query[:t].view(num_reqs, seq_len, h, d).transpose(1, 2)
    k = key[:t].view(num_reqs, seq_len, hkv, d).transpose(1, 2)
    v = value[:t].view(num_reqs, seq_len, hkv, d).transpose(1, 2)
    out, lse = _cudnn_sdpa(q, k, v, scale, need_lse)
    out = out.transpose(1, 2).reshape(t, h, d)
    if not need_lse:
        return out, torch.empty((h, 0), dtype=torch.float32, device=query.device)
    lse = lse.reshape(num_reqs, h, seq_len).permute(1, 0, 2).reshape(h, t).float()
    return out, lse


def _cudnn_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, need_lse: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's cuDNN attention, causal, with its LSE where `need_lse`: `(out [R, H, L, D],
    lse [R, H, L(, 1)])` for `q [R, H, L, D]`, `k`/`v [R, Hkv, L, D]` (GQA taken as is)."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, need_lse, 0.0, True, False, scale=scale
    )[:2]
    return out, lse


# Head sizes at which the Hopper dense kernel has been checked against a reference on an
# sm_90 device (the kernel takes any power of two from 16 to 256, its TMA tiles; the
# interpreter checks 32 and 64). `test_other_head_sizes_match_sdpa` (tests/gpu) passed at 64
# and 256 on an H100 (session 18) for every config that compiles there: at 256 the register-
# capped one does not (ptxas: 158 registers needed), which start-up timing leaves out.
HOPPER_HEAD_SIZES = frozenset({64, 128, 256})


def hopper_dense_supported(query: torch.Tensor, key: torch.Tensor, window: int = 0) -> bool:
    """Our Hopper dense kernel is a start-up candidate for this call: CUDA sm_90 (9.x), a
    16-bit query with K/V in its dtype (not FP8), no sliding window, a head size in
    `HOPPER_HEAD_SIZES`, not the interpreter."""
    return (
        query.is_cuda
        and os.environ.get("TRITON_INTERPRET") != "1"
        and query.dtype in (torch.float16, torch.bfloat16)
        and key.dtype == query.dtype
        and not window
        and query.shape[-1] in HOPPER_HEAD_SIZES
        and torch.cuda.get_device_capability(query.device)[0] == 9
    )


# (head size, query heads per KV head, dtype, long requests: max_query_len > 1,024) -> the
# Hopper dense config start-up timing found fastest.
_HopperKey = tuple[int, int, torch.dtype, bool]
_hopper_configs: dict[_HopperKey, HopperConfig] = {}


def _hopper_key(query: torch.Tensor, key: torch.Tensor, max_query_len: int) -> _HopperKey:
    return (query.shape[2], query.shape[1] // key.shape[1], query.dtype, max_query_len > 1024)


def hopper_config(query: torch.Tensor, key: torch.Tensor, max_query_len: int) -> HopperConfig:
    """The Hopper dense kernel's config for a call: the one start-up timing picked for its
    shape and request length class, else `default_hopper_config`."""
    timed = _hopper_configs.get(_hopper_key(query, key, max_query_len))
    return timed or default_hopper_config(max_query_len, query.shape[2])


def tune_hopper_config(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    max_query_len: int,
) -> dict[str, float]:
    """Time every `HOPPER_CONFIGS` entry on this dense call (two untimed calls compile it, three
    timed) and keep the fastest for the shape and length class (`hopper_config`). Returns
    each config's milliseconds (configs that fail to run on this device left out)."""
    timings: dict[HopperConfig, float] = {}
    for config in HOPPER_CONFIGS:
        run = functools.partial(
            dense_hopper_attention, query, key, value, cu_seqlens, scale, config=config
        )
        ms = time_config(run, iters=3)
        if ms is not None:
            timings[config] = ms
    if timings:
        best = min(timings, key=lambda c: timings[c])
        _hopper_configs[_hopper_key(query, key, max_query_len)] = best
    return {hopper_config_name(c): ms for c, ms in timings.items()}


def default_dense_impl() -> str:
    """The dense part's kernel by rule: ours. Measured on the H200 (torch 2.11,
    benchmarks/prefill_attention.py), torch's varlen FlashAttention-2 was slower than our
    kernel at every shape (8 x 1,024: 203 TFLOP/s against 304; 1 x 32,768: 345 against 476),
    so it is only a candidate of the start-up timing (`prefill_path`), as is the Hopper kernel.
    TANDEM_PREFILL_DENSE=triton|flash|triton_hopper overrides the rule (benchmarks, A/B)."""
    forced = os.environ.get("TANDEM_PREFILL_DENSE", "")
    if forced in DENSE_IMPLS:
        return forced
    return "triton"


@triton.jit
def store_lse(lse_ptr, lse2, head, tok, stride_lse_head, stride_lse_tok, mask):
    """Store log2 LSEs `lse2` as natural-log LSEs at `lse[head, tok]` (this module's layout)."""
    tl.store(
        lse_ptr + head * stride_lse_head + tok * stride_lse_tok,
        lse2 * 0.6931471805599453,
        mask=mask,
    )


# --- part 1: dense varlen causal ----------------------------------------------------------


@triton.jit
def _dense_tile(
    q,
    m_i,
    l_i,
    acc,
    k_base,
    v_base,
    start_n,
    offs_m,
    q_len,
    window,
    stride_k_tok,
    stride_v_tok,
    offs_d,
    d_mask,
    scale_log2,
    BLOCK_N: tl.constexpr,
    DIAGONAL: tl.constexpr,
    WINDOW: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """One online-softmax step over the request's dense keys start_n .. start_n + BLOCK_N.

    DIAGONAL: keys past the request's end are not loaded and key n is dropped for row m when
    n > m (causal). WINDOW: key n is dropped for row m when n <= m - window. K/V in FP8 are
    widened to the query's dtype as they are loaded (their scales are the caller's)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if DIAGONAL:
        n_valid = offs_n < q_len
        kv_mask = n_valid[:, None] & d_mask[None, :]
    else:
        kv_mask = d_mask[None, :]
    k = tl.load(k_base + offs_n[:, None] * stride_k_tok + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_v_tok + offs_d[None, :], mask=kv_mask, other=0.0)
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale_log2
    if DIAGONAL or WINDOW:
        if DIAGONAL:
            keep = (offs_n[None, :] <= offs_m[:, None]) & n_valid[None, :]
            if WINDOW:
                keep = keep & (offs_n[None, :] > offs_m[:, None] - window)
        else:
            keep = offs_n[None, :] > offs_m[:, None] - window
        qk = tl.where(keep, qk, float("-inf"))
    return online_softmax_step(m_i, l_i, acc, qk, v, INPUT_PRECISION)


# Arguments that change from step to step are not specialized on (Triton otherwise compiles a
# variant per value class: equal to 1, divisible by 16, a 16-byte-aligned pointer), so what the
# start-up forward compiled serves every step and nothing compiles while serving: the LSE's
# head stride is the step's token count, and a mixed step's context part starts its LSE at
# column `num_decodes`.
@triton.jit(
    do_not_specialize=["num_reqs", "window", "stride_lse_head"],
    do_not_specialize_on_alignment=["cu_seqlens_ptr"],
)
def _dense_causal_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    cu_seqlens_ptr,
    scale_log2,
    v_scale,
    num_reqs,
    window,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_o_tok,
    stride_o_head,
    stride_lse_head,
    stride_lse_tok,
    QPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    SCALE_V: tl.constexpr,
    SLIDING: tl.constexpr,
):
    # Heads vary fastest: the QPK programs sharing a KV head run together and share its tiles
    # in L2.
    head = tl.program_id(0)
    # Last query blocks (the most keys, causal) first: a shorter tail of the launch.
    pid = tl.num_programs(1) - 1 - tl.program_id(1)
    req = find_request(cu_seqlens_ptr, num_reqs, pid, BLOCK_M)
    start = tl.load(cu_seqlens_ptr + req)
    q_len = tl.load(cu_seqlens_ptr + req + 1) - start
    q_block = pid - (start // BLOCK_M + req)
    if q_block * BLOCK_M >= q_len:
        return
    kv_head = head // QPK
    q_first = q_block * BLOCK_M
    offs_m = q_first + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < q_len
    d_mask = offs_d < HEAD_SIZE
    tok = start.to(tl.int64) + offs_m
    q = tl.load(
        q_ptr + tok[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
        mask=m_valid[:, None] & d_mask[None, :],
        other=0.0,
    )
    k_base = k_ptr + start.to(tl.int64) * stride_k_tok + kv_head * stride_k_head
    v_base = v_ptr + start.to(tl.int64) * stride_v_tok + kv_head * stride_v_head

    m_i = tl.full([BLOCK_M], _NEG_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Tiles wholly below the block's first row: every row sees every key, no mask. Then the
    # diagonal tiles up to the block's last row: causal mask (and the request's end). With a
    # window, tiles left of the first row's window are skipped, and those from its start to
    # where every row's window has begun (`left_end`) are a band masked by the window:
    #
    #   lo_tile   left_end        full_end   q_end
    #     |  band   |   unmasked     | diagonal |
    full_end = q_first // BLOCK_N * BLOCK_N
    q_end = tl.minimum(q_first + BLOCK_M, q_len)
    left_end = full_end * 0
    if SLIDING:
        lo_tile = tl.maximum(q_first - window + 1, 0) // BLOCK_N * BLOCK_N
        left_end = tl.minimum(tl.cdiv(tl.maximum(q_end - window, 0), BLOCK_N) * BLOCK_N, full_end)
        left_end = tl.maximum(left_end, lo_tile)
        for start_n in range(lo_tile, left_end, BLOCK_N):
            m_i, l_i, acc = _dense_tile(
                q, m_i, l_i, acc, k_base, v_base, start_n, offs_m, q_len, window, stride_k_tok,
                stride_v_tok, offs_d, d_mask, scale_log2, BLOCK_N, False, True, INPUT_PRECISION,
            )  # fmt: skip
    for start_n in range(left_end, full_end, BLOCK_N):
        m_i, l_i, acc = _dense_tile(
            q, m_i, l_i, acc, k_base, v_base, start_n, offs_m, q_len, window, stride_k_tok,
            stride_v_tok, offs_d, d_mask, scale_log2, BLOCK_N, False, False, INPUT_PRECISION,
        )  # fmt: skip
    for start_n in range(full_end, q_end, BLOCK_N):
        m_i, l_i, acc = _dense_tile(
            q, m_i, l_i, acc, k_base, v_base, start_n, offs_m, q_len, window, stride_k_tok,
            stride_v_tok, offs_d, d_mask, scale_log2, BLOCK_N, True, SLIDING, INPUT_PRECISION,
        )  # fmt: skip

    # Every row sees at least its own key: l_i > 0 for the valid rows.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if SCALE_V:
        out = out * v_scale
    store_out_tile(
        out_ptr, out, tok[:, None], head, offs_d, stride_o_tok, stride_o_head,
        m_valid[:, None] & d_mask[None, :],
    )  # fmt: skip
    # Not `store_lse`: the LSE is scaled before its address is formed (as it always was here).
    lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453
    tl.store(lse_ptr + head * stride_lse_head + tok * stride_lse_tok, lse, mask=m_valid)


def _dense_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    block_m: int | None,
    block_n: int | None,
    num_warps: int | None,
    num_stages: int | None,
    v_scale: float,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, head_size = query.shape
    num_reqs = cu_seqlens.shape[0] - 1
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    lse = torch.empty((num_heads, num_tokens), dtype=torch.float32, device=query.device)
    if num_tokens == 0 or num_reqs == 0:
        return out, lse
    block_d = triton.next_power_of_2(head_size)
    if block_m is None:
        block_m = 128 if block_d <= 128 else 64
    if block_n is None:
        block_n = 64
    num_warps = 8 if num_warps is None else num_warps
    num_stages = 3 if num_stages is None else num_stages
    grid = (num_heads, num_tokens // block_m + num_reqs)
    _dense_causal_kernel[grid](
        query,
        key,
        value,
        out,
        lse,
        cu_seqlens,
        scale * _LOG2E,
        v_scale,
        num_reqs,
        window,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        lse.stride(1),
        QPK=num_heads // key.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        HEAD_SIZE=head_size,
        INPUT_PRECISION=input_precision(query.dtype),
        SCALE_V=v_scale != 1.0,
        SLIDING=window > 0,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out, lse


def _dense_flash(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_query_len: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's FlashAttention-2, varlen (`cum_seq_q` = `cum_seq_k`), causal. Its schema is
    the same in torch 2.11 and 2.13 for the arguments passed here (positional up to
    `return_debug_mask`, then `scale`)."""
    out, lse = torch.ops.aten._flash_attention_forward(
        query,
        key,
        value,
        cu_seqlens,
        cu_seqlens,
        max_query_len,
        max_query_len,
        0.0,
        True,
        False,
        scale=scale,
    )[:2]
    if lse.dim() == 3:  # a build returning the padded [batch, heads, max_q] layout
        lse = _unpad_lse(lse, cu_seqlens, query.shape[0])
    return out, lse


def _unpad_lse(lse: torch.Tensor, cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """`[batch, heads, max_q]` -> `[heads, num_tokens]`, on the device (no sync)."""
    tok = torch.arange(num_tokens, device=lse.device, dtype=torch.int32)
    req = torch.searchsorted(cu_seqlens[1:], tok, right=True).clamp_(max=lse.shape[0] - 1)
    row = (tok - cu_seqlens[req]).clamp_(min=0, max=lse.shape[2] - 1)
    return lse[req.long(), :, row.long()].t().contiguous()


def dense_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    impl: str | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    need_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen causal self-attention over dense K/V: request r's queries, keys and values are
    rows `cu_seqlens[r]:cu_seqlens[r+1]` of `query [T, H, D]`, `key`/`value [T, Hkv, D]`
    (last dim contiguous); row j of a request sees its keys 0..j, with `sliding_window` W
    (0/None: off) only keys j - W < k <= j. Returns `(out [T, H, D], lse [H, T] fp32)` (the
    "cudnn" part without `need_lse`, the caller merging nothing into it: an empty LSE); rows
    past `cu_seqlens[R]` are not written. `max_query_len` (a host int, an upper bound is fine)
    sizes FlashAttention's grid and picks the Hopper kernel's config class. `impl`: "flash",
    "triton" or "triton_hopper" (None: `default_dense_impl`); the block/warp/stage knobs tune
    the Triton kernels (the Hopper one: unset, its timed config or `default_hopper_config`;
    those given replace the default's). "triton_hopper" with FP8 K/V or a window runs
    "triton".

    K/V in FP8 (`fp8_rounded_kv`: as an FP8 cache holds them, `x ~= x_fp8 * scale`) with
    `k_scale` / `v_scale`: computed as the all-paged kernel computes over an FP8 cache (K/V
    widened to the query's dtype, `k_scale` folded into the softmax scale, `v_scale` into the
    output); the LSE is then of `scale * k_scale * q.k_fp8`, the logits over the
    dequantized keys. FlashAttention takes neither FP8 K/V nor a window ("triton" only)."""
    assert query.dim() == 3 and key.dim() == 3 and value.dim() == 3, (query.shape, key.shape)
    assert query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1
    assert key.shape[0] >= query.shape[0] and key.shape[1:] == value.shape[1:]
    assert query.shape[1] % key.shape[1] == 0 and key.shape[2] == query.shape[2]
    assert key.dtype == value.dtype and key.dtype in (query.dtype, FP8_KV_DTYPE), (
        query.dtype,
        key.dtype,
        value.dtype,
    )
    fp8 = key.dtype == FP8_KV_DTYPE != query.dtype
    assert fp8 or (k_scale == 1.0 and v_scale == 1.0), (key.dtype, k_scale, v_scale)
    assert k_scale > 0 and v_scale > 0, (k_scale, v_scale)
    assert cu_seqlens.dim() == 1 and cu_seqlens.dtype == torch.int32, cu_seqlens.dtype
    window = window_arg(sliding_window)
    impl = default_dense_impl() if impl is None else impl
    assert impl in DENSE_IMPLS, impl
    if impl == "cudnn":
        num_reqs = cu_seqlens.shape[0] - 1
        # One length for every request: the rows are exactly R x max_query_len (a host check,
        # so never inside a graph capture, whose replays may split the rows otherwise). And a
        # length of whole CUDNN_LENGTH_MULTIPLE tiles: cuDNN builds a graph per shape (kept),
        # so lengths are held to few (budget-sized chunks, benchmark prompts); a served
        # prompt of any other length runs ours without paying a build in its TTFT.
        equal = num_reqs > 0 and query.shape[0] == num_reqs * max_query_len
        equal = equal and max_query_len % CUDNN_LENGTH_MULTIPLE == 0
        capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
        if equal and not (fp8 or window or capturing):
            try:
                return _dense_cudnn(query, key, value, num_reqs, max_query_len, scale, need_lse)
            except RuntimeError as exc:  # a shape cuDNN refuses: ours below
                _warn_cudnn_fallback(exc)
        hopper = hopper_dense_supported(query, key, window)
        impl = "triton_hopper" if hopper and not fp8 else "triton"
    if impl == "triton_hopper" and not (fp8 or window):
        config = hopper_config(query, key, max_query_len)
        if (block_m, block_n, num_warps, num_stages) != (None,) * 4:
            # The knobs given, the default config's for the rest, no register cap.
            bm, bn, warps, stages, _ = default_hopper_config(max_query_len, query.shape[2])
            config = (
                bm if block_m is None else block_m,
                bn if block_n is None else block_n,
                warps if num_warps is None else num_warps,
                stages if num_stages is None else num_stages,
                0,
            )
        return dense_hopper_attention(query, key, value, cu_seqlens, scale, config=config)
    impl = "triton" if impl == "triton_hopper" else impl
    if impl == "flash":
        assert not fp8 and not window, "FlashAttention-2 takes no FP8 K/V and no window here"
        num_tokens = query.shape[0]
        return _dense_flash(
            query, key[:num_tokens], value[:num_tokens], cu_seqlens, max(max_query_len, 1), scale
        )
    if query.is_cuda and block_m is None and block_n is None and num_warps is None:
        # Measured on the H200 (bf16, d 128, GQA 4): 64 x 64 tiles, 4 warps lead up to 1k-token
        # requests (8 x 1,024: 304 TFLOP/s against 272 for 128 x 64 x 8), 128 x 128, 8 warps
        # past them (2 x 4,096: 416 against 397; 1 x 32,768: 476 against 449). Past head size
        # 128 (Gemma 3's 256) 64 x 64 in two stages: the long tiles in three asked 448 KB of
        # shared memory (H200: 227 KB), the short ones 229 KB.
        short = max_query_len <= 1024
        if query.shape[2] > 128:
            block_m, block_n, num_warps = 64, 64, 4
            num_stages = 2 if num_stages is None else num_stages
        else:
            block_m, block_n, num_warps = (64, 64, 4) if short else (128, 128, 8)
    return _dense_triton(
        query, key, value, cu_seqlens, scale * k_scale, block_m, block_n, num_warps,
        num_stages, v_scale, window,
    )  # fmt: skip


_cudnn_warned = False


def _warn_cudnn_fallback(exc: Exception) -> None:
    global _cudnn_warned
    if not _cudnn_warned:
        _cudnn_warned = True
        logger.warning("cuDNN attention refused a prefill shape (%s); ours runs it", exc)


def fp8_rounded_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache_dtype: torch.dtype,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's K/V as the cache stores them, for the dense part: unchanged for a cache in
    their own dtype; for an FP8 cache, `[T, Hkv, D]` FP8 views of one fresh buffer holding
    exactly what `reshape_and_cache` writes to the cache (the same kernel, into a scratch
    "cache" of one-token blocks at slots 0..T-1), so the cascade over an FP8 cache reads the
    values decode reads. One pass over the step's K/V; capturable (no host sync)."""
    if kv_cache_dtype != FP8_KV_DTYPE or key.dtype == FP8_KV_DTYPE:
        return key, value
    num_tokens, num_kv_heads, head_size = key.shape
    scratch = torch.empty(
        (num_tokens, 2, 1, num_kv_heads, head_size), dtype=FP8_KV_DTYPE, device=key.device
    )
    slots = torch.arange(num_tokens, dtype=torch.int64, device=key.device)
    reshape_and_cache(key, value, scratch, slots, k_scale, v_scale)
    return scratch[:, 0, 0], scratch[:, 1, 0]


# --- the merge ------------------------------------------------------------------------------


@triton.jit
def _merge(o_a, lse2_a, o_b, lse2_b):
    """Two normalised partial results over disjoint key sets (LSEs in log2) -> one, and its
    log2 LSE. A side with LSE -inf (no keys) weighs nothing; both empty gives zeros."""
    m = tl.maximum(lse2_a, lse2_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp2(lse2_a - m_safe)
    w_b = tl.exp2(lse2_b - m_safe)
    total = w_a + w_b
    total_safe = tl.where(total > 0.0, total, 1.0)
    out = (o_a * (w_a / total_safe)[:, None]) + (o_b * (w_b / total_safe)[:, None])
    lse2 = tl.where(total > 0.0, m_safe + tl.log2(total_safe), float("-inf"))
    return out, lse2


@triton.jit
def _merge_kernel(
    out_a_ptr,
    lse_a_ptr,
    out_b_ptr,
    lse_b_ptr,
    out_ptr,
    lse_ptr,
    num_heads,
    stride_a_tok,
    stride_a_head,
    stride_b_tok,
    stride_b_head,
    stride_o_tok,
    stride_o_head,
    stride_la_head,
    stride_la_tok,
    stride_lb_head,
    stride_lb_tok,
    stride_lo_head,
    stride_lo_tok,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_valid = offs_h < num_heads
    mask = h_valid[:, None] & (offs_d < HEAD_SIZE)[None, :]
    lse_a = tl.load(
        lse_a_ptr + offs_h * stride_la_head + tok * stride_la_tok, mask=h_valid, other=0.0
    )
    lse_b = tl.load(
        lse_b_ptr + offs_h * stride_lb_head + tok * stride_lb_tok, mask=h_valid, other=0.0
    )
    o_a = tl.load(
        out_a_ptr + tok * stride_a_tok + offs_h[:, None] * stride_a_head + offs_d[None, :],
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    o_b = tl.load(
        out_b_ptr + tok * stride_b_tok + offs_h[:, None] * stride_b_head + offs_d[None, :],
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    out, lse2 = _merge(o_a, lse_a * 1.4426950408889634, o_b, lse_b * 1.4426950408889634)
    store_out_tile(out_ptr, out, tok, offs_h[:, None], offs_d, stride_o_tok, stride_o_head, mask)
    store_lse(lse_ptr, lse2, offs_h, tok, stride_lo_head, stride_lo_tok, h_valid)


def merge_attn_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys A and B (disjoint) from attention over each: `out_* [T, H, D]`
    (normalised), `lse_* [H, T]` fp32 natural-log LSEs (-inf: no keys). Returns `(out, lse)`;
    `out` may alias `out_a` or `out_b`."""
    num_tokens, num_heads, head_size = out_a.shape
    assert out_b.shape == out_a.shape and lse_a.shape == lse_b.shape == (num_heads, num_tokens)
    assert out_a.stride(-1) == 1 and out_b.stride(-1) == 1
    if out is None:
        out = torch.empty_like(out_a)
    lse = torch.empty_like(lse_a)
    if num_tokens == 0:
        return out, lse
    _merge_kernel[(num_tokens,)](
        out_a,
        lse_a,
        out_b,
        lse_b,
        out,
        lse,
        num_heads,
        out_a.stride(0),
        out_a.stride(1),
        out_b.stride(0),
        out_b.stride(1),
        out.stride(0),
        out.stride(1),
        lse_a.stride(0),
        lse_a.stride(1),
        lse_b.stride(0),
        lse_b.stride(1),
        lse.stride(0),
        lse.stride(1),
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_size),
        HEAD_SIZE=head_size,
        num_warps=4,
    )
    return out, lse


def merge_attn_states_ref(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of `merge_attn_states` (fp32 math)."""
    lse = torch.logaddexp(lse_a, lse_b)  # [H, T]
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - lse_safe).t()[:, :, None]
    w_b = torch.exp(lse_b - lse_safe).t()[:, :, None]
    out = out_a.float() * w_a + out_b.float() * w_b
    return out.to(out_a.dtype), lse


# --- part 2: the cached prefix, paged, merged into part 1 ---------------------------------


@triton.jit(
    do_not_specialize=["num_reqs", "stride_bt", "window", "stride_lse_head"],
    do_not_specialize_on_alignment=[
        "query_start_loc_ptr",
        "seq_lens_ptr",
        "block_table_ptr",
        "lse_ptr",
    ],
)
def _paged_context_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    lse_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    scale_log2,
    v_scale,
    num_reqs,
    window,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_lse_head,
    stride_lse_tok,
    stride_c_block,
    stride_c_kv,
    stride_c_off,
    stride_c_head,
    stride_bt,
    QPK: tl.constexpr,
    QPK_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    SCALE_V: tl.constexpr,
    SLIDING: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = find_request(query_start_loc_ptr, num_reqs, pid, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + req)
    if q_block * BLOCK_Q >= q_len:
        return
    context_len = tl.load(seq_lens_ptr + req) - q_len
    # The keys read: [key_lo, context_len); with a window, from the first row's window start.
    key_lo = context_len * 0
    if SLIDING:
        key_lo = tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0)
    if context_len <= key_lo:  # no cached prefix in sight: part 1's rows are the answer
        return

    q, _q_idx, q_pos, head, tok, offs_d, row_valid, q_mask = load_q_tile(
        q_ptr, q_start, q_len, context_len, q_block, kv_head, stride_q_tok, stride_q_head, QPK,
        QPK_PAD, BLOCK_Q, BLOCK_M, BLOCK_D, HEAD_SIZE,
    )  # fmt: skip
    m_i = tl.full([BLOCK_M], _NEG_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    cache_head = cache_ptr + kv_head.to(tl.int64) * stride_c_head
    # Not causal (every prefix key precedes every row). Whole tiles unmasked, then the tail
    # masked at the prefix's end. With a window, tiles left of the first row's window start
    # (`key_lo`) are not visited (their blocks may be the null block), and the tiles from
    # there to where every row's window has begun (`left_end`) are a band masked per row:
    #
    #   key_lo   left_end          full_end   context_len
    #     |  band   |    unmasked     |  tail  |
    full_end = context_len // BLOCK_N * BLOCK_N
    left_end = key_lo
    if SLIDING:
        p_end = context_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)  # last row's pos + 1
        left_end = tl.minimum(
            tl.cdiv(tl.maximum(p_end - window, 0), BLOCK_N) * BLOCK_N, context_len
        )
        left_end = tl.maximum(left_end, key_lo // BLOCK_N * BLOCK_N)
        for start_n in range(key_lo // BLOCK_N * BLOCK_N, left_end, BLOCK_N):
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, start_n, key_lo, context_len, q_pos, window, bt_row,
                cache_head, scale_log2, stride_c_block, stride_c_kv, stride_c_off, BLOCK_N,
                BLOCK_D, BLOCK_SIZE, HEAD_SIZE, True, True, False, True, INPUT_PRECISION,
            )  # fmt: skip
    for start_n in range(left_end, full_end, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, start_n, key_lo, context_len, q_pos, window, bt_row, cache_head,
            scale_log2, stride_c_block, stride_c_kv, stride_c_off, BLOCK_N, BLOCK_D, BLOCK_SIZE,
            HEAD_SIZE, False, False, False, False, INPUT_PRECISION,
        )  # fmt: skip
    for start_n in range(tl.maximum(full_end, left_end), context_len, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, start_n, key_lo, context_len, q_pos, window, bt_row, cache_head,
            scale_log2, stride_c_block, stride_c_kv, stride_c_off, BLOCK_N, BLOCK_D, BLOCK_SIZE,
            HEAD_SIZE, True, SLIDING, False, False, INPUT_PRECISION,
        )  # fmt: skip

    # Merge with part 1's rows (in place). A row may have seen no prefix key (its window
    # starts later than the first row's): LSE -inf, part 1's row is kept.
    o_ptrs = out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head
    o_dense = tl.load(o_ptrs + offs_d[None, :], mask=q_mask, other=0.0).to(tl.float32)
    lse_ptrs = lse_ptr + head * stride_lse_head + tok * stride_lse_tok
    lse2_dense = tl.load(lse_ptrs, mask=row_valid, other=float("-inf")) * 1.4426950408889634
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    lse2_ctx = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
    o_ctx = acc / l_safe[:, None]
    if SCALE_V:  # part 1's rows carry v_scale already
        o_ctx = o_ctx * v_scale
    out, lse2 = _merge(o_ctx, lse2_ctx, o_dense, lse2_dense)
    store_out_tile(
        out_ptr, out, tok[:, None], head[:, None], offs_d, stride_o_tok, stride_o_head, q_mask
    )
    store_lse(lse_ptr, lse2, head, tok, stride_lse_head, stride_lse_tok, row_valid)


def paged_context_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    block_q: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of each request's new rows over its cached prefix (keys
    `[0, seq_len - q_len)`, paged, no causal mask), merged in place into `out [T, H, D]` /
    `lse [H, T]`, which hold the rows' attention over the other keys (part 1). Rows of
    requests with no prefix are left as they are. Returns `out`.

    `sliding_window` W (0/None: off): the row at position p sees prefix keys k > p - W only;
    blocks left of the window of a q-block's first row are never read, and rows that see no
    prefix key keep part 1's result. An FP8 cache (`k_scale` / `v_scale`) is widened as it
    is loaded, as in `paged_prefill_attention`; part 1 must then have run on
    `fp8_rounded_kv` with the same scales (its LSE is over the same logits)."""
    num_heads, num_kv_heads, head_size, block_size = check_common(
        query, kv_cache, seq_lens, block_table
    )
    check_kv_scales(kv_cache, k_scale, v_scale)
    window = window_arg(sliding_window)
    num_reqs = seq_lens.shape[0]
    assert query_start_loc.shape == (num_reqs + 1,) and query_start_loc.dtype == torch.int32
    assert out.shape == query.shape and out.stride(-1) == 1 and out.dtype == query.dtype
    num_tokens = query.shape[0]
    assert lse.shape == (num_heads, num_tokens) and lse.dtype == torch.float32, lse.shape
    if num_tokens == 0 or num_reqs == 0:
        return out
    qpk = num_heads // num_kv_heads
    qpk_pad = triton.next_power_of_2(qpk)
    block_d = triton.next_power_of_2(head_size)
    if block_q is None:
        # On the H200 (4 x 1,024 new over 3,072 cached, GQA 4, d 128) 256-row tiles in two
        # stages ran the cascade at 348 TFLOP/s against 298 with 128-row tiles in three.
        wide = query.is_cuda and block_d <= 128 and num_stages is None
        block_q = max((256 if wide else 128 if block_d <= 128 else 64) // qpk_pad, 1)
        num_stages = 2 if wide else num_stages
    block_m = max(block_q * qpk_pad, 16)
    block_q = block_m // qpk_pad
    block_n = 64 if block_n is None else block_n
    num_warps = 8 if num_warps is None else num_warps
    num_stages = 3 if num_stages is None else num_stages
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _paged_context_kernel[grid](
        query,
        kv_cache,
        out,
        lse,
        query_start_loc,
        seq_lens,
        block_table,
        scale * k_scale * _LOG2E,
        v_scale,
        num_reqs,
        window,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        lse.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        QPK=qpk,
        QPK_PAD=qpk_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        HEAD_SIZE=head_size,
        INPUT_PRECISION=input_precision(query.dtype),
        SCALE_V=v_scale != 1.0,
        SLIDING=window > 0,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


# --- choosing the path ---------------------------------------------------------------------

# Steps whose longest prefill request has more new rows than this are "long": their path is
# chosen apart from short steps' (the Hopper kernel's config class splits at the same length).
# On the H200 at 8 x 1,024 our Hopper kernel and cuDNN's were close, while at 2 x 4,096 and
# 1 x 32,768 cuDNN led by 14-18% (session 16): one path for every length lost the long ones.
LONG_QUERY_LEN = 1024
# The other class's stand-in batch, timed at start-up beside the call's own: (requests, rows).
_CLASS_SHAPES = {False: (8, 1024), True: (1, 8192)}

# (shape key, long) -> the path start-up timing picked for this attention shape and class.
_prefill_paths: dict[tuple[ShapeKey, bool], str] = {}
prefill_path_log: list[dict[str, object]] = []


def is_long_step(max_query_len: int) -> bool:
    """Whether a step of this longest prefill request takes the long class's path."""
    return max_query_len > LONG_QUERY_LEN


def prefill_path(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    has_context: bool = True,
) -> str:
    """How this call's prefill rows should run (one of PREFILL_PATHS). On CUDA, the fastest
    path measured once per shape key (head size, group, cache dtype, block size) and length
    class (`is_long_step`; the class the call is not of: its dense parts timed on a stand-in
    batch, `_time_dense_class`, unless the all-paged kernel won), inside
    `prefill_tuning()` on the first call with at least `MIN_TUNE_TOKENS` rows (the engine's
    start-up profile forward, fresh prompts of up to 1,024 tokens), on that call's own inputs
    (its FP8 scales and window included, and `has_context`: the cascades timed without their
    context part where the caller knows there is none): the all-paged kernel (its own config
    tuned first), the cascade with FlashAttention-2 where it runs (not over an FP8 cache, not
    with a window), the cascade with our dense kernel, and on sm_90 (16-bit cache, no window) the
    cascade with our Hopper dense kernel at the config `tune_hopper_config` timed fastest.
    Untimed (no CUDA, TANDEM_TUNE_KERNELS=0, before the profile forward): the rule, the
    cascade with `default_dense_impl`; on the CPU, the all-paged kernel
    (`planned_prefill_path`, which decides all but the timing from host values). A layer runs
    the path through `layer_prefill_path`."""
    shape = shape_key(query.shape[1], kv_cache)
    fp8 = kv_cache.dtype != query.dtype
    long = is_long_step(max_query_len)
    planned = planned_prefill_path(query.device, shape, query.shape[0], max_query_len)
    if planned is not None:
        return layer_prefill_path(planned, fp8, sliding_window)
    rule = default_dense_impl()
    args = (query, kv_cache, query_start_loc, seq_lens, block_table, scale)
    extra = {"k_scale": k_scale, "v_scale": v_scale, "sliding_window": sliding_window}
    runs = {"paged": functools.partial(paged_prefill_attention, *args, **extra)}
    cascade_extra = {**extra, "has_context": has_context}
    flash = not fp8 and not sliding_window and flash_dense_supported(query, kv_cache.shape[3])
    impls = ["flash", "triton"] if flash else ["triton"]
    hopper_ms: dict[str, float] = {}
    if not fp8 and hopper_dense_supported(query, key, window_arg(sliding_window)):
        # Its own config first, timed on this call's dense part alone.
        hopper_ms = tune_hopper_config(query, key, value, query_start_loc, scale, max_query_len)
        impls += ["triton_hopper"] if hopper_ms else []
    if not fp8 and cudnn_dense_supported(query, key, window_arg(sliding_window)):
        impls += ["cudnn"]
    for impl in impls:
        runs[impl] = functools.partial(
            cascade_prefill_attention,
            query, key, value, kv_cache, query_start_loc, seq_lens, block_table, scale,
            max_query_len=max_query_len, dense_impl=impl, **cascade_extra,
        )  # fmt: skip
    timed = _fastest_path(runs, key_json(shape), long, query.shape[0], hopper_ms)
    if timed is None:
        return layer_prefill_path(rule, fp8, sliding_window)
    best, timings = timed
    _prefill_paths[(shape, long)] = best
    # The other length class: the same path where the all-paged kernel won (or no dense part
    # has a choice), else its dense parts timed on a stand-in batch of that class.
    dense = [impl for impl in impls if impl in timings]
    other = best
    if best != "paged" and len(dense) > 1:
        other = _time_dense_class(query, key, scale, not long, dense) or best
    _prefill_paths.setdefault((shape, not long), other)
    return best


def _time_dense_class(
    query: torch.Tensor, key: torch.Tensor, scale: float, long: bool, impls: list[str]
) -> str | None:
    """The fastest of `impls` as the dense part of fresh prompts of the `long` class
    (`_CLASS_SHAPES`: random Q/K/V of the call's heads, head size and dtype, K/V as views of
    one qkv tensor as the engine's are; the Hopper kernel's config for that class tuned
    first), in device time; logged in `prefill_path_log`. None when none ran."""
    num_reqs, length = _CLASS_SHAPES[long]
    num_tokens = num_reqs * length
    heads, kv_heads, head_size = query.shape[1], key.shape[1], query.shape[2]
    qkv = torch.randn(
        num_tokens, heads + 2 * kv_heads, head_size, device=query.device, dtype=query.dtype
    )
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
    v = qkv[:, heads + kv_heads :]
    cu = torch.arange(0, num_tokens + 1, length, device=query.device, dtype=torch.int32)
    hopper_ms: dict[str, float] = {}
    if "triton_hopper" in impls:
        hopper_ms = tune_hopper_config(q, k, v, cu, scale, length)
    runs = {
        impl: functools.partial(
            dense_causal_attention, q, k, v, cu, scale, max_query_len=length, impl=impl
        )
        for impl in impls
    }
    timed = _fastest_path(runs, "stand-in", long, num_tokens, hopper_ms)
    return None if timed is None else timed[0]


def _fastest_path(
    runs: dict[str, Callable[[], object]],
    key: object,
    long: bool,
    num_tokens: int,
    hopper_ms: dict[str, float],
) -> tuple[str, dict[str, float]] | None:
    """Each candidate of `runs` timed in device time (candidates that fail to run left out),
    logged in `prefill_path_log` with the Hopper kernel's config times where it was tuned:
    `(fastest, times)`, None when none ran.

    Device time, not the host's: eager prefill steps queue many layers ahead of the device.
    Timed with the host's work in (session 16, H200, 8 x 1,024), the cuDNN candidate lost
    (0.257 ms against the Hopper kernel's 0.225) though its dense part alone beats it (432
    against 359 TFLOP/s); in device time it won (session 17: 0.156 against 0.192)."""
    timings: dict[str, float] = {}
    for name, run in runs.items():
        ms = time_device(run, iters=3)
        if ms is not None:
            timings[name] = ms
    if not timings:
        return None
    best = min(timings, key=timings.__getitem__)
    entry: dict[str, object] = {
        "key": key, "long": long, "num_tokens": num_tokens, "ms": timings, "best": best,
    }  # fmt: skip
    if hopper_ms:
        entry["hopper_dense_ms"] = hopper_ms
    prefill_path_log.append(entry)
    return best, timings


def layer_prefill_path(path: str, fp8_cache: bool, sliding_window: int | None) -> str:
    """The path a layer runs for its step's `path`: the same, but our dense kernel where the
    step's path is FlashAttention-2 or our Hopper kernel and the layer's cache is FP8 or it has
    a sliding window (neither takes them; ours ran faster than FlashAttention-2 as the dense
    part at every shape measured on the H200, see `default_dense_impl`)."""
    if path in ("flash", "triton_hopper", "cudnn") and (fp8_cache or sliding_window):
        return "triton"
    return path


def planned_prefill_path(
    device: torch.device, shape: ShapeKey, num_tokens: int, max_query_len: int
) -> str | None:
    """The path `prefill_path` gives a call of `num_tokens` query rows of attention shape
    `shape` on `device`, decided on the host from these values alone: the path timed for
    the shape and the step's length class (`is_long_step(max_query_len)`), else the
    all-paged kernel off CUDA, else the rule (`default_dense_impl`).
    None only when that call is the one to time (CUDA, inside `prefill_tuning()`, at least
    `MIN_TUNE_TOKENS` rows, the shape untimed, no graph being captured): `prefill_path`
    times the candidates on the call's own tensors."""
    picked = _prefill_paths.get((shape, is_long_step(max_query_len)))
    if picked is not None:
        return picked
    if device.type != "cuda":
        return "paged"
    if (
        not may_tune(device)
        or not prefill_tuning_active()
        or num_tokens < MIN_TUNE_TOKENS
        or torch.cuda.is_current_stream_capturing()
    ):
        return default_dense_impl()
    return None


# --- the whole cascade ----------------------------------------------------------------------


def cascade_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    dense_impl: str | None = None,
    dense_config: tuple[int | None, int | None, int | None, int | None] | None = None,
    context_config: tuple[int | None, int | None, int | None, int | None] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    has_context: bool = True,
) -> torch.Tensor:
    """Causal attention for a flattened batch, as `paged_prefill_attention` computes it, from
    the step's dense `key`/`value` (`[>= T, Hkv, D]`, the rows `forward` wrote to the cache)
    for the new tokens and from the cache for each request's prefix. Returns a new `[T, H, D]`
    tensor; rows past `query_start_loc[R]` are not written. `dense_config` (block_m, block_n,
    warps, stages) tunes the Triton dense kernel, `context_config` (block_q, block_n, warps,
    stages) the paged one. An FP8 cache (`k_scale` / `v_scale`): the dense K/V are rounded
    as the cache holds them (`fp8_rounded_kv`) and the dense kernel is ours. `sliding_window`:
    both parts keep each row's last that many positions only. `has_context` False (the caller
    knows from host values that no request has cached tokens before its new ones): the dense
    part alone, no context launch."""
    dense = (None,) * 4 if dense_config is None else dense_config
    ctx = (None,) * 4 if context_config is None else context_config
    fp8 = kv_cache.dtype != query.dtype
    if dense_impl is not None:
        dense_impl = layer_prefill_path(dense_impl, fp8, sliding_window)
    elif fp8 or sliding_window:
        dense_impl = "triton"
    key, value = fp8_rounded_kv(key, value, kv_cache.dtype, k_scale, v_scale)
    scales = {"k_scale": k_scale, "v_scale": v_scale, "sliding_window": sliding_window}
    out, lse = dense_causal_attention(
        query,
        key,
        value,
        query_start_loc,
        scale,
        max_query_len=max_query_len,
        impl=dense_impl,
        block_m=dense[0],
        block_n=dense[1],
        num_warps=dense[2],
        num_stages=dense[3],
        need_lse=has_context,
        **scales,
    )
    if not has_context:
        return out
    return paged_context_attention(
        query,
        kv_cache,
        query_start_loc,
        seq_lens,
        block_table,
        scale,
        out,
        lse,
        block_q=ctx[0],
        block_n=ctx[1],
        num_warps=ctx[2],
        num_stages=ctx[3],
        **scales,
    )


def causal_lse_ref(query: torch.Tensor, key: torch.Tensor, scale: float) -> torch.Tensor:
    """LSE `[H, n]` of one request's causal self-attention (fp32), for tests."""
    qpk = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(qpk, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    n = query.shape[0]
    mask = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
    return scores.masked_fill(~mask, -math.inf).logsumexp(-1)


def dense_causal_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of `dense_causal_attention` without FP8 or a window (fp32 math):
    `(out [T, H, D]` in the query's dtype, `lse [H, T]` fp32); rows past `cu_seqlens[R]`
    are zero in `out` and -inf in `lse`."""
    num_tokens, num_heads, _ = query.shape
    qpk = num_heads // key.shape[1]
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    lse = torch.full((num_heads, num_tokens), -math.inf, device=query.device)
    bounds = cu_seqlens.tolist()
    for lo, hi in itertools.pairwise(bounds):
        if hi == lo:
            continue
        k = key[lo:hi].float().repeat_interleave(qpk, dim=1)
        v = value[lo:hi].float().repeat_interleave(qpk, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[lo:hi].float(), k) * scale
        mask = torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~mask, -math.inf)
        lse[:, lo:hi] = scores.logsumexp(-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out, lse
