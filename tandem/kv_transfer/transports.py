"""Which transports a worker speaks, and its byte movers for them: `local_transports` (what
torch and the platform allow for a cache) and `worker_movers` (a CUDA IPC mover on CUDA, an
NCCL mover, gloo on CPU, where torch.distributed has the backend). The choice of transport
per pair is `placement.choose_transport`; the worker service wraps the movers in its
sessions (`tandem_services.worker.kv_transports`).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed

from tandem.kv_transfer.base import EngineHandle
from tandem.kv_transfer.mover import KVMover
from tandem.kv_transfer.placement import CUDA_IPC, NCCL, TCP


def local_transports(kv_cache: torch.Tensor) -> list[str]:
    """The transports a worker with `kv_cache` can speak (besides inproc)."""
    names = [TCP]
    dist_ok = torch.distributed.is_available()
    if kv_cache.device.type == "cuda":
        if sys.platform.startswith("linux"):
            names.append(CUDA_IPC)
        if dist_ok and torch.distributed.is_nccl_available():
            names.append(NCCL)
    elif kv_cache.device.type == "cpu" and dist_ok and torch.distributed.is_gloo_available():
        names.append(NCCL)
    return names


def worker_movers(
    kv_cache: torch.Tensor, engine: EngineHandle, worker_id: str = ""
) -> dict[str, KVMover]:
    """The byte movers a worker with `kv_cache` can use, by transport name (TCP has none: its
    bytes travel in the session messages)."""
    movers: dict[str, KVMover] = {}
    names = local_transports(kv_cache)
    if CUDA_IPC in names:
        from tandem.kv_transfer.cuda_ipc import CudaIpcMover

        movers[CUDA_IPC] = CudaIpcMover(kv_cache, engine, worker_id)
    if NCCL in names:
        from tandem.kv_transfer.nccl import NcclMover

        movers[NCCL] = NcclMover(kv_cache, engine, worker_id)
    return movers
