"""FP8 (e4m3) quantization and the scaled GEMM, beside their pure-torch references.

Scales follow one convention everywhere: `x ~= x_fp8.float() * scale` (a "dequantization"
scale; checkpoints' `weight_scale`, `input_scale`, and the block `weight_scale_inv` all mean
this). Granularities:

    per tensor       scale []                         one for the whole tensor
    per token        scale [M, 1]                     one per activation row (dynamic)
    per token group  scale [M, ceil(K/g)]             one per activation row and g columns
                                                      (dynamic)
    per channel      scale [N, 1]                     one per weight output row
    per block        scale [ceil(N/bn), ceil(K/bk)]   one per bn x bk tile of the weight

Activations are quantized on the fly by Triton kernels (`dynamic_quant_per_token`,
`dynamic_quant_per_token_group`, `dynamic_quant_per_tensor`; their torch references are
`quantize_per_row`, `quantize_per_token_group` and `quantize_per_tensor`; the first and last
also quantize weights at load). Per token group is the activations' side of block-scaled
weights (W8A8): with g = bk, each bk columns of K have one scale per activation row and one
per weight tile, so a dot over them is scaled by the two after it.

`fp8_scaled_mm(a, b, a_scale, b_scale)` is `(a * a_scale) @ (b * b_scale)^T` through
`torch._scaled_mm` (cuBLASLt on Hopper and Ada; also runs on the CPU). Its layout rules,
asserted at the entry: `a` `[M, K]` row-major, `b` `[N, K]` row-major (passed as `b.t()`, the
column-major second operand `_scaled_mm` wants), K and N multiples of 16; scales float32,
either both per-tensor, or rowwise (`a_scale` `[M, 1]`, `b_scale` `[N, 1]`) with a bf16 output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Floor on a scale, so an all-zero tensor quantizes to zeros instead of NaNs.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# A dynamic scale is amax * (1 / 448), multiplied, not divided: torch on CUDA turns a division
# by a Python number into this product, so the Triton kernels and the torch references (weights
# quantized at load) give the same scale bit for bit on every device.
INV_FP8_MAX = 1.0 / FP8_MAX
FP8_MAX_TL = tl.constexpr(FP8_MAX)
INV_FP8_MAX_TL = tl.constexpr(INV_FP8_MAX)
MIN_SCALE_TL = tl.constexpr(MIN_SCALE)


def _dynamic_scale(amax: torch.Tensor) -> torch.Tensor:
    """`max(amax / 448, MIN_SCALE)` in fp32, as the kernels compute it."""
    return (amax.to(torch.float32) * INV_FP8_MAX).clamp_(min=MIN_SCALE)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x / scale` saturated to e4m3 (`scale` broadcasts against `x`)."""
    q = x.to(torch.float32) / scale
    return q.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_tensor(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x_fp8, scale [])`: dynamic (amax / 448) when `scale` is None, else that static one."""
    if scale is None:
        scale = _dynamic_scale(x.abs().amax())
    scale = scale.reshape(()).to(torch.float32)
    return quantize_fp8(x, scale), scale


def quantize_per_row(
    x: torch.Tensor, scale_ub: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x_fp8, scale [rows, 1])`: one dynamic scale per row of a 2-D tensor (activation
    tokens, or weight output channels). `scale_ub`: each row's amax is first capped at it
    (FBGEMM's `activation_scale_ub`: an outlier row saturates instead of coarsening the
    scale), so its scale is at most `scale_ub / 448`."""
    assert x.dim() == 2, x.shape
    amax = x.abs().amax(dim=1, keepdim=True).to(torch.float32)
    if scale_ub is not None:
        amax = amax.clamp(max=scale_ub)
    scale = _dynamic_scale(amax)
    return quantize_fp8(x, scale), scale


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x_fp8, scale [rows, ceil(K / group)])`: one dynamic scale per row of a 2-D tensor and
    `group` columns (the last group of a row may be shorter: K need not be a multiple)."""
    assert x.dim() == 2 and group >= 1, (x.shape, group)
    rows, cols = x.shape
    groups = -(-cols // group)
    padded = torch.zeros(rows, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :cols] = x
    scale = _dynamic_scale(padded.view(rows, groups, group).abs().amax(dim=2))
    return quantize_fp8(x, scale.repeat_interleave(group, 1)[:, :cols]), scale


def quantize_expert_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_per_row` of each expert's matrix of `weight [E, R, K]`: `(e4m3 [E, R, K],
    float32 scale [E, R])`, one scale per expert and output row (the FP8 MoE layout,
    tandem_kernels.fused_moe's `w13_scale` / `w2_scale`)."""
    num_experts, rows, cols = weight.shape
    q, scale = quantize_per_row(weight.reshape(-1, cols))
    return q.view(num_experts, rows, cols), scale.view(num_experts, rows)


@triton.jit
def _row_amax(x_row, num_cols, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, num_cols, BLOCK):
        x = tl.load(x_row + start + offs, mask=start + offs < num_cols, other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    return tl.max(acc, axis=0)


@triton.jit
def _quantize_row(x_row, q_row, scale, num_cols, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for start in range(0, num_cols, BLOCK):
        mask = start + offs < num_cols
        x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX_TL, FP8_MAX_TL)
        tl.store(q_row + start + offs, q.to(q_row.dtype.element_ty), mask=mask)


@triton.jit
def _quant_per_token_kernel(
    x_ptr, q_ptr, scale_ptr, stride_x, stride_q, num_cols, scale_ub, HAS_UB: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    amax = _row_amax(x_ptr + row * stride_x, num_cols, BLOCK)
    if HAS_UB:
        amax = tl.minimum(amax, scale_ub)
    scale = tl.maximum(amax * INV_FP8_MAX_TL, MIN_SCALE_TL)
    tl.store(scale_ptr + row, scale)
    _quantize_row(x_ptr + row * stride_x, q_ptr + row * stride_q, scale, num_cols, BLOCK)


@triton.jit
def _quant_per_token_group_kernel(
    x_ptr, q_ptr, scale_ptr, stride_x, stride_q, num_cols, GROUP: tl.constexpr, BLOCK: tl.constexpr
):
    """Program (row, group): `_quant_per_token_kernel` over that group's columns alone."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    start = group * GROUP
    width = tl.minimum(num_cols - start, GROUP)
    x_row = x_ptr + row * stride_x + start
    scale = tl.maximum(_row_amax(x_row, width, BLOCK) * INV_FP8_MAX_TL, MIN_SCALE_TL)
    tl.store(scale_ptr + row * tl.num_programs(1) + group, scale)
    _quantize_row(x_row, q_ptr + row * stride_q + start, scale, width, BLOCK)


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, stride_x, num_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tl.atomic_max(amax_ptr, _row_amax(x_ptr + row * stride_x, num_cols, BLOCK))


@triton.jit
def _quant_per_tensor_kernel(
    x_ptr, q_ptr, amax_ptr, scale_ptr, stride_x, stride_q, num_cols, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    scale = tl.maximum(tl.load(amax_ptr) * INV_FP8_MAX_TL, MIN_SCALE_TL)
    if row == 0:
        tl.store(scale_ptr, scale)
    _quantize_row(x_ptr + row * stride_x, q_ptr + row * stride_q, scale, num_cols, BLOCK)


def _check_activation(x: torch.Tensor) -> tuple[int, int]:
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    return x.shape[0], x.shape[1]


def dynamic_quant_per_token(
    x: torch.Tensor, scale_ub: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_per_row(x, scale_ub)` of activations `[M, K]` in one Triton kernel (one
    program per row: its amax, capped at `scale_ub` when given, its scale, its e4m3 values).
    Capturable in a CUDA graph."""
    rows, cols = _check_activation(x)
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = min(triton.next_power_of_2(cols), 2048)
        ub = 0.0 if scale_ub is None else float(scale_ub)
        _quant_per_token_kernel[(rows,)](
            x, q, scale, x.stride(0), q.stride(0), cols, ub, HAS_UB=scale_ub is not None,
            BLOCK=block, num_warps=4,
        )  # fmt: skip
    return q, scale


def dynamic_quant_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_per_token_group` of activations `[M, K]` in one Triton kernel (one program
    per row and group of `group` columns: its amax, its scale, its e4m3 values); the scales
    `[M, ceil(K / group)]` are contiguous. Capturable in a CUDA graph."""
    rows, cols = _check_activation(x)
    assert group >= 1, group
    groups = triton.cdiv(cols, group)
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if rows and cols:
        block = min(triton.next_power_of_2(group), 2048)
        _quant_per_token_group_kernel[(rows, groups)](
            x, q, scale, x.stride(0), q.stride(0), cols, GROUP=group, BLOCK=block, num_warps=4
        )
    return q, scale


def dynamic_quant_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_per_tensor` (dynamic) of activations `[M, K]` in two Triton kernels: the
    rows' amax into one float (atomic max over a zeroed scalar), then every row quantized by
    the one scale. Capturable in a CUDA graph."""
    rows, cols = _check_activation(x)
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    if not rows:
        return q, torch.full((), MIN_SCALE, dtype=torch.float32, device=x.device)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(cols), 2048)
    _amax_kernel[(rows,)](x, amax, x.stride(0), cols, BLOCK=block, num_warps=4)
    _quant_per_tensor_kernel[(rows,)](
        x, q, amax, scale, x.stride(0), q.stride(0), cols, BLOCK=block, num_warps=4
    )
    return q, scale


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]):
    """A block scale `[ceil(N/bn), ceil(K/bk)]` repeated to one value per element `[N, K]`."""
    n, k = shape
    bn, bk = block
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def quantize_per_block(
    w: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(w_fp8, scale [ceil(N/bn), ceil(K/bk)])`: one scale per `bn x bk` tile of `[N, K]`."""
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w
    tiles = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3))
    scale = (tiles / FP8_MAX).clamp_(min=MIN_SCALE)
    return quantize_fp8(w, expand_block_scale(scale, (n, k), block)), scale


def quantize_expert_blocks(
    weight: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_per_block` of each expert's matrix of `weight [E, R, K]`: `(e4m3 [E, R, K],
    float32 scale [E, ceil(R/bn), ceil(K/bk)])`, one scale per expert and `bn x bk` tile (a
    block-scaled FP8 checkpoint's experts stacked; tandem_kernels.fused_moe's block form)."""
    pairs = [quantize_per_block(w, block) for w in weight]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None
) -> torch.Tensor:
    """float32 `q * scale` (a block scale with `block`, else one that broadcasts)."""
    if block is not None:
        scale = expand_block_scale(scale, tuple(q.shape), block)  # type: ignore[arg-type]
    return q.to(torch.float32) * scale


