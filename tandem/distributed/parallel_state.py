"""Ranks, groups and the collectives a model and an executor use.

Ranks are ordered as vLLM orders them: the global rank is `pp_rank * tp_size + tp_rank`, so a
TP group is a run of consecutive ranks and a PP group takes one rank of each TP group:

    tp=2, pp=2:   global ranks   TP groups      PP groups
                  pp0: 0 1       [0, 1]          [0, 2]
                  pp1: 2 3       [2, 3]          [1, 3]

The expert-parallel group is the TP group (experts are spread over the ranks that would
otherwise split each expert's matrices).

`GroupCoordinator` is one group seen from one rank: its global ranks, this rank's index in
it, and the collectives over its device group (NCCL on GPUs, gloo on the CPU) and its CPU group
(gloo: objects, barriers). A group of one rank needs no torch.distributed at all: every
collective is the identity, so one-rank engines never initialise a process group.
Sources and destinations (`src`, `dst`) are ranks *in the group*.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


def _nothing() -> None:
    """The wait of a collective that had nothing to do (a group of one)."""


def rank_layout(tp_size: int, pp_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """`(tp_groups, pp_groups)`: the global ranks of every TP group and every PP group."""
    tp_groups = [[pp * tp_size + tp for tp in range(tp_size)] for pp in range(pp_size)]
    pp_groups = [[pp * tp_size + tp for pp in range(pp_size)] for tp in range(tp_size)]
    return tp_groups, pp_groups


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """`[start, end)` of the layers stage `pp_rank` of `pp_size` holds: an even split, the
    first `num_layers % pp_size` stages one layer more."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} outside [0, {pp_size})")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


class GroupCoordinator:
    """One process group from this rank (see the module docstring)."""

    def __init__(
        self,
        ranks: Sequence[int],
        global_rank: int,
        device: torch.device,
        device_group: Any = None,
        cpu_group: Any = None,
    ) -> None:
        self.ranks = list(ranks)
        if global_rank not in self.ranks:
            raise ValueError(f"rank {global_rank} is not in group {self.ranks}")
        self.global_rank = global_rank
        self.rank_in_group = self.ranks.index(global_rank)
        self.world_size = len(self.ranks)
        self.device = device
        self.device_group = device_group
        self.cpu_group = cpu_group
        if self.world_size > 1 and (device_group is None or cpu_group is None):
            raise ValueError("a group of several ranks needs its device and CPU process groups")

    # ----------------------------------------------------------------- positions

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """The next rank in the group (ring order), as a rank in the group."""
        return (self.rank_in_group + 1) % self.world_size

    @property
    def prev_rank(self) -> int:
        return (self.rank_in_group - 1) % self.world_size

    def _global(self, rank_in_group: int) -> int:
        return self.ranks[rank_in_group]

    # ----------------------------------------------------------------- collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group, in place on `x` (returned). Capturable in CUDA graphs."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        dim = dim % x.dim()
        # Flat along dim 0 (gloo checks the output is world_size inputs stacked on dim 0).
        flat = torch.empty(
            (self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device
        )
        dist.all_gather_into_tensor(flat, x.contiguous(), group=self.device_group)
        out = flat.view(self.world_size, *x.shape)
        return out.movedim(0, dim).reshape(
            *x.shape[:dim], self.world_size * x.shape[dim], *x.shape[dim + 1 :]
        )

    def gather(self, x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Every rank's `x` concatenated along `dim` on rank `dst`; None elsewhere."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        dim = dim % x.dim()
        x = x.contiguous()
        if self.device_group is not None and x.device.type == "cuda":
            # NCCL has no gather: all-gather and keep it on dst only.
            full = self.all_gather(x, dim)
            return full if self.rank_in_group == dst else None
        parts = (
            [torch.empty_like(x) for _ in range(self.world_size)]
            if (self.rank_in_group == dst)
            else None
        )
        dist.gather(x, parts, dst=self._global(dst), group=self.device_group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`x` of rank `src` on every rank, in place (returned)."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        dist.broadcast(x, src=self._global(src), group=self.device_group)
        return x

    def broadcast_async(self, x: torch.Tensor, src: int = 0) -> Callable[[], None]:
        """`broadcast` posted without waiting: `x` holds rank `src`'s values once the returned
        call has returned. Collectives of the group run in the order they were posted."""
        if self.world_size == 1:
            return _nothing
        import torch.distributed as dist

        work = dist.broadcast(x, src=self._global(src), group=self.device_group, async_op=True)
        assert work is not None
        return work.wait

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """A picklable object of rank `src` on every rank (over the CPU group)."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank_in_group == src else None]
        dist.broadcast_object_list(box, src=self._global(src), group=self.cpu_group)
        return box[0]

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Send `x` to rank `dst` of the group (its shape and dtype are known there)."""
        import torch.distributed as dist

        dist.send(x.contiguous(), dst=self._global(dst), group=self.device_group)

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int) -> torch.Tensor:
        """A tensor of `shape` and `dtype` sent by rank `src` of the group."""
        import torch.distributed as dist

        out = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        dist.recv(out, src=self._global(src), group=self.device_group)
        return out

    def send_object(self, obj: Any, dst: int) -> None:
        """A picklable object to rank `dst` (over the CPU group)."""
        import torch.distributed as dist

        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        dist.send(size, dst=self._global(dst), group=self.cpu_group)
        dist.send(data, dst=self._global(dst), group=self.cpu_group)

    def recv_object(self, src: int) -> Any:
        import torch.distributed as dist

        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=self._global(src), group=self.cpu_group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, src=self._global(src), group=self.cpu_group)
        return pickle.loads(data.numpy().tobytes())

    def all_to_all(
        self,
        x: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Rows of `x` split along dim 0 (`input_split_sizes`, else evenly) and sent to the
        ranks in order; returns the rows received, concatenated in rank order
        (`output_split_sizes` rows from each, else evenly)."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        if output_split_sizes is None:
            out = torch.empty_like(x)
        else:
            out = torch.empty(
                (sum(output_split_sizes), *x.shape[1:]), dtype=x.dtype, device=x.device
            )
        dist.all_to_all_single(
            out,
            x,
            output_split_sizes=list(output_split_sizes) if output_split_sizes else None,
            input_split_sizes=list(input_split_sizes) if input_split_sizes else None,
            group=self.device_group,
        )
        return out

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        import torch.distributed as dist

        dist.barrier(group=self.cpu_group)


@dataclass(frozen=True)
class ParallelState:
    """This rank's groups. `world` spans every rank of the engine."""

    world: GroupCoordinator
    tp: GroupCoordinator
    pp: GroupCoordinator
    ep: GroupCoordinator

    @property
    def rank(self) -> int:
        return self.world.global_rank

    @property
    def tp_rank(self) -> int:
        return self.tp.rank_in_group

    @property
    def tp_size(self) -> int:
        return self.tp.world_size

    @property
    def pp_rank(self) -> int:
        return self.pp.rank_in_group

    @property
    def pp_size(self) -> int:
        return self.pp.world_size

    @property
    def is_driver(self) -> bool:
        """The rank whose sampled ids the engine reads: the last stage's first TP rank."""
        return self.pp.is_last_rank and self.tp.is_first_rank


def single_rank_state(device: torch.device) -> ParallelState:
    """The groups of a one-rank engine: every collective is the identity."""
    group = GroupCoordinator([0], 0, torch.device(device))
    return ParallelState(world=group, tp=group, pp=group, ep=group)
