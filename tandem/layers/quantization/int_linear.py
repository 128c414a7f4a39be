"""Linear layers with integer weights kept quantized (GPTQ, AWQ, compressed-tensors W4A16 /
W8A16 on CUDA): the product through tandem_kernels.int_w4a16, which unpacks and scales each
weight tile in registers (or, at prefill sizes where its tuner measures it faster, unpacks
the whole weight into a transient 16-bit copy for cuBLAS); a quarter (4 bits) or half (8
bits) of the 16-bit weight's bytes to hold and, at decode sizes, to read.

The checkpoint's tensors reach the layer already converted (int_weight_only's
`map_checkpoint`, `keep_quantized`) into parameters the layer's own `weight_loader` shards as
it shards any `[out, in]` weight:

    weight             uint8 [N, K * bits / 8]  output_dim 0, input_dim 1 (4 bits: a rank's K
                                                columns are whole bytes, K / TP even)
    weight_scale       [N, G]  model's dtype    output_dim 0; input_dim 1 with groups (a
    weight_zero_point  [N, G]  model's dtype    row-parallel rank's K columns are whole groups:
                                                its G = K_part / group_size); one group: whole
                                                on every rank

    input_perm         int32 [K]               act-order checkpoints only: the input order
                                                the weight's columns are stored in
                                                (int_weight_only.act_order_perm); whole on
                                                every rank (column-parallel and replicated
                                                layers; row-parallel ones of such checkpoints
                                                keep it only at TP = 1)

Fused layers (qkv, gate_up) take each part's rows at the part's offset, as for the 16-bit
weight, since every parameter is one row per output; their parts share one input order, and
a part whose `input_perm` differs from the first loaded is a ConfigError naming that part.
After loading, the scales and zero points are transposed to `[G, N]` (a tile's values one
contiguous load), an identity input order is dropped, the kernel's configs are tuned for
this shape on CUDA, and the split-K lock buffer is made.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tandem.config import ConfigError
from tandem.layers.quantization.base import LinearMethodBase, set_weight_attrs


class IntWeightLinearMethod(LinearMethodBase):
    """One linear layer with `bits`-bit weights in groups of `group_size` input channels
    (-1: one group a row). After `process_weights_after_loading` the layer holds `weight`
    uint8 `[N, K * bits / 8]`, `weight_scale` and `weight_zero_point` `[G, N]` (transposed
    from their loading shape), `int_weight_locks` (split-K locks) and `input_perm` (with
    `act_order`: the int64 order its input is gathered in, or None where it is the identity)."""

    def __init__(self, bits: int, group_size: int, act_order: bool = False) -> None:
        self.bits = bits
        self.group_size = group_size
        self.act_order = act_order

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        *,
        device: torch.device | None = None,
        **extra_weight_attrs: Any,
    ) -> None:
        rows, cols = sum(output_partition_sizes), input_size_per_partition
        what = getattr(layer, "prefix", "") or type(layer).__name__
        if self.bits == 4 and cols % 2:
            raise ConfigError(
                f"{what}: 4-bit weights pack two a byte; this rank has {cols} columns"
            )
        group_size = self.group_size
        if group_size != -1 and cols != input_size and cols % group_size:
            raise ConfigError(
                f"{what}: this rank's {cols} input columns ({input_size} over the tensor "
                f"parallel ranks) are not whole groups of {group_size}"
            )
        groups = 1 if group_size == -1 else -(-cols // group_size)
        layer.int_weight_locks = None

        def param(*shape: int, dtype: torch.dtype, attrs: dict[str, Any]) -> nn.Parameter:
            made = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), False)
            set_weight_attrs(made, {**attrs, **extra_weight_attrs})
            return made

        byte_cols = cols * self.bits // 8
        both = {"output_dim": 0, "input_dim": 1}
        layer.register_parameter("weight", param(rows, byte_cols, dtype=torch.uint8, attrs=both))
        group_attrs = both if group_size != -1 else {"output_dim": 0}
        for name in ("weight_scale", "weight_zero_point"):
            layer.register_parameter(
                name, param(rows, groups, dtype=params_dtype, attrs=group_attrs)
            )
        if not self.act_order:
            layer.input_perm = None
        else:
            perm = nn.Parameter(torch.empty(cols, dtype=torch.int32, device=device), False)
            set_weight_attrs(perm, {"weight_loader": _perm_loader(what)})
            layer.register_parameter("input_perm", perm)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from tandem_kernels import int_w4a16

        for name in ("weight_scale", "weight_zero_point"):
            value = getattr(layer, name).data.t().contiguous()  # [G, N]
            delattr(layer, name)
            layer.register_parameter(name, nn.Parameter(value, requires_grad=False))
        perm = getattr(layer, "input_perm", None)
        if perm is not None:
            order = perm.data.to(torch.int64)
            delattr(layer, "input_perm")
            identity = torch.equal(order, torch.arange(order.numel(), device=order.device))
            layer.input_perm = None if identity else order
        weight = layer.weight.data
        layer.int_weight_locks = int_w4a16.w4a16_locks(weight.shape[0], weight.device)
        int_w4a16.tune_w4a16(
            weight,
            layer.weight_scale.data.t(),
            layer.weight_zero_point.data.t(),
            self.bits,
            self.group_size,
            layer.params_dtype,
        )

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        from tandem_kernels.int_w4a16 import w4a16_gemm

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if layer.input_perm is not None:
            x2 = x2.index_select(1, layer.input_perm)  # the weight's column order
        elif x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = w4a16_gemm(
            x2,
            layer.weight,
            layer.weight_scale.t(),
            layer.weight_zero_point.t(),
            self.bits,
            self.group_size,
            locks=layer.int_weight_locks,
        )
        if bias is not None:
            out = out + bias
        return out.reshape(*shape[:-1], out.shape[-1])


def _perm_loader(what: str) -> Callable[..., None]:
    """The `input_perm` loader: the first part's order as it comes; every later part of a
    fused layer must bring the same one."""
    loaded: list[torch.Tensor] = []

    def load(param: nn.Parameter, order: torch.Tensor, shard_id: Any = None) -> None:
        order = order.to(torch.int32).reshape(-1)
        if order.shape != param.shape:
            raise ConfigError(
                f"{what}: input_perm of {order.numel()} channels, the layer takes {param.numel()}"
            )
        if loaded:
            if not torch.equal(loaded[0], order.cpu()):
                raise ConfigError(
                    f"{what}: part {shard_id!r} has another act order (g_idx) than the part "
                    "loaded before it; a fused layer's parts must share one to stay quantized"
                )
            return
        param.data.copy_(order)
        loaded.append(order.cpu())

    return load
