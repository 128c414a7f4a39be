"""Linear layers whose weights may be fused from several checkpoint tensors.

Weights are `[out_features, in_features]` as in `torch.nn.Linear`. Fused layers concatenate
their parts along the output dim and load each part with `load_shard`:

    QKVLinear:        [ q (num_heads * head_size) | k (num_kv_heads * head_size) | v (...) ]
    MergedLinear:     [ part 0 | part 1 | ... ]      (gate_up: [ gate | up ])

On the CPU step path, `pack_for_cpu` keeps a prepacked copy of the weight beside it
(tandem.layers.cpu_gemm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.cpu_gemm import pack_cpu_weight, packed_or_plain_linear


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
