"""Dense varlen causal attention for Hopper (sm_90): the cascade's dense part (part 1 of
`tandem_kernels.cascade_attention`), a second kernel beside `_dense_causal_kernel` with the same
interface and output/LSE convention, written for what sm_90 offers:

- K/V tiles come in through TMA (host tensor descriptors over the `[T, Hkv * D]` view of
  `key`/`value`, block `[BLOCK_N, D]` at column `kv_head * D`) where the views allow it
  (16-byte aligned base and row stride, heads contiguous), else through pointer loads;
- the softmax scale is applied inside the exponent as one multiply-add (`qk * s - m`), with the
  running max kept in log2 units: no separate pass scaling the score tile;
- the one or two diagonal tiles first, masked, then the key tiles wholly left of the row
  block's first row in a loop with no mask (pipelined over `NUM_STAGES`). In this order the
  mask's values are dead before the long loop: ptxas (Triton 3.6) gives 64 x 64 x 4 warps
  139 registers a thread against 161 with the diagonal last, 128 x 128 x 8 216 against 226.
  (Triton 3.6's `warp_specialize` does not specialize this loop for sm_90: no producer warps,
  no register split, the same PTX; so it is not used.)

One program per (query head, block of BLOCK_M rows of one request); heads vary fastest, so the
programs sharing a KV head run together and find its tiles in L2; the last row blocks (the most
keys) are launched first. A request's rows, keys and values are rows `cu_seqlens[r]:
cu_seqlens[r+1]` of `query [T, H, D]` and `key`/`value [>= T, Hkv, D]`:

    keys of request r   0 ............ full_end | full_end ...... q_end
    row block rows                              | q_first ... q_end - 1
                        2nd: unmasked, pipelined | 1st: diagonal, key n > row m masked

A diagonal tile may reach past the request's end: into the next request's rows, into the
batch's padding rows `cu_seqlens[R]:T` (`T = query.shape[0]`), or past T. Its keys there are
masked for the request's rows by the causal mask alone (rows past the end are never stored),
but their values enter the product with weight 0, and `0 * NaN` is NaN: so values past T
read 0 (TMA's bound is T; pointer loads mask the request's end), and **the padding rows'
K/V must be finite** (a padded batch's rows are computed by the model, never NaN; the
first dense kernel does not read them at all). Masking the diagonal tiles' values in
registers instead cost 24-35 registers a thread (ptxas, Triton 3.6: 64 x 64 x 4 warps 167 ->
202, which is three blocks an SM -> two).

LSE: natural log, fp32, `[H, T]`. Head sizes 16-256 (a power of two for TMA; others are padded
and loaded through pointers). K/V in the query's dtype (16-bit on the device; fp32 too under
the interpreter), no window: FP8 K/V and sliding windows take `_dense_causal_kernel`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tandem_kernels.paged_attention import find_request, input_precision, store_out_tile

_LOG2E = 1.4426950408889634
_NEG_INIT = tl.constexpr(-1.0e30)

# Configurations timed at start-up and by the probe: (BLOCK_M, BLOCK_N, warps, stages,
# register cap a thread, ptxas maxnreg; 0: none). 8 warps over 128 rows is two warpgroups
# of 64 rows each.
HopperConfig = tuple[int, int, int, int, int]
# Under Triton 3.6 for sm_90a (bf16, d 128, K/V through TMA; `python -m
# benchmarks.kernel_registers --dense`), registers a thread and blocks an SM: 128 x 128 x 8
# 216, one (two consumer warpgroups of 64 rows, as FlashAttention-3 runs d 128); 128 x 64 x 8
# 178, one; capped at 128, two (4 B spilled); 64 x 64 x 4 139, two (by shared memory, in two
# stages or three); 64 x 32 x 4 128, four. None spills uncapped.
HOPPER_CONFIGS: tuple[HopperConfig, ...] = (
    (128, 128, 8, 2, 0),
    (128, 64, 8, 2, 0),
    (128, 64, 8, 2, 128),
    (64, 64, 4, 2, 0),
    (64, 64, 4, 3, 0),
    (64, 32, 4, 2, 0),
)


def hopper_config_name(config: HopperConfig) -> str:
    """`BMxBNxWxS` (`rN` appended for a register cap), as the probe and the logs print it."""
    name = "x".join(str(v) for v in config[:4])
    return name + (f"r{config[4]}" if config[4] else "")


def default_hopper_config(max_query_len: int, head_size: int) -> HopperConfig:
    """The untimed config, by the first dense kernel's measurements (its 64 x 64 tiles, 4 warps
    in three stages led up to 1k-token requests, 128 x 128, 8 warps past them): the same
    shapes here, 128 x 128 in two stages (three take 230 KB of shared memory); 64 x 64 in two
    stages for head sizes past 128 (larger K/V tiles)."""
    if head_size > 128:
        return (64, 64, 4, 2, 0)
    return (64, 64, 4, 3, 0) if max_query_len <= 1024 else (128, 128, 8, 2, 0)


@triton.jit
def _load_kv_tile(src, tok0, start_n, q_len, kv_head, stride_tok, stride_head, offs_d,
                  BLOCK_N: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
                  TMA: tl.constexpr, MASK: tl.constexpr):  # fmt: skip
    """Keys `start_n ...` (BLOCK_N of them) of the request whose rows start at `tok0`, K or V
    of `kv_head`: through the tensor descriptor `src` with TMA (rows past the batch's T read
    0), else from the pointer `src` (head dims past HEAD_SIZE read 0; with MASK, keys past
    `q_len` read 0 and are not loaded)."""
    if TMA:
        tile = src.load([tok0 + start_n, kv_head * HEAD_SIZE])
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask = (offs_d < HEAD_SIZE)[None, :]
        if MASK:
            mask = mask & (offs_n < q_len)[:, None]
        rows = tok0.to(tl.int64) + offs_n
        tile = tl.load(
            src + rows[:, None] * stride_tok + kv_head * stride_head + offs_d[None, :],
            mask=mask,
            other=0.0,
        )
    return tile


@triton.jit
def _softmax_tile(q, k, v, m_i, l_i, acc, offs_m, offs_n, scale_log2,
                  MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr):  # fmt: skip
    """One key tile into the running max `m_i` (log2 units, scaled), sum `l_i` and the
    unnormalised output `acc`. MASK: key n is dropped for row m when n > m (for a row of the
    request, so are the keys past its end; rows past it are never stored)."""
    qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
    if MASK:
        qk = tl.where(offs_n[None, :] <= offs_m[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1) * scale_log2)
    p = tl.exp2(qk * scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
    return m_new, l_i, acc


# As in `_dense_causal_kernel`: the arguments that change from step to step are not
# specialized on, so the start-up forward's compile serves every step.
@triton.jit(
    do_not_specialize=["num_reqs", "stride_lse_head"],
    do_not_specialize_on_alignment=["cu_seqlens_ptr"],
)
def _dense_hopper_kernel(
    q_ptr,
    k_src,
    v_src,
    out_ptr,
    lse_ptr,
    cu_seqlens_ptr,
    scale_log2,
    num_reqs,
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
    TMA: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    head = tl.program_id(0)
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
    m_i = tl.full([BLOCK_M], _NEG_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full_end = q_first // BLOCK_N * BLOCK_N
    q_end = tl.minimum(q_first + BLOCK_M, q_len)
    # The diagonal first: each row sees its key full_end <= q_first there, so m_i is finite
    # after it.
    for start_n in range(full_end, q_end, BLOCK_N):
        k = _load_kv_tile(k_src, start, start_n, q_len, kv_head, stride_k_tok, stride_k_head,
                          offs_d, BLOCK_N, HEAD_SIZE, BLOCK_D, TMA, True)  # fmt: skip
        v = _load_kv_tile(v_src, start, start_n, q_len, kv_head, stride_v_tok, stride_v_head,
                          offs_d, BLOCK_N, HEAD_SIZE, BLOCK_D, TMA, True)  # fmt: skip
        offs_n = start_n + tl.arange(0, BLOCK_N)
        m_i, l_i, acc = _softmax_tile(q, k, v, m_i, l_i, acc, offs_m, offs_n, scale_log2,
                                      True, INPUT_PRECISION)  # fmt: skip

    for start_n in tl.range(0, full_end, BLOCK_N, num_stages=NUM_STAGES):
        k = _load_kv_tile(k_src, start, start_n, q_len, kv_head, stride_k_tok, stride_k_head,
                          offs_d, BLOCK_N, HEAD_SIZE, BLOCK_D, TMA, False)  # fmt: skip
        v = _load_kv_tile(v_src, start, start_n, q_len, kv_head, stride_v_tok, stride_v_head,
                          offs_d, BLOCK_N, HEAD_SIZE, BLOCK_D, TMA, False)  # fmt: skip
        offs_n = start_n + tl.arange(0, BLOCK_N)
        m_i, l_i, acc = _softmax_tile(q, k, v, m_i, l_i, acc, offs_m, offs_n, scale_log2,
                                      False, INPUT_PRECISION)  # fmt: skip
    # Every row sees at least its own key: l_i >= 1 for the valid rows.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    store_out_tile(
        out_ptr, out, tok[:, None], head, offs_d, stride_o_tok, stride_o_head,
        m_valid[:, None] & d_mask[None, :],
    )  # fmt: skip
    lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453
    tl.store(lse_ptr + head * stride_lse_head + tok * stride_lse_tok, lse, mask=m_valid)


def _kv_source(
    x: torch.Tensor, num_tokens: int, block_n: int, block_d: int, tma: bool
) -> torch.Tensor | TensorDescriptor:
    """K or V for the kernel: with TMA, a descriptor over the `[num_tokens, Hkv * D]` view of
    its first `num_tokens` rows (rows past them read 0), else the tensor."""
    if not tma:
        return x
    _, num_kv_heads, head_size = x.shape
    view = x.as_strided((num_tokens, num_kv_heads * head_size), (x.stride(0), 1))
    return TensorDescriptor.from_tensor(view, [block_n, block_d])


def tma_usable(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """K/V can be read through TMA descriptors here: a power-of-two head size of 16-256,
    heads contiguous (`stride(1) == D`), 16-byte aligned bases and token strides, and the
    device a CUDA sm_90+ one or the interpreter."""
    head_size = key.shape[2]
    if head_size & (head_size - 1) or not 16 <= head_size <= 256:
        return False
    for x in (key, value):
        size = x.element_size()
        if (
            x.stride(1) != head_size
            or x.data_ptr() % 16
            or (x.stride(0) * size) % 16
            or x.shape[0] == 0
        ):
            return False
    if not query.is_cuda:
        return True  # the interpreter (CPU tensors): descriptors are emulated
    return torch.cuda.get_device_capability(query.device)[0] >= 9


def dense_hopper_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    config: HopperConfig,
    tma: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen causal self-attention (`cascade_attention.dense_causal_attention`'s contract,
    without FP8 K/V or a window): `query [T, H, D]`, `key`/`value [>= T, Hkv, D]` in the
    query's dtype, `cu_seqlens [R + 1]` int32. Returns `(out [T, H, D], lse [H, T] fp32)`;
    rows past `cu_seqlens[R]` are not written; K/V rows `cu_seqlens[R]:T` must be finite
    (see the module docstring). `config`: (BLOCK_M, BLOCK_N, warps, stages,
    register cap or 0); `tma` None: TMA where `tma_usable`."""
    assert query.dim() == 3 and key.dim() == 3 and value.dim() == 3, (query.shape, key.shape)
    assert query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1
    assert key.shape[0] >= query.shape[0] and key.shape[1:] == value.shape[1:]
    assert query.shape[1] % key.shape[1] == 0 and key.shape[2] == query.shape[2]
    assert key.dtype == value.dtype == query.dtype, (query.dtype, key.dtype, value.dtype)
    assert cu_seqlens.dim() == 1 and cu_seqlens.dtype == torch.int32, cu_seqlens.dtype
    block_m, block_n, num_warps, num_stages, max_registers = config
    num_tokens, num_heads, head_size = query.shape
    num_reqs = cu_seqlens.shape[0] - 1
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    lse = torch.empty((num_heads, num_tokens), dtype=torch.float32, device=query.device)
    if num_tokens == 0 or num_reqs == 0:
        return out, lse
    block_d = triton.next_power_of_2(head_size)
    use_tma = tma_usable(query, key, value) if tma is None else tma
    assert not use_tma or block_d == head_size, head_size
    grid = (num_heads, num_tokens // block_m + num_reqs)
    _dense_hopper_kernel[grid](
        query,
        _kv_source(key, num_tokens, block_n, block_d, use_tma),
        _kv_source(value, num_tokens, block_n, block_d, use_tma),
        out,
        lse,
        cu_seqlens,
        scale * _LOG2E,
        num_reqs,
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
        TMA=use_tma,
        NUM_STAGES=num_stages,
        num_warps=num_warps,
        num_stages=num_stages,
        **({"maxnreg": max_registers} if max_registers else {}),
    )
    return out, lse
