"""The scheduler's record of one registered worker (`WorkerEntry`): its registration, its last
load report, the requests it holds, and what a reservation there takes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from tandem.core.kv_cache_spec import KVCacheSpec
from tandem.kv_transfer.placement import WorkerPlacement
from tandem_protos.v1 import common_pb2, scheduler_pb2, worker_pb2_grpc


def worker_kv_cache_spec(info: scheduler_pb2.RegisterWorkerRequest) -> KVCacheSpec:
    """The KV cache groups a worker registered (`kv_cache_group_windows`; none: one
    full-attention group, a worker from before hybrid caches)."""
    block_size = info.block_size or 16
    windows = [w or None for w in info.kv_cache_group_windows]
    if not windows:
        return KVCacheSpec.full(block_size, 1)
    return KVCacheSpec.from_group_windows(block_size, windows)


@dataclass
class WorkerEntry:
    info: scheduler_pb2.RegisterWorkerRequest
    generation: int
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    stats: common_pb2.WorkerStats
    last_report: float
    draining: bool = False
    # Decode Reserve said the pool is short: no more reservations until the next report.
    full: bool = False
    reserved_since_report: int = 0
    inflight: set[str] = field(default_factory=set)
    # Set when it is dropped: RPCs still waiting on it are moot (it is gone).
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    # Its KV cache groups as it registered them: what a reservation there takes.
    kv_cache_spec: KVCacheSpec = field(init=False)

    def __post_init__(self) -> None:
        self.kv_cache_spec = worker_kv_cache_spec(self.info)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def placement(self) -> WorkerPlacement:
        """Where its KV cache lives and which transports it speaks (kv_transfer/placement.py)."""
        info = self.info
        return WorkerPlacement(
            info.host_id, info.process_id, info.kv_device or "cpu", tuple(info.kv_transports)
        )

    def to_info(self) -> scheduler_pb2.WorkerInfo:
        return scheduler_pb2.WorkerInfo(
            worker_id=self.info.worker_id,
            address=self.info.address,
            role=self.info.role,
            model=self.info.model,
            max_model_len=self.info.max_model_len,
            stats=self.stats,
            draining=self.draining,
        )