def _check_mm_args(
    a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor
) -> bool:
    """Assert `fp8_scaled_mm`'s rules; True when the scales are rowwise."""
    assert a.dtype == FP8_DTYPE and b.dtype == FP8_DTYPE, (a.dtype, b.dtype)
    assert a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[1], (a.shape, b.shape)
    assert a.stride(1) == 1 and b.stride(1) == 1, (a.stride(), b.stride())
    assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0, ("K, N % 16", a.shape, b.shape)
    assert a_scale.dtype == torch.float32 and b_scale.dtype == torch.float32
    rowwise = a_scale.numel() > 1 or b_scale.numel() > 1
    if rowwise:
        assert a_scale.shape == (a.shape[0], 1), (a_scale.shape, a.shape)
        assert b_scale.shape == (b.shape[0], 1), (b_scale.shape, b.shape)
    return rowwise


def fp8_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """`(a * a_scale) @ (b * b_scale)^T + bias` in `out_dtype` (see the module docstring for
    the shapes). Rowwise scales need a bf16 output (cuBLASLt's rule)."""
    rowwise = _check_mm_args(a, b, a_scale, b_scale)
    if rowwise:
        assert out_dtype == torch.bfloat16, "rowwise-scaled FP8 GEMMs output bf16"
        scale_b = b_scale.reshape(1, -1)
    else:
        a_scale, scale_b = a_scale.reshape(()), b_scale.reshape(())
    out = torch._scaled_mm(
        a, b.t(), scale_a=a_scale, scale_b=scale_b, bias=bias, out_dtype=out_dtype
    )
    # torch < 2.5 returned (out, amax); every version this runs on returns the tensor.
    return out[0] if isinstance(out, tuple) else out


def fp8_scaled_mm_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    b_block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Pure-torch reference: dequantize both operands to float32, multiply, add the bias,
    round to `out_dtype`. `b_block`: `b_scale` is a block scale of that tile shape."""
    out = dequantize(a, a_scale) @ dequantize(b, b_scale, b_block).t()
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)
