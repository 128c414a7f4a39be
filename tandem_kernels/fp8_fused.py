"""FP8 (e4m3) activation quantization fused into the kernel that produces the activation:
(residual-add +) RMSNorm, and SiLU-and-mul, each writing e4m3 plus its scale instead of a
bf16 tensor that the next linear layer would read back to quantize. Beside each, its
pure-torch reference: the unfused op (tandem_kernels.rms_norm / .activation references) then
the torch quantizer (tandem_kernels.fp8).

The value quantized is the unfused op's output rounded to the IO dtype, so the scales are the
unfused path's bit for bit (up to the order of the RMSNorm's fp32 sum). Scale conventions as in
tandem_kernels.fp8 (`x ~= q * scale`); four strategies, vLLM's names:

    "token"    dynamic, one scale per row `[T, 1]`: one pass (a program holds its row's max)
    "group"    dynamic, one scale per row and `group` columns `[T, ceil(K / group)]`
               (SiLU-and-mul only, for block-scaled FP8 weights: group = their bk): one
               pass, a program per row and group
    "tensor"   dynamic, one scale `[]`: two passes (the rows' max into one float by an
               atomic max, then every row quantized by it); the first pass of the norm also
               writes the residual sum, which the second reads back instead of `x + residual`
    "static"   a given scale `[]` (a checkpoint's `input_scale`): one pass

Every entry allocates its outputs with `torch.empty` / `torch.zeros` and reads no value back
to the host: capturable in a CUDA graph. Rows are the kernel's grid; `x` is `[T, K]` with unit
stride along K.
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

from tandem_kernels.activation import silu_and_mul_ref
from tandem_kernels.fp8 import (
    FP8_DTYPE,
    FP8_MAX_TL,
    INV_FP8_MAX_TL,
    MIN_SCALE,
    MIN_SCALE_TL,
    quantize_per_row,
    quantize_per_tensor,
    quantize_per_token_group,
)
from tandem_kernels.rms_norm import add_rms_norm_row, fused_add_rms_norm_ref, rms_norm_ref

QuantStrategy = Literal["token", "group", "tensor", "static"]

# Kernel modes (constexpr): what a program does with its row's values.
_TOKEN, _STATIC, _AMAX, _FROM_AMAX = 0, 1, 2, 3


@triton.jit
def _abs_max(y, mask):
    """max |y| over the masked-in lanes, as the unfused quantizers take it (tandem_kernels.fp8:
    `tl.maximum` onto zeros, which drops NaN lanes): a NaN row (a CUDA graph's padding rows
    hold whatever their buffers held) neither poisons a per-tensor scale nor differs from
    the unfused path's."""
    return tl.max(tl.maximum(tl.zeros_like(y), tl.where(mask, tl.abs(y), 0.0)), axis=0)


