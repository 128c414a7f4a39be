"""Connectors whose bytes bypass gRPC (CUDA IPC, NCCL): a connection once per prefill-decode
pair, then write sessions through the decode worker's Worker service, each for every request
the sender had ready for that decode worker at once (a batch: one step's prefills).

    prefill worker (sender)                          decode worker (receiver)
    ConnectKV(transport, layout) ──────────────────▶ connect(): IPC handle / group rendezvous
      once per decode worker: open the handle, or join the pair's process group
    WriteKV stream, one per batch:
      BEGIN(items: request_id, destination runs) ──▶ per item: the runs must lie in the
                                                     request's reservation, now marked as
                                                     being written; else refused (why)
                                          ◀───────── READY(items: "" or why refused)
      write (CUDA IPC) or send (NCCL) the accepted
      items' runs, then wait for the device, once
      DONE ────────────────────────────────────────▶ (NCCL: wait for the receives)
                                          ◀───────── DONE(items: num_bytes)

Batching: `send_blocks` queues the request on its decode worker's lane; a lane runs at most
`max_sessions` sessions at once (NCCL: one, both ranks must post in the same order). A session
starting takes its share of the queue: the queue split evenly over the lane's sessions not
already writing, but at least `MIN_SHARE` requests (so one step's few prefills stay one
session) and at most `MAX_BATCH`. One request alone is a batch of one; under load, one
session's messages and one device wait serve many requests, and several sessions in flight
let one's copies overlap the others' messages. A BEGIN
without items (request_id and runs at the top) is a session of one request whose refusal ends
the stream.

Invariants. Receiver: the "being written" mark of the reservation is cleared (`end`) only
once no byte of the session can still land in the reserved blocks, so an abort never frees
blocks under a write; and before DONE leaves, so the AddPrefilled that follows finds it
cleared. Sender: the session's stream ends (DONE, an error, a cancellation) only after the
sender's device work for it has finished.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
import torch

from tandem.kv_transfer.base import (
    EngineHandle,
    KVConnector,
    KVDestination,
    KVTransferError,
    block_runs,
    check_fits,
)
from tandem.kv_transfer.tcp import layout_from_proto, layout_to_proto
from tandem_protos.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

BEGIN = worker_pb2.KV_WRITE_PHASE_BEGIN
READY = worker_pb2.KV_WRITE_PHASE_READY
DONE = worker_pb2.KV_WRITE_PHASE_DONE

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
]

# (position in the request's block lists, first destination block id, number of blocks)
Run = tuple[int, int, int]
# (first destination block id, number of blocks), as a receiver sees a run
DstRun = tuple[int, int]

P = TypeVar("P")  # what a sender keeps per decode worker (an opened cache, a process group)
R = TypeVar("R")

Begin = Callable[[str], Awaitable["Sequence[int] | None"]]
End = Callable[[str], None]

# Requests per write session at most.
MAX_BATCH = 32
# Requests a starting session takes at least (when queued), however many sessions are idle.
MIN_SHARE = 4


@dataclass(frozen=True)
class TransferRecord:
    """One finished send: bytes moved; seconds in the data path (writes or sends and the one
    device wait) and in all (with the session's messages)."""

    request_id: str
    num_bytes: int
    data_s: float
    total_s: float
    # Requests in the session that carried it (they share its data path).
    batch_size: int = 1


@dataclass(eq=False)
class _Pending:
    """A request queued on a lane; `started` once a session took it (it may then be written)."""

    request_id: str
    src: list[int]
    runs: list[Run]
    future: asyncio.Future[tuple[int, float, int]]
    started: bool = False


@dataclass(eq=False)
class _Lane:
    """The requests waiting for a decode worker, how many sessions serve it now, and how many of
    those are in a session (the others are about to take from the queue)."""

    queue: deque[_Pending]
    sessions: int = 0
    busy: int = 0

    def share(self) -> int:
        """Requests the session starting now takes."""
        idle = max(1, self.sessions - self.busy)
        return min(MAX_BATCH, max(MIN_SHARE, -(-len(self.queue) // idle)))


def consecutive(ids: Sequence[int]) -> bool:
    return all(ids[i] == ids[0] + i for i in range(1, len(ids)))


def check_runs(runs: Sequence[DstRun], reserved: Sequence[int], request_id: str) -> int:
    """Raise KVTransferError unless every run is non-empty and inside the reservation; returns
    the number of blocks."""
    allowed = set(reserved)
    total = 0
    seen: set[int] = set()
    for first, n in runs:
        blocks = range(first, first + n)
        if n < 1 or any(b not in allowed or b in seen for b in blocks):
            raise KVTransferError(
                f"blocks {first}..{first + n - 1} are not reserved for request {request_id!r}"
            )
        seen.update(blocks)
        total += n
    return total


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


def _fail(items: list[_Pending], exc: BaseException) -> None:
    error = exc if isinstance(exc, Exception) else KVTransferError("the KV write was cancelled")
    for it in items:
        if not it.future.done():
            it.future.set_exception(error)
            it.future.exception()  # retrieved: a caller that left must not log it


async def _next(it: AsyncIterator[worker_pb2.KVWriteMessage]) -> worker_pb2.KVWriteMessage | None:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


class RemoteKVConnector(KVConnector, Generic[P]):
    """The session protocol above; subclasses move the bytes.

    Sender hooks: `_open` (once per decode worker, from its ConnectKV answer), `_write` (a
    session's runs, of one or more requests; returns once the device finished),
    `_group_name`, `_close_peer`.
    Receiver hooks: `_connect_info`, `_begin_receive`, `_end_receive`, `_abandon_receive`.
    `serialize_sessions`: one session at a time per decode worker (NCCL: both ranks must post
    their operations in the same order).
    """

    transport = ""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        engine: EngineHandle,
        worker_id: str = "",
        rpc_timeout_s: float = 30.0,
        serialize_sessions: bool = False,
    ) -> None:
        super().__init__(kv_cache, engine)
        self.worker_id = worker_id
        self.rpc_timeout_s = rpc_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._peers: dict[str, P] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._lanes: dict[str, _Lane] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # Sessions in flight per decode worker: while one waits for its messages, the next
        # can copy. NCCL: one (both ranks post their operations in session order); a
        # subclass may allow more (CUDA IPC: 4).
        self.max_sessions = 1 if serialize_sessions else 2
        self.history: deque[TransferRecord] = deque(maxlen=4096)

    # ------------------------------------------------------------------ sender

    async def send_blocks(
        self, request_id: str, src_block_ids: Sequence[int], dst: KVDestination
    ) -> int:
        check_fits(src_block_ids, dst)
        if not src_block_ids:
            return 0
        t0 = time.perf_counter()
        src = list(src_block_ids)
        dst_ids = list(dst.block_ids[: len(src)])
        await self.peer(dst)  # connect (or fail) before queueing
        item = _Pending(
            request_id,
            src,
            block_runs(dst_ids, max_blocks=len(dst_ids)),
            asyncio.get_running_loop().create_future(),
        )
        lane = self._lanes.setdefault(dst.address, _Lane(deque()))
        lane.queue.append(item)
        if lane.sessions < self.max_sessions:
            lane.sessions += 1
            task = asyncio.get_running_loop().create_task(self._drain(lane, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            num_bytes, data_s, batch = await asyncio.shield(item.future)
        except asyncio.CancelledError:
            if not item.started:
                lane.queue.remove(item)
            else:  # its session may be writing from the held blocks: let that end first
                with contextlib.suppress(BaseException):
                    await item.future
            raise
        self.history.append(
            TransferRecord(request_id, num_bytes, data_s, time.perf_counter() - t0, batch)
        )
        return num_bytes

    async def _drain(self, lane: _Lane, dst: KVDestination) -> None:
        """Run sessions for `lane` while requests are queued."""
        try:
            while lane.queue:
                items: list[_Pending] = []
                share = lane.share()
                while lane.queue and len(items) < share:
                    item = lane.queue.popleft()
                    item.started = True
                    items.append(item)
                lane.busy += 1
                try:
                    await self._run_session(dst, items)
                finally:
                    lane.busy -= 1
        finally:
            lane.sessions -= 1

    async def _run_session(self, dst: KVDestination, items: list[_Pending]) -> None:
        """Connect if need be, then one session for `items`; fails them on an error (raised
        again only when not an Exception, or when connecting failed)."""
        try:
            peer = await self.peer(dst)
        except BaseException as exc:
            _fail(items, exc)
            raise
        try:
            await self._session(peer, dst, items)
        except BaseException as exc:
            # A session that broke may leave the pair out of step: connect again.
            self._forget_peer(dst.address, peer)
            _fail(items, exc)
            if not isinstance(exc, Exception):
                raise

    async def _session(self, peer: P, dst: KVDestination, items: list[_Pending]) -> None:
        """One batched write session; resolves every item's future (or raises)."""
        stub = worker_pb2_grpc.WorkerStub(self._channel(dst.address))
        call = stub.WriteKV()
        try:
            await call.write(
                worker_pb2.KVWriteMessage(
                    phase=BEGIN,
                    transport=self.transport,
                    group_name=self._group_name(peer),
                    items=[
                        worker_pb2.KVWriteItem(
                            request_id=it.request_id,
                            first_block_ids=[first for _, first, _ in it.runs],
                            num_blocks=[n for _, _, n in it.runs],
                        )
                        for it in items
                    ],
                )
            )
            ready = await self._expect(call, READY, dst)
            if [r.request_id for r in ready.items] != [it.request_id for it in items]:
                raise KVTransferError(f"{dst.worker_id} answered READY for other requests")
            accepted: list[_Pending] = []
            for it, answer in zip(items, ready.items, strict=True):
                if answer.error:
                    it.future.set_exception(
                        KVTransferError(
                            f"KV write of {it.request_id!r} to {dst.worker_id} over "
                            f"{self.transport} refused: {answer.error}"
                        )
                    )
                else:
                    accepted.append(it)
            data_s = 0.0
            if accepted:
                src: list[int] = []
                runs: list[Run] = []
                for it in accepted:
                    runs += [(len(src) + pos, first, n) for pos, first, n in it.runs]
                    src += it.src
                t = time.perf_counter()
                await self._write(peer, src, runs)
                data_s = time.perf_counter() - t
            await call.write(worker_pb2.KVWriteMessage(phase=DONE))
            await call.done_writing()
            reply = await self._expect(call, DONE, dst)
            moved = {r.request_id: int(r.num_bytes) for r in reply.items}
            for it in accepted:
                if it.request_id not in moved:
                    raise KVTransferError(f"{dst.worker_id} did not confirm {it.request_id!r}")
                it.future.set_result((moved[it.request_id], data_s, len(items)))
        except grpc.aio.AioRpcError as exc:
            names = ", ".join(repr(it.request_id) for it in items)
            raise KVTransferError(
                f"KV write of {names} to {dst.worker_id} over {self.transport} failed: "
                f"{exc.code().name}: {exc.details()}"
            ) from exc
        finally:
            call.cancel()  # no-op once the call finished

    async def _expect(self, call: Any, phase: int, dst: KVDestination) -> worker_pb2.KVWriteMessage:
        try:
            reply = await asyncio.wait_for(call.read(), self.rpc_timeout_s)
        except TimeoutError:
            raise KVTransferError(
                f"{dst.worker_id} did not answer a KV write within {self.rpc_timeout_s:g}s"
            ) from None
        if reply is grpc.aio.EOF or reply.phase != phase:
            raise KVTransferError(
                f"{dst.worker_id} ended a KV write session out of turn "
                f"(expected {worker_pb2.KVWritePhase.Name(phase)})"
            )
        return reply

    async def peer(self, dst: KVDestination) -> P:
        """This sender's state for `dst`'s decode worker; connects on first use."""
        peer = self._peers.get(dst.address)
        if peer is not None:
            return peer
        lock = self._connecting.setdefault(dst.address, asyncio.Lock())
        async with lock:
            peer = self._peers.get(dst.address)
            if peer is not None:
                return peer
            stub = worker_pb2_grpc.WorkerStub(self._channel(dst.address))
            try:
                info = await stub.ConnectKV(
                    worker_pb2.ConnectKVRequest(
                        transport=self.transport,
                        prefill_worker_id=self.worker_id,
                        layout=layout_to_proto(self.layout),
                    ),
                    timeout=self.rpc_timeout_s,
                )
            except grpc.aio.AioRpcError as exc:
                raise KVTransferError(
                    f"connecting to {dst.worker_id} for KV over {self.transport} failed: "
                    f"{exc.code().name}: {exc.details()}"
                ) from exc
            theirs = layout_from_proto(info.layout)
            if theirs != self.layout:
                raise KVTransferError(
                    f"KV layouts differ: {dst.worker_id} {theirs}, here {self.layout}"
                )
            peer = await self._open(dst, info)
            self._peers[dst.address] = peer
            logger.info("KV to %s (%s) over %s", dst.worker_id, dst.address, self.transport)
            return peer

    def _forget_peer(self, address: str, peer: P) -> None:
        if self._peers.get(address) is peer:
            del self._peers[address]
            self._close_peer(peer)

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for peer in self._peers.values():
            self._close_peer(peer)
        self._peers.clear()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    async def _open(self, dst: KVDestination, info: worker_pb2.ConnectKVResponse) -> P:
        raise NotImplementedError

    async def _write(self, peer: P, src: list[int], runs: list[Run]) -> None:
        raise NotImplementedError

    def _group_name(self, peer: P) -> str:
        return ""

    def _close_peer(self, peer: P) -> None:
        pass

    # ------------------------------------------------------------------ receiver

    async def connect(self, request: worker_pb2.ConnectKVRequest) -> worker_pb2.ConnectKVResponse:
        """Answer a sender's ConnectKV. Raises KVTransferError."""
        if request.transport != self.transport:
            raise KVTransferError(
                f"this is the {self.transport} connector, not {request.transport}"
            )
        theirs = layout_from_proto(request.layout)
        if theirs != self.layout:
            raise KVTransferError(f"KV layouts differ: sender {theirs}, here {self.layout}")
        reply = await self._connect_info(request)
        reply.layout.CopyFrom(layout_to_proto(self.layout))
        return reply

    async def serve_write(
        self, messages: AsyncIterator[worker_pb2.KVWriteMessage], begin: Begin, end: End
    ) -> AsyncIterator[worker_pb2.KVWriteMessage]:
        """One WriteKV session, receiver side: yields READY, then DONE.

        Per request: `await begin(request_id)` marks its reservation as being written and
        returns its block ids (None: no reservation, nothing to end); `end(request_id)` clears
        the mark: called once per marked request, when nothing more can land (at once for a
        refused one), and before DONE is yielded (so the sender's next message, AddPrefilled,
        finds the mark cleared). Close the generator with `contextlib.aclosing`. Raises
        KVTransferError.
        """
        it = messages.__aiter__()
        first = await _next(it)
        if first is None or first.phase != BEGIN:
            raise KVTransferError("a KV write session starts with BEGIN")
        if first.transport != self.transport:
            raise KVTransferError(f"this is the {self.transport} connector, not {first.transport}")
        batched = len(first.items) > 0
        wanted = list(first.items) if batched else [first]
        accepted: list[str] = []
        errors: list[str] = []
        runs: list[DstRun] = []
        num_bytes: dict[str, int] = {}
        ended = False
        receipt: Any = None
        posted = landed = False
        try:
            for item in wanted:
                error = ""
                rid = item.request_id
                if len(item.first_block_ids) != len(item.num_blocks) or not item.num_blocks:
                    error = "BEGIN needs one num_blocks per first_block_id, at least one"
                elif rid in num_bytes:
                    error = f"request {rid!r} appears twice in one session"
                else:
                    reserved = await begin(rid)
                    if reserved is None:
                        error = f"no blocks are reserved for request {rid!r}"
                    else:
                        item_runs = list(zip(item.first_block_ids, item.num_blocks, strict=True))
                        try:
                            n = check_runs(item_runs, reserved, rid)
                        except KVTransferError as exc:
                            end(rid)
                            error = str(exc)
                        else:
                            accepted.append(rid)
                            runs += item_runs
                            num_bytes[rid] = n * self.layout.bytes_per_block
                if error and not batched:
                    raise KVTransferError(error)
                errors.append(error)
            if runs:
                receipt = await self._begin_receive(first, runs)
                posted = True
            if batched:
                yield worker_pb2.KVWriteMessage(
                    phase=READY,
                    items=[
                        worker_pb2.KVWriteItem(request_id=item.request_id, error=error)
                        for item, error in zip(wanted, errors, strict=True)
                    ],
                )
            else:
                yield worker_pb2.KVWriteMessage(phase=READY, request_id=first.request_id)
            msg = await _next(it)
            if msg is None or msg.phase != DONE:
                raise KVTransferError("the sender left a KV write session before DONE")
            if posted:
                await self._end_receive(receipt)
                landed = True
            ended = True
            for rid in accepted:
                end(rid)
            if batched:
                yield worker_pb2.KVWriteMessage(
                    phase=DONE,
                    items=[
                        worker_pb2.KVWriteItem(request_id=rid, num_bytes=num_bytes[rid])
                        for rid in accepted
                    ],
                )
            else:
                rid = first.request_id
                yield worker_pb2.KVWriteMessage(
                    phase=DONE, request_id=rid, num_bytes=num_bytes[rid]
                )
        finally:
            if posted and not landed:
                await self._abandon_receive(receipt)
            if not ended:
                for rid in accepted:
                    end(rid)

    async def _connect_info(
        self, request: worker_pb2.ConnectKVRequest
    ) -> worker_pb2.ConnectKVResponse:
        raise NotImplementedError

    async def _begin_receive(self, first: worker_pb2.KVWriteMessage, runs: list[DstRun]) -> Any:
        """Get ready for the runs (NCCL: post the receives); returns a receipt."""
        return None

    async def _end_receive(self, receipt: Any) -> None:
        """The sender said DONE: return once the bytes are in place."""

    async def _abandon_receive(self, receipt: Any) -> None:
        """The session broke: return once nothing more can land in the runs."""
