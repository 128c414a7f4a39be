"""SiLU-and-multiply: `[T, 2*I]` (gate | up) -> `silu(gate) * up` `[T, I]`.

Rounding follows the eager torch expression `F.silu(gate) * up`: silu is computed in fp32 and
rounded to the IO dtype, then the product is computed in fp32 and rounded again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def silu_and_mul_tile(gate, up):
    """`silu(gate) * up` in fp32 of gate and up tiles in the IO dtype, rounded as the module
    docstring says (silu rounded to the IO dtype before the product); the caller rounds the
    product as it stores it. Kernels that fuse this step call it to keep the same values."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return act.to(tl.float32) * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    stride_x,
    stride_o,
    INTERMEDIATE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    ROW_SCALE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTERMEDIATE_SIZE
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + INTERMEDIATE_SIZE + offs, mask=mask, other=0.0)
    out = silu_and_mul_tile(gate, up)
    if ROW_SCALE:
        # As `act.mul_(scale.to(act.dtype))` after the unscaled kernel: both rounded first.
        scale = tl.load(scale_ptr + row).to(gate.dtype).to(tl.float32)
        out = out.to(gate.dtype).to(tl.float32) * scale
    tl.store(out_ptr + row * stride_o + offs, out.to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(x[:, :I]) * x[:, I:]` for `x` `[T, 2*I]`; returns a new `[T, I]` tensor.
    `row_scale` `[T]`: each row also times its scale, rounded as `silu_and_mul(x) *
    row_scale.to(x.dtype)` would round (the MoE's routed weights, in one pass)."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(-1) == 1, (x.shape, x.stride())
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    num_tokens, intermediate_size = x.shape[0], x.shape[1] // 2
    assert row_scale is None or row_scale.shape == (num_tokens,), row_scale.shape
    out = torch.empty((num_tokens, intermediate_size), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(triton.next_power_of_2(intermediate_size), 1024)
    grid = (num_tokens, triton.cdiv(intermediate_size, block))
    _silu_and_mul_kernel[grid](
        x,
        out,
        x if row_scale is None else row_scale.contiguous(),
        x.stride(0),
        out.stride(0),
        INTERMEDIATE_SIZE=intermediate_size,
        BLOCK=block,
        ROW_SCALE=row_scale is not None,
        num_warps=4,
    )
    return out


def silu_and_mul_ref(x: torch.Tensor, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch reference of `silu_and_mul`."""
    gate, up = x.chunk(2, dim=-1)
    out = F.silu(gate) * up
    return out if row_scale is None else out * row_scale.to(out.dtype).unsqueeze(1)