@triton.jit
def _scale_and_store(y, row, q_row, scale_ptr, amax_ptr, offs, mask, MODE: tl.constexpr):
    """Quantize the row `y` (fp32 values of the IO dtype) by the mode's scale, or (`_AMAX`)
    only fold its max into `amax_ptr`."""
    if MODE == 2:
        tl.atomic_max(amax_ptr, _abs_max(y, mask))
    else:
        if MODE == 0:
            amax = _abs_max(y, mask)
            scale = tl.maximum(amax * INV_FP8_MAX_TL, MIN_SCALE_TL)
            tl.store(scale_ptr + row, scale)
        elif MODE == 1:
            scale = tl.load(scale_ptr)
        else:
            scale = tl.maximum(tl.load(amax_ptr) * INV_FP8_MAX_TL, MIN_SCALE_TL)
            if row == 0:
                tl.store(scale_ptr, scale)
        q = tl.clamp(tl.math.div_rn(y, scale), -FP8_MAX_TL, FP8_MAX_TL)
        tl.store(q_row + offs, q.to(q_row.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_fp8_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    q_ptr,
    residual_out_ptr,
    scale_ptr,
    amax_ptr,
    stride_x,
    stride_r,
    stride_q,
    stride_ro,
    eps,
    HIDDEN_SIZE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN_SIZE
    y = add_rms_norm_row(
        x_ptr + row * stride_x, residual_ptr + row * stride_r,
        residual_out_ptr + row * stride_ro, weight_ptr, offs, mask, eps, HIDDEN_SIZE,
        HAS_RESIDUAL,
    ).to(tl.float32)  # fmt: skip
    _scale_and_store(y, row, q_ptr + row * stride_q, scale_ptr, amax_ptr, offs, mask, MODE)


@triton.jit
def _silu_mul_row_block(x_row, start, INTERMEDIATE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """`silu(gate) * up` over columns [start, start + BLOCK) of one row, rounded as the
    unfused kernel rounds (fp32 values of the IO dtype), with its mask and offsets."""
    offs = start + tl.arange(0, BLOCK)
    mask = offs < INTERMEDIATE_SIZE
    gate = tl.load(x_row + offs, mask=mask, other=0.0)
    up = tl.load(x_row + INTERMEDIATE_SIZE + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    y = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
    return y, offs, mask


@triton.jit
def _silu_and_mul_fp8_token_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    stride_x,
    stride_q,
    INTERMEDIATE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row: its max over every block, then each block again, quantized."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, INTERMEDIATE_SIZE, BLOCK):
        y, offs, mask = _silu_mul_row_block(x_row, start, INTERMEDIATE_SIZE, BLOCK)
        acc = tl.maximum(acc, tl.where(mask, tl.abs(y), 0.0))
    scale = tl.maximum(tl.max(acc, axis=0) * INV_FP8_MAX_TL, MIN_SCALE_TL)
    tl.store(scale_ptr + row, scale)
    for start in range(0, INTERMEDIATE_SIZE, BLOCK):
        y, offs, mask = _silu_mul_row_block(x_row, start, INTERMEDIATE_SIZE, BLOCK)
        q = tl.clamp(tl.math.div_rn(y, scale), -FP8_MAX_TL, FP8_MAX_TL)
        tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_group_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    stride_x,
    stride_q,
    INTERMEDIATE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (row, group): the group's GROUP columns (BLOCK >= GROUP), their max, their
    scale (`scale[row, group]`, contiguous), their e4m3 values."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    x_row = x_ptr + row * stride_x
    y, offs, mask = _silu_mul_row_block(x_row, group * GROUP, INTERMEDIATE_SIZE, BLOCK)
    mask = mask & (tl.arange(0, BLOCK) < GROUP)
    scale = tl.maximum(_abs_max(y, mask) * INV_FP8_MAX_TL, MIN_SCALE_TL)
    tl.store(scale_ptr + row * tl.num_programs(1) + group, scale)
    q = tl.clamp(tl.math.div_rn(y, scale), -FP8_MAX_TL, FP8_MAX_TL)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_block_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    amax_ptr,
    stride_x,
    stride_q,
    INTERMEDIATE_SIZE: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid (rows, column blocks), for the per-tensor modes (`_STATIC`, `_AMAX`,
    `_FROM_AMAX`)."""
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    y, offs, mask = _silu_mul_row_block(x_ptr + row * stride_x, start, INTERMEDIATE_SIZE, BLOCK)
    # `_scale_and_store` stores the scale from row 0 only; make that column block 0's.
    scale_row = row + tl.program_id(1)
    _scale_and_store(y, scale_row, q_ptr + row * stride_q, scale_ptr, amax_ptr, offs, mask, MODE)


def _check_strategy(
    strategy: str, scale: torch.Tensor | None, device: torch.device, group: int | None = None
) -> None:
    assert strategy in ("token", "group", "tensor", "static"), strategy
    assert (scale is not None) == (strategy == "static"), "a scale is given for static only"
    assert (group is not None) == (strategy == "group"), "a group size is given for group only"
    assert group is None or group >= 1, group
    if scale is not None:
        assert scale.numel() == 1 and scale.dtype == torch.float32, (scale.shape, scale.dtype)
        assert scale.device == device


def _scale_out(
    strategy: QuantStrategy,
    rows: int,
    scale: torch.Tensor | None,
    device: torch.device,
    groups: int = 1,
) -> torch.Tensor:
    if strategy in ("token", "group"):
        return torch.empty((rows, groups), dtype=torch.float32, device=device)
    if strategy == "static":
        return scale.reshape(())  # type: ignore[union-attr]
    if rows == 0:
        return torch.full((), MIN_SCALE, dtype=torch.float32, device=device)
    return torch.empty((), dtype=torch.float32, device=device)


def rms_norm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    strategy: QuantStrategy,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`(q, scale, residual_out)`: RMSNorm of `x` (`x + residual` with a residual, whose sum
    is returned as `residual_out`, else None) quantized to e4m3 under `strategy` (`scale`:
    the static one; "group" is SiLU-and-mul's only). Inputs are left untouched."""
    assert strategy != "group", "rms_norm_fp8 quantizes per token, per tensor or by a scale"
    assert x.dim() == 2 and x.stride(-1) == 1, (x.shape, x.stride())
    assert weight.shape == (x.shape[1],) and weight.is_contiguous(), weight.shape
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    _check_strategy(strategy, scale, x.device)
    rows, hidden = x.shape
    q = torch.empty((rows, hidden), dtype=FP8_DTYPE, device=x.device)
    residual_out = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.stride(-1) == 1
        residual_out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    scale_out = _scale_out(strategy, rows, scale, x.device)
    if rows == 0:
        return q, scale_out, residual_out
    block = triton.next_power_of_2(hidden)
    warps = min(max(block // 256, 1), 16)

    def launch(src: torch.Tensor, res: torch.Tensor | None, mode: int, amax: torch.Tensor) -> None:
        r = res if res is not None else src
        ro = residual_out if res is not None else q
        _rms_norm_fp8_kernel[(rows,)](
            src, r, weight, q, ro, scale_out, amax,
            src.stride(0), r.stride(0), q.stride(0), ro.stride(0), eps,
            HIDDEN_SIZE=hidden, HAS_RESIDUAL=res is not None, MODE=mode, BLOCK=block,
            num_warps=warps,
        )  # fmt: skip

    if strategy == "tensor":
        amax = torch.zeros((), dtype=torch.float32, device=x.device)
        launch(x, residual, _AMAX, amax)
        launch(residual_out if residual_out is not None else x, None, _FROM_AMAX, amax)
    else:
        launch(x, residual, _TOKEN if strategy == "token" else _STATIC, scale_out)
    return q, scale_out, residual_out


def silu_and_mul_fp8(
    x: torch.Tensor,
    strategy: QuantStrategy,
    scale: torch.Tensor | None = None,
    group: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q, scale)`: `silu(x[:, :I]) * x[:, I:]` of `x` `[T, 2*I]` quantized to e4m3 `[T, I]`
    under `strategy` (`scale`: the static one; `group`: "group"'s columns a scale, the scales
    `[T, ceil(I / group)]` contiguous, the last group shorter where group does not divide I)."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(-1) == 1, (x.shape, x.stride())
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    _check_strategy(strategy, scale, x.device, group)
    rows, inter = x.shape[0], x.shape[1] // 2
    q = torch.empty((rows, inter), dtype=FP8_DTYPE, device=x.device)
    groups = triton.cdiv(inter, group) if group is not None else 1
    scale_out = _scale_out(strategy, rows, scale, x.device, groups)
    if rows == 0:
        return q, scale_out
    if group is not None:
        block = min(triton.next_power_of_2(group), 2048)
        assert group <= block, ("groups of at most 2048 columns", group)
        _silu_and_mul_fp8_group_kernel[(rows, groups)](
            x, q, scale_out, x.stride(0), q.stride(0),
            INTERMEDIATE_SIZE=inter, GROUP=group, BLOCK=block, num_warps=4,
        )  # fmt: skip
        return q, scale_out
    if strategy == "token":
        block = min(triton.next_power_of_2(inter), 2048)
        _silu_and_mul_fp8_token_kernel[(rows,)](
            x, q, scale_out, x.stride(0), q.stride(0),
            INTERMEDIATE_SIZE=inter, BLOCK=block, num_warps=4 if block <= 1024 else 8,
        )  # fmt: skip
        return q, scale_out
    block = min(triton.next_power_of_2(inter), 1024)
    grid = (rows, triton.cdiv(inter, block))

    def launch(mode: int, amax: torch.Tensor) -> None:
        _silu_and_mul_fp8_block_kernel[grid](
            x, q, scale_out, amax, x.stride(0), q.stride(0),
            INTERMEDIATE_SIZE=inter, MODE=mode, BLOCK=block, num_warps=4,
        )  # fmt: skip

    if strategy == "tensor":
        amax = torch.zeros((), dtype=torch.float32, device=x.device)
        launch(_AMAX, amax)
        launch(_FROM_AMAX, amax)
    else:
        launch(_STATIC, scale_out)
    return q, scale_out


def quantize_activation_ref(
    x: torch.Tensor,
    strategy: QuantStrategy,
    scale: torch.Tensor | None = None,
    group: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch quantizer of `strategy` (tandem_kernels.fp8): what the fused kernels
    apply to their unfused output."""
    if strategy == "token":
        return quantize_per_row(x)
    if strategy == "group":
        assert group is not None, "a group size is given for group"
        return quantize_per_token_group(x, group)
    return quantize_per_tensor(x, scale if strategy == "static" else None)


def rms_norm_fp8_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    strategy: QuantStrategy,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pure-torch reference of `rms_norm_fp8`."""
    if residual is None:
        out, residual_out = rms_norm_ref(x, weight, eps), None
    else:
        out, residual_out = fused_add_rms_norm_ref(x, residual, weight, eps)
    q, s = quantize_activation_ref(out, strategy, scale)
    return q, s, residual_out


def silu_and_mul_fp8_ref(
    x: torch.Tensor,
    strategy: QuantStrategy,
    scale: torch.Tensor | None = None,
    group: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of `silu_and_mul_fp8`."""
    return quantize_activation_ref(silu_and_mul_ref(x), strategy, scale, group)
