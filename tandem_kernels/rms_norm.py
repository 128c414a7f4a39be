"""RMSNorm and fused residual-add + RMSNorm.

Math in fp32; IO in the input dtype (bf16, fp16 or fp32). Rounding follows the Hugging Face
Llama RMSNorm: the normalised row is rounded to the input dtype before the weight multiply,
and the residual sum is rounded to the input dtype before it is normalised, so the results
match the usual eager torch code bit for bit up to the order of the fp32 sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels.pdl import launch_options, pdl_launch, pdl_wait


@triton.jit
def add_rms_norm_row(
    x_row,
    residual_row,
    residual_out_row,
    weight_ptr,
    offs,
    mask,
    eps,
    HIDDEN_SIZE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """One row: (with HAS_RESIDUAL) `x + residual` rounded to the IO dtype and stored to
    `residual_out_row`, then RMSNorm times the weight, returned in the IO dtype (the rounding
    of the module docstring). Shared by this module's kernel and the FP8-writing one."""
    x = tl.load(x_row + offs, mask=mask, other=0.0)
    io_dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(residual_row + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(io_dtype)
        tl.store(residual_out_row + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / HIDDEN_SIZE
    rstd = 1.0 / tl.sqrt(var + eps)
    normed = (xf * rstd).to(io_dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return (normed * w).to(io_dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    HIDDEN_SIZE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN_SIZE
    y = add_rms_norm_row(
        x_ptr + row * stride_x, residual_ptr + row * stride_r,
        residual_out_ptr + row * stride_ro, weight_ptr, offs, mask, eps, HIDDEN_SIZE,
        HAS_RESIDUAL,
    )  # fmt: skip
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    assert x.dim() == 2 and x.stride(-1) == 1, (x.shape, x.stride())
    assert weight.shape == (x.shape[1],) and weight.is_contiguous(), weight.shape
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    assert x.device == weight.device


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
    eps: float,
) -> None:
    num_tokens, hidden_size = x.shape
    if num_tokens == 0:
        return
    block = triton.next_power_of_2(hidden_size)
    r = residual if residual is not None else x
    ro = residual_out if residual_out is not None else out
    use_pdl = pdl_launch(x.device)
    _rms_norm_kernel[(num_tokens,)](
        x,
        r,
        weight,
        out,
        ro,
        x.stride(0),
        r.stride(0),
        out.stride(0),
        ro.stride(0),
        eps,
        HIDDEN_SIZE=hidden_size,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        USE_PDL=use_pdl,
        num_warps=min(max(block // 256, 1), 16),
        **launch_options(use_pdl),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dim of `x` `[T, hidden]`."""
    _check(x, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, out, None, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `(rms_norm(x + residual), x + residual)`; inputs are left untouched."""
    _check(x, weight)
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, residual, weight, out, residual_out, eps)
    return out, residual_out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Pure-torch reference of `rms_norm` (the Hugging Face Llama formulation)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed.to(x.dtype).float()).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of `fused_add_rms_norm`."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed
