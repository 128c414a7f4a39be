"""Integer weights, 16-bit activations: W4A16 (and W8A16 with int8 values) for GPTQ, AWQ and
compressed-tensors checkpoints kept quantized in memory.

`y = x @ W^T`, x `[M, K]` in the model's dtype (bf16, fp16; fp32 for tests), output in x's
dtype, with

    W[n, k] = scale[n, g] * (q[n, k] - zero[n, g]),   g = k // group_size  (-1: one group)

The layout (the one every checkpoint format is converted to, `pack_int_weight`):

    qweight  uint8 [N, K * bits / 8]  bits 4: two values a byte along K, even k in the low
                                      nibble, odd k in the high one; bits 8: one a byte
    scale    [N, G]  fp32 or x's dtype, any strides (a layer keeps `[G, N]` contiguous and
                     passes its transpose, so that a tile's scales are one contiguous load)
    zero     [N, G]  the zero points as floats (integers 0..2^bits, exact in any 16-bit float)
    G = ceil(K / group_size)

Why: at decode batch sizes a linear layer is bound by reading its weight; 4-bit values are a
quarter of the bf16 bytes.

Three forms (`w4a16_gemm`), chosen by the config's BLOCK_M:

    BLOCK_M >= 16   tensor-core form: each weight tile unpacked in registers to the exact
                    integers `q - zero` in x's dtype (|q - zero| <= 256: exact in bf16),
                    one 16-bit dot per K chunk against x, the chunk's fp32 partial scaled by
                    its group's scale row and accumulated
    1 <= BLOCK_M < 16
                    GEMV form (M = 1..8): the weight chunk read with 16-byte loads, unpacked
                    to fp32 and reduced against each of the BLOCK_M rows on the CUDA cores
                    (x's even and odd columns split in registers to meet the two nibbles)
    BLOCK_M == 0    dense form (prefill sizes, `dense_config`): the whole weight dequantized
                    into a transient `[N, K]` tensor of x's dtype (one kernel, each weight
                    rounded once from fp32), then `torch.mm` (cuBLAS); the unpacking is paid
                    once for all M rows, where the tensor-core form pays it per row block

Invariant: a K chunk lies in one group, so its scale and zero are one value per output row:
`group_size % BLOCK_K == 0`, or one group (`group_size` -1 or K). For 4 bits K is even.

Split-K (both forms; tandem_kernels.split_k): the grid is `[N / BLOCK_N, M / BLOCK_M,
SPLIT_K]` and the last program of each output tile sums the slices in a fixed order; the lock
buffer (`w4a16_locks`, one per tile, made once per layer outside CUDA-graph capture) is all
zeros between calls. Split-K configs serve one block of rows (M <= BLOCK_M).

Which config serves which batch is measured per weight shape when the layer loads
(`tune_w4a16`, on CUDA: this module's candidates timed against each other at each batch
bucket, the dense form among them from PREFILL_BUCKET rows); untuned (the interpreter,
TANDEM_TUNE_KERNELS=0) `default_config`.

References: `w4a16_gemm_ref` (dequantize in fp32, then the product in fp32);
`w4a16_dense_ref`, the dense form's (the weight rounded to x's dtype first).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem_kernels.fp8_w8a16 import time_in_graph, weight_copies
from tandem_kernels.paged_attention import may_tune
from tandem_kernels.pdl import launch_options, pdl_launch, pdl_wait
from tandem_kernels.split_k import k_slice, split_k_buffers, store_tile

# Batch sizes (rows of x) measured at load; a call with M rows uses the smallest bucket >= M,
# past the largest the largest's config. The last stands for prefill chunks, where the
# dense form competes.
PREFILL_BUCKET = 1024
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, PREFILL_BUCKET)
BITS = (4, 8)


class Config(NamedTuple):
    """One launch: tile sizes, K slices (`split_k`), Triton's warps and stages. `block_m` < 16
    selects the GEMV form (`block_m` rows a program, a power of two)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        if self.block_m == 0:
            return f"dense{self.block_n}x{self.block_k}"
        return "x".join(map(str, self))


