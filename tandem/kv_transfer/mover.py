"""The byte movers under the KV hand-off sessions: what CUDA IPC and NCCL do with the bytes,
with no messages. The session protocol that drives them (ConnectKV, WriteKV: BEGIN / READY /
DONE, lanes, stream reuse) lives in the worker service (`tandem_services.worker.kv_sessions`);
this package knows no gRPC and no protos.

    decode worker (receiver)                     prefill worker (sender)
    handshake(prefill_worker_id) -> handshake ─▶ open(dst, handshake) -> peer   once per pair
    per session:
      begin_receive(group_name, runs) -> receipt  (after the runs were checked)
                                                 write(peer, src, runs)   returns once the
                                                                          device finished
      end_receive(receipt)      (the sender said it is done: the bytes are in place)
      abandon_receive(receipt)  (the session broke: nothing more can land)

A handshake is a small frozen dataclass of the mover's own (`cuda_ipc.CudaIpcHandle`,
`nccl.NcclRendezvous`); the session layer carries it in its messages. Invariants a mover
keeps: `write` returns (or raises, or is cancelled) only after its device work for the session
ended; `end_receive` and `abandon_receive` return only once no byte of the session can still
land in the destination blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch

from tandem.kv_transfer.base import EngineHandle, KVCacheView, KVDestination

# (position in the request's block lists, first destination block id, number of blocks)
Run = tuple[int, int, int]
# (first destination block id, number of blocks), as a receiver sees a run
DstRun = tuple[int, int]

P = TypeVar("P")  # what a sender keeps per decode worker (an opened cache, a process group)
R = TypeVar("R")


def consecutive(ids: Sequence[int]) -> bool:
    return all(ids[i] == ids[0] + i for i in range(1, len(ids)))


async def run_to_end(executor: concurrent.futures.Executor, fn: Callable[..., R], *args: Any) -> R:
    """`fn(*args)` on `executor`. If the awaiting task is cancelled meanwhile, wait for `fn` to
    finish anyway (its device work must end before anyone can learn that the session ended),
    then let the cancellation through."""
    future = executor.submit(fn, *args)
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            future.result()
        raise


class KVMover(Generic[P]):
    """Moves the bytes of write sessions between two workers' KV caches (see the module
    docstring). `transport`: its name ("cuda_ipc", "nccl"); `max_sessions`: sessions in flight
    per decode worker (NCCL: one, both ranks post their operations in session order; while one
    session waits for its messages, the next can copy).

    Sender: `open`, `write`, `group_name`, `close_peer`. Receiver: `handshake`,
    `begin_receive`, `end_receive`, `abandon_receive`. Raises KVTransferError.
    """

    transport = ""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        engine: EngineHandle,
        worker_id: str = "",
        max_sessions: int = 2,
    ) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.cache = KVCacheView(kv_cache)
        self.layout = self.cache.layout
        self.engine = engine
        self.worker_id = worker_id
        self.max_sessions = max_sessions

    # ------------------------------------------------------------------ receiver

    async def handshake(self, prefill_worker_id: str) -> object | None:
        """What the sender `prefill_worker_id` needs to open this cache (None: nothing)."""
        raise NotImplementedError

    async def begin_receive(self, group_name: str, runs: list[DstRun]) -> Any:
        """Get ready for the runs (NCCL: post the receives); returns a receipt."""
        return None

    async def end_receive(self, receipt: Any) -> None:
        """The sender said DONE: return once the bytes are in place."""

    async def abandon_receive(self, receipt: Any) -> None:
        """The session broke: return once nothing more can land in the runs."""

    # ------------------------------------------------------------------ sender

    async def open(self, dst: KVDestination, handshake: object | None) -> P:
        """This sender's state for `dst`'s decode worker, from its handshake."""
        raise NotImplementedError

    async def write(self, peer: P, src: list[int], runs: list[Run]) -> None:
        """Move blocks `src` (this cache's) into `runs` of the peer's cache, in order; returns
        once the device finished."""
        raise NotImplementedError

    def group_name(self, peer: P) -> str:
        """The pair's name the receiver knows it by ("" where there is none)."""
        return ""

    def close_peer(self, peer: P) -> None:
        """Let go of a peer (closed, or out of step after a broken session)."""

    async def close(self) -> None:
        """Release this mover's threads and pairs (after its sessions ended)."""
