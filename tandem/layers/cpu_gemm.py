"""The CPU step path's GEMMs: a prepacked copy of a weight, made once after loading, and the
product through it (the plain library calls repack the weight on every call, which is most of a
decode step's product time at tens of rows):

- float32 weights, where torch has MKL: MKL's packed sgemm, for products of at least
  `PACKED_MIN_ROWS` rows (fewer take `F.linear`: MKL's gemv-sized paths are as fast there, and
  single-row decode keeps exactly the arithmetic it had);
- bf16 weights, where oneDNN does bf16 (avx512_bf16 / AMX): oneDNN's blocked layout for its
  bf16 matmul (torch's `mkldnn._reorder_linear_weight` / `_linear_pointwise`), for every row
  count (measured faster than `F.linear` from one row to 256 at the embedded model's shapes).

Other devices and dtypes take `F.linear`. The CPU linear method (tandem.layers.linear) calls
`pack_cpu_weight` after loading and `packed_or_plain_linear` per step.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# Fewer rows than this take `F.linear` even with a packed weight (MKL's gemv-sized paths are
# as fast there, and single-row decode keeps exactly the arithmetic it had).
PACKED_MIN_ROWS = 16


def pack_cpu_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The prepacked form of a CPU `[N, K]` weight (see the module doc), or None where there is
    none (another device or dtype, no MKL / oneDNN bf16, no CPU extension)."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if weight.dtype == torch.bfloat16:
        if not _onednn_bf16():
            return None
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
    if weight.dtype != torch.float32:
        return None
    from tandem_kernels import cpu

    if not cpu.has_packed_sgemm():
        return None
    return cpu.pack_linear_weight(weight.detach())


@functools.cache
def _onednn_bf16() -> bool:
    """Whether this torch's oneDNN runs bf16 matmuls natively on this CPU."""
    return torch.backends.mkldnn.is_available() and bool(
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def packed_or_plain_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through `packed` (`pack_cpu_weight(weight)`) when it is
    given and `x` fits it: 2-D CPU rows of the weight's dtype, contiguous (bf16) or with
    contiguous rows and at least `PACKED_MIN_ROWS` of them (float32)."""
    if packed is None or x.dim() != 2 or x.device.type != "cpu" or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    if packed.layout == torch._mkldnn:
        if x.shape[0] == 0 or not x.is_contiguous():
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if x.shape[0] >= PACKED_MIN_ROWS and x.stride(-1) == 1:  # MKL's: a float32 weight
        from tandem_kernels import cpu

        return cpu.packed_linear(x, packed, bias, weight.shape[0])
    return F.linear(x, weight, bias)
