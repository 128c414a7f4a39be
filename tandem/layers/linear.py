"""Linear layers split over the tensor-parallel ranks, each weight made and multiplied by its
quantization method (tandem.layers.quantization).

Weights are `[out, in]` as in `torch.nn.Linear`. With TP size `n`, rank `r` holds:

    ReplicatedLinear           all of W
    ColumnParallelLinear       rows [r * out/n, (r+1) * out/n)        y_r = x W_r^T  (gather: y)
    MergedColumnParallelLinear each part's rows of rank r, fused:      [gate_r | up_r]
    QKVParallelLinear          [q_r | k_r | v_r]: query heads split; KV heads split, or
                               replicated when n > num_kv_heads (rank r holds KV head
                               r * num_kv_heads // n)
    RowParallelLinear          columns [r * in/n, (r+1) * in/n)        y = sum_r x_r W_r^T
                               (the sum: an all-reduce over the TP group; bias added once)

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)`, which takes
this rank's part of the full checkpoint tensor (`shard_id`: the fused part, "q"/"k"/"v" or an
index); `loaded_weight` may be lazy (tandem.layers.weight_utils), so a rank reads only its part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tandem.layers.quantization.base import set_weight_attrs
from tandem.layers.quantization.factory import get_quant_method
from tandem.layers.weight_utils import LoadedWeight, copy_weight, full_weight, narrow_weight

if TYPE_CHECKING:
    from tandem.models.interface import ModelContext


def divide(numerator: int, denominator: int, what: str) -> int:
    """`numerator // denominator`, with an error naming `what` when it does not divide."""
    if numerator % denominator:
        raise ValueError(
            f"{what} {numerator} is not divisible by the tensor parallel size {denominator}"
        )
    return numerator // denominator


def check_full_size(loaded: LoadedWeight, dim: int, expected: int, what: str) -> None:
    """The checkpoint tensor spans the whole (unsharded) `expected` along `dim`."""
    if loaded.shape[dim] != expected:
        raise ValueError(
            f"{what}: checkpoint shape {tuple(loaded.shape)} has {loaded.shape[dim]} along dim "
            f"{dim}, the layer {expected}"
        )


class LinearBase(nn.Module):
    """A linear layer whose weights come from its quantization method.

    `input_size` / `output_size` are the unsharded layer's; subclasses set this rank's
    `input_size_per_partition` and `output_partition_sizes` before `_create_weights`.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        ctx: ModelContext,
        prefix: str = "",
        tp_sharded: bool = True,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = ctx.dtype
        self.device = ctx.device
        self.tp_group = ctx.parallel.tp
        self.tp_rank = ctx.parallel.tp_rank if tp_sharded else 0
        self.tp_size = ctx.parallel.tp_size if tp_sharded else 1
        self.prefix = prefix
        # Fed by a gated activation (`SiluAndMul(quant_consumer=self)` sets it), which a
        # method may fold into its own loads at small batches: the layer's kernel then follows
        # the projection before it directly (the W8A16 tuner times it so).
        self.gated_input = False
        self.quant_method = get_quant_method(ctx, self, prefix)
        self.bias: nn.Parameter | None = None

    def _create_weights(
        self, input_size_per_partition: int, output_partition_sizes: list[int], bias: bool
    ) -> None:
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = list(output_partition_sizes)
        self.output_size_per_partition = sum(output_partition_sizes)
        self.quant_method.create_weights(
            self,
            input_size_per_partition,
            self.output_partition_sizes,
            self.input_size,
            self.output_size,
            self.params_dtype,
            device=self.device,
            weight_loader=self.weight_loader,
        )
        if bias:
            self.bias = nn.Parameter(
                torch.empty(
                    self.output_size_per_partition, dtype=self.params_dtype, device=self.device
                ),
                requires_grad=False,
            )
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None
    ) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size_per_partition}, out={self.output_size_per_partition}, "
            f"bias={self.bias is not None}, tp_size={self.tp_size}, "
            f"method={type(self.quant_method).__name__}"
        )


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        ctx: ModelContext,
        prefix: str = "",
    ) -> None:
        super().__init__(input_size, output_size, ctx, prefix, tp_sharded=False)
        self._create_weights(input_size, [output_size], bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None
    ) -> None:
        copy_weight(param.data, loaded_weight, self.prefix or "replicated linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output rows split over the TP ranks; `gather_output` all-gathers `y` on every rank
    (else each rank keeps its `[T, out / n]`)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        ctx: ModelContext,
        gather_output: bool = False,
        output_sizes: list[int] | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(input_size, output_size, ctx, prefix)
        self.gather_output = gather_output
        self.output_sizes = list(output_sizes) if output_sizes is not None else [output_size]
        what = prefix or type(self).__name__
        partition_sizes = [
            divide(size, self.tp_size, f"{what}: output size") for size in self.output_sizes
        ]
        self._create_weights(input_size, partition_sizes, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None
    ) -> None:
        output_dim = getattr(param, "output_dim", None)
        what = self.prefix or type(self).__name__
        if output_dim is not None:
            size = param.data.shape[output_dim]
            check_full_size(loaded_weight, output_dim, size * self.tp_size, what)
            loaded_weight = narrow_weight(loaded_weight, output_dim, self.tp_rank * size, size)
        copy_weight(param.data, loaded_weight, what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias)
        if self.gather_output and self.tp_size > 1:
            out = self.tp_group.all_gather(out, dim=-1)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers with one input, fused along the output dim: each rank
    holds its rows of every part, `[part0_r | part1_r | ...]` (gate/up: `[gate_r | up_r]`).
    `shard_id` is the part's index; None loads a checkpoint tensor already fused."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        ctx: ModelContext,
        gather_output: bool = False,
        prefix: str = "",
    ) -> None:
        super().__init__(
            input_size, sum(output_sizes), bias, ctx, gather_output, output_sizes, prefix
        )

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """`silu_and_mul(self(x))` for a `[gate | up]` layer in one kernel, where this
        layer's method has one for `x` (`apply_silu_mul`); None: the caller runs the two."""
        if self.gather_output and self.tp_size > 1:
            return None
        return self.quant_method.apply_silu_mul(self, x, self.bias)

    def _shard_rows(self, shard_id: Any) -> tuple[int, int, int, int]:
        """`(offset in the parameter, rows, start in the checkpoint part, the part's full
        rows)` of a part."""
        index = int(shard_id)
        if not 0 <= index < len(self.output_sizes):
            raise ValueError(f"{self.prefix}: no part {shard_id!r} (has {len(self.output_sizes)})")
        offset = sum(self.output_partition_sizes[:index])
        size = self.output_partition_sizes[index]
        return offset, size, self.tp_rank * size, self.output_sizes[index]

    def _full_part_sizes(self) -> list[tuple[Any, int]]:
        return list(enumerate(self.output_sizes))

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None
    ) -> None:
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:  # e.g. a per-tensor scale: the same on every rank
            copy_weight(param.data, loaded_weight, self.prefix)
            return
        if shard_id is None:  # a fused checkpoint tensor: each part in turn
            offset = 0
            fused = full_weight(loaded_weight)
            for part, size in self._full_part_sizes():
                self.weight_loader(param, fused.narrow(output_dim, offset, size), part)
                offset += size
            return
        offset, size, start, full = self._shard_rows(shard_id)
        what = f"{self.prefix or type(self).__name__} part {shard_id}"
        check_full_size(loaded_weight, output_dim, full, what)
        target = param.data.narrow(output_dim, offset, size)
        copy_weight(target, narrow_weight(loaded_weight, output_dim, start, size), what)