def _gemv(m: int) -> tuple[Config, ...]:
    """GEMV candidates for `m` rows: unsplit for wide N (gate_up), split-K for N = 4096-6144;
    128-value chunks (64 bytes a row at 4 bits, the widest chunk a 128 group allows), and
    256 where the group allows it."""
    return (
        Config(m, 64, 128, 1, 4, 1),
        Config(m, 32, 128, 4, 4, 1),
        Config(m, 64, 128, 4, 4, 1),
        Config(m, 128, 128, 2, 8, 1),
        Config(m, 32, 256, 4, 4, 1),
    )


_DOT_SMALL = (
    Config(16, 64, 128, 1, 4, 3),
    Config(16, 32, 128, 4, 4, 3),
    Config(16, 64, 64, 4, 4, 4),
)
_CANDIDATES: dict[int, tuple[Config, ...]] = {
    1: _gemv(1) + _DOT_SMALL[1:2],
    2: _gemv(2) + _DOT_SMALL[1:2],
    4: _gemv(4) + _DOT_SMALL[1:2],
    8: _gemv(8) + _DOT_SMALL,
    16: (*_DOT_SMALL, Config(16, 128, 128, 1, 8, 3)),
    32: (Config(32, 64, 128, 1, 4, 3), Config(32, 128, 64, 1, 4, 4), Config(32, 64, 64, 2, 4, 4)),
    64: (Config(64, 64, 128, 1, 4, 3), Config(64, 128, 64, 1, 8, 4), Config(64, 64, 64, 1, 4, 4)),
    128: (
        Config(64, 128, 64, 1, 8, 4),
        Config(128, 128, 64, 1, 8, 3),
        Config(128, 64, 128, 1, 4, 3),
    ),
    256: (
        Config(128, 128, 64, 1, 8, 3),
        Config(128, 256, 64, 1, 8, 3),
        Config(64, 128, 128, 1, 8, 3),
    ),
    # The dense form (added by `candidates`) against the default tensor-core config only:
    # wider tensor-core tiles never beat that default here and lost to the dense form by
    # 2.5-3.7x at 1,024 and 4,096 rows on every 8B shape (H100, session 36), so timing them
    # at load bought nothing.
    PREFILL_BUCKET: (),
}
# The narrowest output block of any split-K candidate: `w4a16_locks` holds a lock per tile.
_MIN_SPLIT_BLOCK_N = 16
# Weights under this many bytes are not measured (`default_config` serves them).
_MIN_TUNE_BYTES = 1 << 20

# (N, K, bits, group_size, x dtype) -> {bucket: config}.
_choices: dict[tuple[int, int, int, int, torch.dtype], dict[int, Config]] = {}
tuning_log: list[dict[str, object]] = []


