"""Joining an engine's ranks: the c10d rendezvous and this rank's groups.

Every rank of an engine meets at one c10d `TCPStore` (`master_addr:master_port`, served by
the engine's process), so ranks may sit on different hosts. Then each rank joins the world
group (NCCL on GPUs, gloo on the CPU) and every TP and PP group, all ranks creating every
group in the same order (torch.distributed requires it). On GPUs each group also has a gloo
twin for objects and barriers::

    store (engine process) <── rank 0 .. rank W-1:  init_process_group(backend, store)
                                                    new_group(tp group i), i = 0..P-1
                                                    new_group(pp group j), j = 0..T-1

Nothing here reads the environment; `NCCL_NVLS_ENABLE=0` is set by whoever starts the
process (the executor's rank processes set it before torch is imported).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch

from tandem.distributed.parallel_state import GroupCoordinator, ParallelState, rank_layout

# The store keys the executor and its ranks share (under one prefix per engine).
STORE_PREFIX = "tandem"


@dataclass(frozen=True)
class DistributedInit:
    """Where and as whom one rank joins its engine's groups."""

    master_addr: str
    master_port: int
    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.tp_size * self.pp_size != self.world_size:
            raise ValueError(
                f"tp {self.tp_size} x pp {self.pp_size} != world size {self.world_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside [0, {self.world_size})")


def connect_store(addr: str, port: int, timeout_s: float) -> torch.distributed.Store:
    """A client of the engine's rendezvous store, under the engine's key prefix."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(addr, port, None, False, timeout=timeout)
    return dist.PrefixStore(STORE_PREFIX, store)


def init_parallel_state(init: DistributedInit, device: torch.device) -> ParallelState:
    """Join the world and this rank's TP and PP groups (see the module docstring). `device`
    is this rank's, already current."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=init.timeout_s)
    store = connect_store(init.master_addr, init.master_port, init.timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=store, rank=init.rank, world_size=init.world_size, timeout=timeout
    )
    world_ranks = list(range(init.world_size))

    def groups(ranks: list[int]) -> tuple[object, object]:
        # Every rank calls this for every group, in the same order.
        device_group = dist.new_group(ranks, backend=backend, timeout=timeout)
        if backend == "gloo":
            return device_group, device_group
        return device_group, dist.new_group(ranks, backend="gloo", timeout=timeout)

    def coordinator(ranks: list[int], made: tuple[object, object]) -> GroupCoordinator:
        return GroupCoordinator(ranks, init.rank, device, made[0], made[1])

    world = coordinator(world_ranks, groups(world_ranks))
    tp_groups, pp_groups = rank_layout(init.tp_size, init.pp_size)
    tp = pp = None
    for ranks in tp_groups:
        made = groups(ranks)
        if init.rank in ranks:
            tp = coordinator(ranks, made)
    for ranks in pp_groups:
        made = groups(ranks)
        if init.rank in ranks:
            pp = coordinator(ranks, made)
    assert tp is not None and pp is not None
    return ParallelState(world=world, tp=tp, pp=pp, ep=tp)


def destroy_parallel_state() -> None:
    """Leave the process groups (idempotent)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