class QKVParallelLinear(MergedColumnParallelLinear):
    """Q, K and V projections fused, split by heads: rank r holds `[q_r | k_r | v_r]`.

    Query heads are split evenly. KV heads are split when there are at least as many as
    ranks, else replicated: each of `num_kv_head_replicas` ranks in a row holds the same one
    (rank r holds KV head `r * total_num_kv_heads // tp_size`).
    """

    SHARD_IDS = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool,
        ctx: ModelContext,
        prefix: str = "",
    ) -> None:
        tp_size = ctx.parallel.tp_size
        what = prefix or "QKVParallelLinear"
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, f"{what}: num_attention_heads")
        if tp_size >= total_num_kv_heads:
            if tp_size % total_num_kv_heads:
                raise ValueError(
                    f"{what}: the tensor parallel size {tp_size} is neither a divisor nor a "
                    f"multiple of num_key_value_heads {total_num_kv_heads}"
                )
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp_size // total_num_kv_heads
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, f"{what}: num_key_value_heads")
            self.num_kv_head_replicas = 1
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        # Sizes as this layer spans all ranks (KV counted once per replica).
        super().__init__(
            hidden_size,
            [self.q_size * tp_size, self.kv_size * tp_size, self.kv_size * tp_size],
            bias,
            ctx,
            prefix=prefix,
        )

    def _full_part_sizes(self) -> list[tuple[Any, int]]:
        kv = self.total_num_kv_heads * self.head_size
        return [("q", self.total_num_heads * self.head_size), ("k", kv), ("v", kv)]

    def _shard_rows(self, shard_id: Any) -> tuple[int, int, int, int]:
        if shard_id == "q":
            full = self.total_num_heads * self.head_size
            return 0, self.q_size, self.tp_rank * self.q_size, full
        if shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            kv_rank = self.tp_rank // self.num_kv_head_replicas
            full = self.total_num_kv_heads * self.head_size
            return offset, self.kv_size, kv_rank * self.kv_size, full
        raise ValueError(f"{self.prefix}: shard_id {shard_id!r} is not one of q, k, v")