@triton.jit
def _unpacked(w_ptrs, mask, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight chunk `[BLOCK_N, BLOCK_K]` as int32 values, its bytes at `w_ptrs`
    (`[BLOCK_N, BLOCK_K * BITS / 8]`): 4 bits, each byte's low nibble then its high one."""
    b = tl.load(w_ptrs, mask=mask, other=0).to(tl.int32)
    if BITS == 4:  # noqa: SIM108 (a constexpr branch)
        q = tl.reshape(tl.join(b & 0xF, b >> 4), (BLOCK_N, BLOCK_K))
    else:
        q = b
    return q


@triton.jit(do_not_specialize=["M"])
def _w4a16_dot_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    ws_ptr,
    locks_ptr,
    M,
    N,
    K,
    group_size,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    stride_om,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The tensor-core form: one [BLOCK_M, BLOCK_N] output tile over one K slice."""
    pdl_wait(USE_PDL)
    PER_BYTE: tl.constexpr = 8 // BITS
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_begin, k_end = k_slice(K, pid_k, BLOCK_K, SPLIT_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, BLOCK_K // PER_BYTE)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k_begin + offs_k)[None, :]
    w_row = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    w_ptrs = w_row + (k_begin // PER_BYTE + offs_b)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        g = k0 // group_size
        scale = tl.load(s_ptr + offs_n * stride_sn + g * stride_sg, mask=n_mask, other=0.0)
        zero = tl.load(z_ptr + offs_n * stride_zn + g * stride_zg, mask=n_mask, other=0.0)
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            q = _unpacked(w_ptrs, n_mask[:, None], BITS, BLOCK_N, BLOCK_K)
        else:
            k_mask = k0 + offs_k < K
            b_mask = k0 + offs_b * PER_BYTE < K
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            q = _unpacked(w_ptrs, n_mask[:, None] & b_mask[None, :], BITS, BLOCK_N, BLOCK_K)
        # `q - zero` is a small integer: exact in x's dtype; the group's scale after the dot.
        w = (q.to(tl.float32) - zero.to(tl.float32)[:, None]).to(x.dtype)
        part = tl.dot(x, tl.trans(w), input_precision=INPUT_PRECISION)
        acc += part * scale.to(tl.float32)[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // PER_BYTE
    tile = pid_m * tl.num_programs(0) + pid_n
    store_tile(
        acc, offs_m, offs_n, M, N, out_ptr, 0, out_ptr, stride_om, ws_ptr, locks_ptr, tile,
        pid_k, SPLIT_K, SCALED=False,
    )  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _w4a16_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    ws_ptr,
    locks_ptr,
    M,
    N,
    K,
    group_size,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    stride_om,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The few-row form: each program reads its BLOCK_N weight rows over one K slice once,
    in BLOCK_K-value chunks (contiguous bytes along K: 16-byte loads), unpacks them to fp32
    minus the group's zero, and reduces each of the BLOCK_M rows of x against them on the
    CUDA cores; each chunk's row sums are scaled by the group's scales as they come."""
    PER_BYTE: tl.constexpr = 8 // BITS
    HALF_K: tl.constexpr = BLOCK_K // 2
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_begin, k_end = k_slice(K, pid_k, BLOCK_K, SPLIT_K)
    rows = tl.arange(0, BLOCK_M)
    offs_m = pid_m * BLOCK_M + rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, BLOCK_K // PER_BYTE)
    n_mask = offs_n < N
    w_ptrs = (
        w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k_begin // PER_BYTE + offs_b)[None, :]
    )
    x_ptrs = x_ptr + (pid_m * BLOCK_M).to(tl.int64) * stride_xm + k_begin + offs_k
    row0 = pid_m * BLOCK_M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    pdl_wait(USE_PDL)
    for k0 in range(k_begin, k_end, BLOCK_K):
        g = k0 // group_size
        scale = tl.load(s_ptr + offs_n * stride_sn + g * stride_sg, mask=n_mask, other=0.0)
        zero = tl.load(z_ptr + offs_n * stride_zn + g * stride_zg, mask=n_mask, other=0.0)
        zero = zero.to(tl.float32)[:, None]
        k_mask = k0 + offs_k < K
        if EVEN_K:
            b = tl.load(w_ptrs, mask=n_mask[:, None], other=0).to(tl.int32)
        else:
            b_mask = k0 + offs_b * PER_BYTE < K
            b = tl.load(w_ptrs, mask=n_mask[:, None] & b_mask[None, :], other=0).to(tl.int32)
        if BITS == 4:
            lo = (b & 0xF).to(tl.float32) - zero
            hi = (b >> 4).to(tl.float32) - zero
        else:
            w = b.to(tl.float32) - zero
        for i in tl.static_range(BLOCK_M):
            # A row-constant mask (`offs_k * 0` folds away), so x's loads stay wide.
            row_ok = offs_k * 0 + (row0 + i) < M
            mask = row_ok if EVEN_K else row_ok & k_mask
            x = tl.load(x_ptrs + i * stride_xm, mask=mask, other=0.0).to(tl.float32)
            if BITS == 4:
                x_even, x_odd = tl.split(tl.reshape(x, (HALF_K, 2)))
                prod = lo * x_even[None, :] + hi * x_odd[None, :]
            else:
                prod = w * x[None, :]
            part = tl.sum(prod, axis=1) * scale.to(tl.float32)
            acc = tl.where(rows[:, None] == i, acc + part[None, :], acc)
        w_ptrs += BLOCK_K // PER_BYTE
        x_ptrs += BLOCK_K
    tile = pid_m * tl.num_programs(0) + pid_n
    store_tile(
        acc, offs_m, offs_n, M, N, out_ptr, 0, out_ptr, stride_om, ws_ptr, locks_ptr, tile,
        pid_k, SPLIT_K, SCALED=False,
    )  # fmt: skip


@triton.jit
def _dequantize_kernel(
    w_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    N,
    K,
    group_size,
    stride_wn,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    stride_on,
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The dense form's first half: one `[BLOCK_N, BLOCK_K]` tile of W (module docstring),
    computed in fp32 and stored in the output's dtype. The tile lies in one group."""
    PER_BYTE: tl.constexpr = 8 // BITS
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k0 = pid_k * BLOCK_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_b = k0 // PER_BYTE + tl.arange(0, BLOCK_K // PER_BYTE)
    n_mask = offs_n < N
    b_mask = offs_b * PER_BYTE < K
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_b[None, :]
    q = _unpacked(w_ptrs, n_mask[:, None] & b_mask[None, :], BITS, BLOCK_N, BLOCK_K)
    g = k0 // group_size
    scale = tl.load(s_ptr + offs_n * stride_sn + g * stride_sg, mask=n_mask, other=0.0)
    zero = tl.load(z_ptr + offs_n * stride_zn + g * stride_zg, mask=n_mask, other=0.0)
    w = (q.to(tl.float32) - zero.to(tl.float32)[:, None]) * scale.to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_n.to(tl.int64)[:, None] * stride_on + offs_k[None, :]
    mask = n_mask[:, None] & (offs_k < K)[None, :]
    tl.store(out_ptrs, w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_into(
    out: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int,
    config: Config,
) -> torch.Tensor:
    """W `[N, K]` (module docstring) written into `out` (contiguous, `[N, K]`, any float
    dtype), in tiles of `config.block_n` x `config.block_k`; returns `out`."""
    n, k = out.shape
    assert out.stride(1) == 1 and qweight.shape == (n, k * bits // 8), (out.shape, qweight.shape)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(k, config.block_k))
    _dequantize_kernel[grid](
        qweight, scale, zero, out, n, k, k if group_size == -1 else group_size,
        qweight.stride(0), scale.stride(0), scale.stride(1), zero.stride(0), zero.stride(1),
        out.stride(0),
        BITS=bits, BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps,
    )  # fmt: skip
    return out


def pack_int_weight(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer values `[N, K]` (0 .. 2^bits - 1, any integer dtype) in this module's layout:
    uint8 `[N, K * bits / 8]`, 4 bits two a byte along K (even k in the low nibble)."""
    assert bits in BITS and values.dim() == 2, (bits, values.shape)
    v = values.to(torch.uint8)
    if bits == 8:
        return v.contiguous()
    assert v.shape[1] % 2 == 0, f"4-bit values pack in pairs along K, K = {v.shape[1]}"
    return (v[:, 0::2] | (v[:, 1::2] << 4)).contiguous()


def unpack_int_weight(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The values `[N, K]` (int32) of a `pack_int_weight` tensor."""
    q = qweight.to(torch.int32)
    if bits == 8:
        return q
    return torch.stack((q & 0xF, q >> 4), dim=-1).reshape(q.shape[0], -1)


def dequantize_int_weight(
    qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """W `[N, K]` float32 (module docstring)."""
    q = unpack_int_weight(qweight, bits)
    k = q.shape[1]
    g = torch.arange(k, device=q.device) // (k if group_size == -1 else group_size)
    return (q.to(torch.float32) - zero.to(torch.float32)[:, g]) * scale.to(torch.float32)[:, g]


def w4a16_gemm_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """Pure-torch reference: the weight dequantized to float32, the product in float32, the
    result in x's dtype."""
    w = dequantize_int_weight(qweight, scale, zero, bits, group_size)
    return (x.to(torch.float32) @ w.t()).to(x.dtype)


def w4a16_dense_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """What the dense form computes, in torch: the weight dequantized in fp32 and rounded
    once to x's dtype (as a 16-bit checkpoint of it would be), the product in fp32."""
    w = dequantize_int_weight(qweight, scale, zero, bits, group_size).to(x.dtype)
    return (x.to(torch.float32) @ w.to(torch.float32).t()).to(x.dtype)


def w4a16_locks(n: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed lock buffer for split-K calls on an N-row weight: one lock per output tile of
    any candidate, for one block of rows. Make it outside CUDA-graph capture, once per weight
    and stream; the kernels leave it zeroed."""
    return torch.zeros(triton.cdiv(n, _MIN_SPLIT_BLOCK_N), dtype=torch.int32, device=device)


def fits(config: Config, k: int, group_size: int) -> bool:
    """Whether `config` serves a weight of `k` columns in groups of `group_size` (-1: one):
    each K chunk in one group, and a GEMV row at least a 16-byte load at 4 bits."""
    one_group = group_size in (-1, k)
    return (one_group or group_size % config.block_k == 0) and config.block_k >= 32


def _block_k(k: int, group_size: int) -> int:
    """Chunks of 128 values, or the largest power of two dividing the group below that."""
    block_k = 128
    while not fits(Config(1, 1, block_k, 1, 1, 1), k, group_size) and block_k > 32:
        block_k //= 2
    return block_k


def dense_config(k: int, group_size: int) -> Config:
    """The dense form (BLOCK_M 0): its dequantizing kernel's tiles for this K and group."""
    return Config(0, 64, _block_k(k, group_size), 1, 4, 1)


def default_config(m: int, k: int, group_size: int) -> Config:
    """The config without tuning: the GEMV form up to 8 rows (one program a power-of-two
    block of them), the tensor-core form above; chunks of 128 values, or the largest power
    of two dividing the group below that."""
    block_k = _block_k(k, group_size)
    if m <= 8:
        return Config(triton.next_power_of_2(m), 32, block_k, 1, 4, 1)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return Config(block_m, 64, block_k, 1, 4, 3)


def unsupported(bits: int, group_size: int) -> str | None:
    """Why these kernels cannot serve `bits`-bit weights in groups of `group_size` (-1: one
    group a row), or None: 4 or 8 bits, groups a multiple of 32 (the narrowest K chunk)."""
    if bits not in BITS:
        return f"{bits}-bit weights (the kernel takes 4 and 8)"
    if group_size != -1 and (group_size < 1 or group_size % 32):
        return f"group size {group_size} (the kernel takes multiples of 32, or -1)"
    return None


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int,
    config: Config | None = None,
    locks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x [M, K] @ W^T` in x's dtype (module docstring for the layout); `config` None:
    `choose`'s. Rows of x contiguous along K. One kernel launch (and a fp32 workspace from
    the caching allocator for split-K); reads no device values on the host, so it can be
    captured in a CUDA graph. `locks`: `w4a16_locks(N, ...)`, for a split-K config; without
    it a zeroed one is made per call (one more memset)."""
    assert bits in BITS, bits
    assert x.dim() == 2 and qweight.dim() == 2 and qweight.dtype == torch.uint8
    m, k = x.shape
    n = qweight.shape[0]
    assert qweight.shape[1] * 8 == k * bits, (x.shape, qweight.shape, bits)
    assert x.stride(1) == 1 and qweight.stride(1) == 1
    groups = 1 if group_size == -1 else triton.cdiv(k, group_size)
    assert scale.shape == (n, groups) and zero.shape == (n, groups), (scale.shape, zero.shape)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    c = config or choose(m, n, k, bits, group_size, x.dtype)
    assert fits(c, k, group_size), (c, k, group_size)
    if c.block_m == 0:
        weight = torch.empty((n, k), dtype=x.dtype, device=x.device)
        dequantize_into(weight, qweight, scale, zero, bits, group_size, c)
        return torch.mm(x, weight.t(), out=out)
    grid = (triton.cdiv(n, c.block_n), triton.cdiv(m, c.block_m), c.split_k)
    workspace, locks = split_k_buffers(out, c.split_k, grid[0] * grid[1], locks)
    use_pdl = pdl_launch(x.device)
    if c.block_m < 16:
        kernel, extra = _w4a16_gemv_kernel, {}
    else:
        # fp32 activations: exact products (tf32 would lose digits); ignored for 16-bit.
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        kernel, extra = _w4a16_dot_kernel, {"INPUT_PRECISION": precision}
    kernel[grid](
        x, qweight, scale, zero, out, workspace, locks,
        m, n, k, k if group_size == -1 else group_size,
        x.stride(0), qweight.stride(0), scale.stride(0), scale.stride(1), zero.stride(0),
        zero.stride(1), out.stride(0),
        BITS=bits,
        BLOCK_M=c.block_m,
        BLOCK_N=c.block_n,
        BLOCK_K=c.block_k,
        SPLIT_K=c.split_k,
        EVEN_K=k % (c.block_k * c.split_k) == 0,
        USE_PDL=use_pdl,
        num_warps=c.num_warps,
        num_stages=c.num_stages,
        **extra,
        **launch_options(use_pdl),
    )  # fmt: skip
    return out


def bucket(m: int) -> int:
    """The smallest tuned batch bucket holding `m` rows (the largest past it)."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


def candidates(b: int, k: int, group_size: int) -> tuple[Config, ...]:
    """The configs timed at batch bucket `b` that serve `k` columns in groups of
    `group_size`, with the default among them."""
    fitting = tuple(c for c in _CANDIDATES[b] if fits(c, k, group_size))
    default = default_config(b, k, group_size)
    fitting = fitting if default in fitting else (*fitting, default)
    return (*fitting, dense_config(k, group_size)) if b >= PREFILL_BUCKET else fitting


def choose(m: int, n: int, k: int, bits: int, group_size: int, dtype: torch.dtype) -> Config:
    """The config for an `[m, k] x [n, k]^T` product: the one `tune_w4a16` measured fastest
    at `m`'s bucket, else `default_config`."""
    tuned = _choices.get((n, k, bits, group_size, dtype))
    if tuned is not None:
        return tuned[bucket(m)]
    return default_config(m, k, group_size)


def _may_tune(qweight: torch.Tensor) -> bool:
    return (
        may_tune(qweight.device)
        and not torch.cuda.is_current_stream_capturing()
        and qweight.numel() >= _MIN_TUNE_BYTES
    )


def tune_w4a16(
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
) -> dict[int, Config]:
    """Measure, once per (N, K, bits, group_size, dtype), this module's candidates against
    each other at every bucket of `M_BUCKETS`, on random activations and copies of this
    weight that together overflow L2 (tandem_kernels.fp8_w8a16's `weight_copies`, timed in
    CUDA graphs by its `time_in_graph`), and remember the fastest for `choose`. The log entry
    (`tuning_log`) keeps every candidate's microseconds and the seconds the shape took. A
    no-op (the defaults serve) off CUDA, under the interpreter, during capture, with
    TANDEM_TUNE_KERNELS=0 or for a weight under 1 MiB."""
    n = qweight.shape[0]
    k = qweight.shape[1] * 8 // bits
    key = (n, k, bits, group_size, dtype)
    if key in _choices or not _may_tune(qweight):
        return _choices.get(key, {})
    started = time.perf_counter()
    gen = torch.Generator(device=qweight.device).manual_seed(0)
    copies = weight_copies(qweight)
    locks = w4a16_locks(n, qweight.device)
    choices: dict[int, Config] = {}
    record: dict[str, object] = {"n": n, "k": k, "bits": bits, "group_size": group_size}
    timings: dict[str, object] = {}
    for b in M_BUCKETS:
        x = torch.randn(b, k, device=qweight.device, generator=gen).to(dtype)
        timed = {
            c: time_in_graph(
                [
                    lambda x=x, w=w, c=c: w4a16_gemm(x, w, scale, zero, bits, group_size, c, locks)
                    for w in copies
                ]
            )
            for c in candidates(b, k, group_size)
        }
        ok = {c: t for c, t in timed.items() if t is not None}
        best = min(ok, key=ok.__getitem__) if ok else default_config(b, k, group_size)
        choices[b] = best
        timings[str(b)] = {"best": best.name, **{c.name: t for c, t in timed.items()}}
    del copies
    record["us"] = timings
    record["tune_s"] = time.perf_counter() - started  # compiles included
    _choices[key] = choices
    tuning_log.append(record)
    return choices
