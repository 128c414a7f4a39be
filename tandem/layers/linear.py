"""Linear layers whose weights may be fused from several checkpoint tensors.

Weights are `[out_features, in_features]` as in `torch.nn.Linear`. Fused layers concatenate
their parts along the output dim and load each part with `load_shard`:

    QKVLinear:        [ q (num_heads * head_size) | k (num_kv_heads * head_size) | v (...) ]
    MergedLinear:     [ part 0 | part 1 | ... ]      (gate_up: [ gate | up ])

On the CPU step path, `pack_for_cpu` keeps a copy of the weight in a prepacked layout beside
it, made once after loading (the plain library calls repack the weight on every call, which is
most of a decode step's product time at tens of rows):
- float32 weights, where torch has MKL: MKL's packed sgemm, for products of at least
  `PACKED_MIN_ROWS` rows (fewer take `F.linear`: MKL's gemv-sized paths are as fast there, and
  single-row decode keeps exactly the arithmetic it had);
- bf16 weights, where oneDNN does bf16 (avx512_bf16 / AMX): oneDNN's blocked layout for its
  bf16 matmul (torch's `mkldnn._reorder_linear_weight` / `_linear_pointwise`), for every row
  count (measured faster than `F.linear` from one row to 256 at the embedded model's shapes).
Other devices and dtypes take `F.linear` as before.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

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


class Linear(nn.Module):
    """`y = x W^T + b` with uninitialised parameters (they are always loaded)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(
                torch.empty(out_features, dtype=dtype, device=device), requires_grad=False
            )
        # The prepacked copy of `weight` (`pack_for_cpu`); None until packed, or off the CPU.
        self.cpu_packed_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        return packed_or_plain_linear(x, self.weight, self.bias, self.cpu_packed_weight)

    def pack_for_cpu(self) -> bool:
        """Make (again) the packed copy of the loaded weight; call it after every change of the
        weight. Returns whether there is one (see the module doc)."""
        self.cpu_packed_weight = pack_cpu_weight(self.weight)
        return self.cpu_packed_weight is not None

    def param(self, kind: str) -> nn.Parameter:
        """The "weight" or "bias" parameter, with a clear error when it doesn't exist."""
        param = getattr(self, kind, None)
        if not isinstance(param, nn.Parameter):
            raise ValueError(f"{type(self).__name__} has no {kind}")
        return param

    def load_full(self, kind: str, loaded: torch.Tensor) -> None:
        param = self.param(kind)
        _check_shape(param.shape, loaded.shape, kind)
        param.data.copy_(loaded)


class MergedLinear(Linear):
    """Several linear layers with the same input, fused along the output dim."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(in_features, sum(output_sizes), bias, dtype, device)
        self.output_sizes = list(output_sizes)
        self.output_offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def load_shard(self, index: int, kind: str, loaded: torch.Tensor) -> None:
        """Copy part `index` ("weight" or "bias") into its rows."""
        param = self.param(kind)
        start, size = self.output_offsets[index], self.output_sizes[index]
        target = param.data.narrow(0, start, size)
        _check_shape(target.shape, loaded.shape, f"{kind} part {index}")
        target.copy_(loaded)


class QKVLinear(MergedLinear):
    """Q, K and V projections fused: shards "q", "k", "v"."""

    SHARDS = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.q_size = num_heads * head_size
        self.kv_size = num_kv_heads * head_size
        super().__init__(
            hidden_size, [self.q_size, self.kv_size, self.kv_size], bias, dtype, device
        )

    def load_qkv_shard(self, shard: str, kind: str, loaded: torch.Tensor) -> None:
        self.load_shard(self.SHARDS.index(shard), kind, loaded)


def _check_shape(expected: torch.Size, got: torch.Size, what: str) -> None:
    if tuple(expected) != tuple(got):
        raise ValueError(
            f"{what}: checkpoint shape {tuple(got)} != parameter shape {tuple(expected)}"
        )