class RowParallelLinear(LinearBase):
    """Input columns split over the TP ranks; the partial products are summed by an
    all-reduce over the TP group (`reduce_results`). `input_is_parallel`: `x` is already
    this rank's `[T, in / n]` (the output of a column-parallel layer); else it is split here.
    The bias is whole on every rank and added once (by rank 0, before the sum)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        ctx: ModelContext,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        prefix: str = "",
    ) -> None:
        super().__init__(input_size, output_size, ctx, prefix)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        what = prefix or type(self).__name__
        in_part = divide(input_size, self.tp_size, f"{what}: input size")
        self._create_weights(in_part, [output_size], bias=False)
        if bias:
            self.bias = nn.Parameter(
                torch.empty(output_size, dtype=self.params_dtype, device=self.device),
                requires_grad=False,
            )
            set_weight_attrs(self.bias, {"weight_loader": self.weight_loader})

    @property
    def splits_input(self) -> bool:
        """Whether `forward` takes this rank's columns of a whole input (so its input cannot
        come quantized: tandem.layers.quantization.input_quant)."""
        return not self.input_is_parallel and self.tp_size > 1

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None
    ) -> None:
        input_dim = getattr(param, "input_dim", None)
        what = self.prefix or type(self).__name__
        if input_dim is not None:
            size = param.data.shape[input_dim]
            check_full_size(loaded_weight, input_dim, size * self.tp_size, what)
            loaded_weight = narrow_weight(loaded_weight, input_dim, self.tp_rank * size, size)
        copy_weight(param.data, loaded_weight, what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and self.tp_size > 1:
            size = self.input_size_per_partition
            x = x.narrow(-1, self.tp_rank * size, size).contiguous()
        bias = self.bias if self.tp_rank == 0 else None
        out = self.quant_method.apply(self, x, bias)
        if self.reduce_results and self.tp_size > 1:
            out = self.tp_group.all_reduce(out)
        return out
