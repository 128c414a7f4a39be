"""The KV hand-off session protocol for transports whose bytes bypass gRPC (CUDA IPC, NCCL): a
connection once per prefill-decode pair, then write sessions through the decode worker's
Worker service, each for every request the sender had ready for that decode worker at once (a
batch: one step's prefills). The bytes are moved by a `tandem.kv_transfer.mover.KVMover`
(`CudaIpcMover`, `NcclMover`), which knows no messages; `RemoteKVConnector` here drives it.

    prefill worker (sender)                          decode worker (receiver)
    ConnectKV(transport, layout) ──────────────────▶ connect(): the mover's handshake (an IPC
                                                     handle, a group rendezvous) as a message
      once per decode worker: mover.open(handshake)
        (open the handle, or join the pair's process group)
    WriteKV stream, one session per batch (a stream carries its sessions one after another):
      BEGIN(items: request_id, destination runs) ──▶ the batch's reservations, in one ask of
                                                     the worker's owner: the runs must lie in
                                                     them, now marked as being written; else
                                                     refused (why)
                                          ◀───────── READY(items: "" or why refused)
      mover.write: write (CUDA IPC) or send (NCCL)
      the accepted items' runs, then wait for the
      device, once
      DONE ────────────────────────────────────────▶ mover.end_receive (NCCL: wait for the
                                                     receives)
                                          ◀───────── DONE(items: num_bytes)
      BEGIN (the next session on this stream) ...

Streams: a session slot keeps its WriteKV stream open and runs its next session on it; a
stream left unused is parked per decode worker and taken by the next session starting
(closed after `IDLE_STREAM_S` unused, or when a session on it broke). Opening a gRPC call per
session cost more than the session's two round trips themselves.

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
cleared. Sender: a session ends (its DONE, or its stream's end on an error or a
cancellation) only after the sender's device work for it has finished; nothing is written
before its READY. A session that broke takes its stream with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic

import grpc

from tandem.kv_transfer.base import (
    KVConnector,
    KVDestination,
    KVTransferError,
    block_runs,
    check_fits,
    check_runs,
)
from tandem.kv_transfer.cuda_ipc import CudaIpcHandle
from tandem.kv_transfer.mover import DstRun, KVMover, P, Run
from tandem.kv_transfer.nccl import NcclRendezvous
from tandem_protos.v1 import worker_pb2, worker_pb2_grpc
from tandem_services.common.channels import PLAINTEXT, ChannelPool, TlsConfig
from tandem_services.worker.kv_tcp import layout_from_proto, layout_to_proto

logger = logging.getLogger(__name__)

BEGIN = worker_pb2.KV_WRITE_PHASE_BEGIN
READY = worker_pb2.KV_WRITE_PHASE_READY
DONE = worker_pb2.KV_WRITE_PHASE_DONE

# The receiver's owner, per session: mark the requests' reservations as being written and
# return their block ids (None: no reservation, not marked), in order; clear the marks.
Begin = Callable[[list[str]], Awaitable["list[Sequence[int] | None]"]]
End = Callable[[list[str]], None]

# Requests per write session at most.
MAX_BATCH = 32
# Requests a starting session takes at least (when queued), however many sessions are idle.
MIN_SHARE = 4
# A parked WriteKV stream unused this long is closed.
IDLE_STREAM_S = 2.0


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
    those are in a session (the others are about to take from the queue); its open WriteKV
    streams no session is using, with when each was parked (newest last)."""

    queue: deque[_Pending]
    sessions: int = 0
    busy: int = 0
    idle: list[tuple[Any, float]] = field(default_factory=list)
    expiry: asyncio.TimerHandle | None = None

    def share(self) -> int:
        """Requests the session starting now takes."""
        idle = max(1, self.sessions - self.busy)
        return min(MAX_BATCH, max(MIN_SHARE, -(-len(self.queue) // idle)))


# A mover's handshake type -> the ConnectKVResponse field (of its `info` oneof) carrying it;
# each dataclass's fields are its message's fields, name for name.
_HANDSHAKES: dict[type, str] = {CudaIpcHandle: "cuda_ipc", NcclRendezvous: "nccl"}


def handshake_to_proto(handshake: object | None) -> worker_pb2.ConnectKVResponse:
    """A ConnectKV answer carrying a mover's handshake (no `info` for None)."""
    reply = worker_pb2.ConnectKVResponse()
    if handshake is None:
        return reply
    name = _HANDSHAKES.get(type(handshake))
    if name is None:
        raise TypeError(f"no ConnectKV field carries a {type(handshake).__name__}")
    getattr(reply, name).CopyFrom(
        type(getattr(reply, name))(**dataclasses.asdict(handshake))  # type: ignore[arg-type]
    )
    return reply


def handshake_from_proto(reply: worker_pb2.ConnectKVResponse) -> object | None:
    """The mover's handshake a ConnectKV answer carries (None: none)."""
    which = reply.WhichOneof("info")
    if which is None:
        return None
    cls = next(c for c, name in _HANDSHAKES.items() if name == which)
    msg = getattr(reply, which)
    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(msg, f.name)
        values[f.name] = value if isinstance(value, str | bytes | int | float) else tuple(value)
    return cls(**values)


_DONE = worker_pb2.KVWriteMessage(phase=DONE)


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
    """The session protocol above, driving `mover`, which moves the bytes.

    Sender: `mover.open` (once per decode worker, from its ConnectKV answer), `mover.write` (a
    session's runs, of one or more requests; returns once the device finished),
    `mover.group_name`, `mover.close_peer`. Receiver: `mover.handshake`,
    `mover.begin_receive`, `mover.end_receive`, `mover.abandon_receive`. Sessions in flight per
    decode worker: `mover.max_sessions` (while one waits for its messages, the next can copy;
    NCCL: one, both ranks post their operations in session order; CUDA IPC: 4).
    """

    def __init__(
        self, mover: KVMover[P], rpc_timeout_s: float = 30.0, tls: TlsConfig = PLAINTEXT
    ) -> None:
        super().__init__(mover.cache.kv_cache, mover.engine)
        self.mover = mover
        self.transport = mover.transport
        self.worker_id = mover.worker_id
        self.rpc_timeout_s = rpc_timeout_s
        self._channels = ChannelPool(tls)
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self._closed = False
        self._peers: dict[str, P] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._lanes: dict[str, _Lane] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.history: deque[TransferRecord] = deque(maxlen=4096)

    @property
    def max_sessions(self) -> int:
        """Sessions in flight per decode worker (the mover's)."""
        return self.mover.max_sessions

    # ------------------------------------------------------------------ sender

    async def send_blocks(
        self, request_id: str, src_block_ids: Sequence[int], dst: KVDestination
    ) -> int:
        check_fits(src_block_ids, dst)
        if not src_block_ids:
            return 0
        t0 = time.perf_counter()
        src = list(src_block_ids)
        dst_ids = dst.block_ids[: len(src)]
        if dst.address not in self._peers:
            await self.peer(dst)  # connect (or fail) before queueing
        loop = asyncio.get_running_loop()
        item = _Pending(
            request_id, src, block_runs(dst_ids, max_blocks=len(dst_ids)), loop.create_future()
        )
        lane = self._lanes.get(dst.address)
        if lane is None:
            lane = self._lanes[dst.address] = _Lane(deque())
        lane.queue.append(item)
        if lane.sessions < self.max_sessions:
            lane.sessions += 1
            task = loop.create_task(self._drain(lane, dst))
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
        """Run sessions for `lane` while requests are queued, one after another on one stream;
        park the stream when the queue is empty."""
        call: Any = None
        try:
            while lane.queue:
                items: list[_Pending] = []
                share = lane.share()
                while lane.queue and len(items) < share:
                    item = lane.queue.popleft()
                    item.started = True
                    items.append(item)
                lane.busy += 1
                stream, call = call, None
                try:
                    call = await self._run_session(lane, dst, items, stream)
                finally:
                    lane.busy -= 1
        finally:
            lane.sessions -= 1
            if call is not None:
                self._park(lane, call)

    async def _run_session(
        self, lane: _Lane, dst: KVDestination, items: list[_Pending], call: Any
    ) -> Any:
        """Connect if need be, then one session for `items` on `call` (or on a parked or new
        stream); returns the stream for the next session, None when it broke. Fails the items
        on an error (raised again only when not an Exception)."""
        try:
            peer = self._peers.get(dst.address)
            if peer is None:
                peer = await self.peer(dst)
        except BaseException as exc:
            if call is not None:
                call.cancel()
            _fail(items, exc)
            if not isinstance(exc, Exception):
                raise
            return None
        if call is None:
            call = self._take_stream(lane, dst.address)
        try:
            await self._session(call, peer, dst, items)
        except BaseException as exc:
            call.cancel()
            # A session that broke may leave the pair out of step: connect again.
            self._forget_peer(dst.address, peer)
            self._drop_parked(lane)
            _fail(items, exc)
            if not isinstance(exc, Exception):
                raise
            return None
        return call

    async def _session(self, call: Any, peer: P, dst: KVDestination, items: list[_Pending]) -> None:
        """One batched write session on the open stream `call`; resolves every item's future
        (or raises)."""
        try:
            begin = worker_pb2.KVWriteMessage(
                phase=BEGIN,
                transport=self.transport,
                group_name=self.mover.group_name(peer),
                items=[
                    worker_pb2.KVWriteItem(
                        request_id=it.request_id,
                        first_block_ids=[first for _, first, _ in it.runs],
                        num_blocks=[n for _, _, n in it.runs],
                    )
                    for it in items
                ],
            )
            await call.write(begin)
            ready = await self._expect(call, READY, dst)
            if len(ready.items) != len(items) or any(
                r.request_id != it.request_id for r, it in zip(ready.items, items, strict=True)
            ):
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
                if len(accepted) == 1:
                    src, runs = accepted[0].src, accepted[0].runs
                else:
                    src, runs = [], []
                    for it in accepted:
                        base = len(src)
                        runs += [(base + pos, first, n) for pos, first, n in it.runs]
                        src += it.src
                t = time.perf_counter()
                await self.mover.write(peer, src, runs)
                data_s = time.perf_counter() - t
            await call.write(_DONE)
            reply = await self._expect(call, DONE, dst)
            moved = {r.request_id: r.num_bytes for r in reply.items}
            for it in accepted:
                num_bytes = moved.get(it.request_id)
                if num_bytes is None:
                    raise KVTransferError(f"{dst.worker_id} did not confirm {it.request_id!r}")
                it.future.set_result((num_bytes, data_s, len(items)))
        except grpc.aio.AioRpcError as exc:
            names = ", ".join(repr(it.request_id) for it in items)
            raise KVTransferError(
                f"KV write of {names} to {dst.worker_id} over {self.transport} failed: "
                f"{exc.code().name}: {exc.details()}"
            ) from exc

    async def _expect(self, call: Any, phase: int, dst: KVDestination) -> worker_pb2.KVWriteMessage:
        try:
            async with asyncio.timeout(self.rpc_timeout_s):
                reply = await call.read()
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

    # ------------------------------------------------------------------ streams

    def _take_stream(self, lane: _Lane, address: str) -> Any:
        """A parked stream of `lane` still open (the newest), or a new one."""
        now = time.monotonic()
        while lane.idle:
            call, parked_at = lane.idle.pop()
            if not call.done() and now - parked_at < IDLE_STREAM_S:
                return call
            call.cancel()
        return self._stub(address).WriteKV()

    def _park(self, lane: _Lane, call: Any) -> None:
        if call.done() or self._closed:
            call.cancel()
            return
        lane.idle.append((call, time.monotonic()))
        if lane.expiry is None:
            lane.expiry = asyncio.get_running_loop().call_later(IDLE_STREAM_S, self._expire, lane)

    def _expire(self, lane: _Lane) -> None:
        """Close the streams of `lane` parked for `IDLE_STREAM_S` or longer."""
        lane.expiry = None
        now = time.monotonic()
        keep = []
        for call, parked_at in lane.idle:
            if now - parked_at >= IDLE_STREAM_S or call.done():
                call.cancel()
            else:
                keep.append((call, parked_at))
        lane.idle = keep
        if keep:
            wait = max(0.0, keep[0][1] + IDLE_STREAM_S - now)
            lane.expiry = asyncio.get_running_loop().call_later(wait, self._expire, lane)

    def _drop_parked(self, lane: _Lane) -> None:
        for call, _ in lane.idle:
            call.cancel()
        lane.idle.clear()

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
            try:
                info = await self._stub(dst.address).ConnectKV(
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
            peer = await self.mover.open(dst, handshake_from_proto(info))
            self._peers[dst.address] = peer
            logger.info("KV to %s (%s) over %s", dst.worker_id, dst.address, self.transport)
            return peer

    def _forget_peer(self, address: str, peer: P) -> None:
        if self._peers.get(address) is peer:
            del self._peers[address]
            self.mover.close_peer(peer)

    def _channel(self, address: str) -> grpc.aio.Channel:
        return self._channels.get(address)

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            stub = self._stubs[address] = worker_pb2_grpc.WorkerStub(self._channel(address))
        return stub

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for lane in self._lanes.values():
            if lane.expiry is not None:
                lane.expiry.cancel()
                lane.expiry = None
            self._drop_parked(lane)
        self._stubs.clear()
        for peer in self._peers.values():
            self.mover.close_peer(peer)
        self._peers.clear()
        await self._channels.close()
        await self.mover.close()

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
        reply = handshake_to_proto(await self.mover.handshake(request.prefill_worker_id))
        reply.layout.CopyFrom(layout_to_proto(self.layout))
        return reply

    async def serve_write(
        self,
        messages: AsyncIterator[worker_pb2.KVWriteMessage],
        begin: Begin,
        end: End,
        first: worker_pb2.KVWriteMessage | None = None,
    ) -> AsyncIterator[worker_pb2.KVWriteMessage]:
        """One WriteKV stream, receiver side: per session, yields READY, then DONE; returns when
        the sender closes the stream between sessions. `first`: the stream's first message,
        when the caller already read it.

        Per session: `await begin(request_ids)` marks the reservations of the requests (in one
        call for the session) as being written and returns their block ids (None: no
        reservation, nothing to end); `end(request_ids)` clears the marks: called once per
        marked request, when nothing more can land (at once for a refused one), and before
        DONE is yielded (so the sender's next message, AddPrefilled, finds the mark cleared).
        Close the generator with `contextlib.aclosing`. Raises KVTransferError.
        """
        it = messages.__aiter__()
        msg = first if first is not None else await _next(it)
        if msg is None:
            raise KVTransferError("a KV write session starts with BEGIN")
        bytes_per_block = self.layout.bytes_per_block
        while msg is not None:
            if msg.phase != BEGIN:
                raise KVTransferError("a KV write session starts with BEGIN")
            if msg.transport != self.transport:
                raise KVTransferError(
                    f"this is the {self.transport} connector, not {msg.transport}"
                )
            batched = len(msg.items) > 0
            wanted = msg.items if batched else [msg]
            errors = [""] * len(wanted)
            # Items to look up: (position in `wanted`, request id), each id once.
            lookup: list[tuple[int, str]] = []
            seen: set[str] = set()
            for i, item in enumerate(wanted):
                rid = item.request_id
                if len(item.first_block_ids) != len(item.num_blocks) or not item.num_blocks:
                    errors[i] = "BEGIN needs one num_blocks per first_block_id, at least one"
                elif rid in seen:
                    errors[i] = f"request {rid!r} appears twice in one session"
                else:
                    seen.add(rid)
                    lookup.append((i, rid))
            accepted: list[str] = []
            runs: list[DstRun] = []
            num_bytes: list[int] = []
            ended = False
            receipt: Any = None
            posted = landed = False
            try:
                reservations = await begin([rid for _, rid in lookup]) if lookup else []
                refused: list[str] = []
                for (i, rid), reserved in zip(lookup, reservations, strict=True):
                    if reserved is None:
                        errors[i] = f"no blocks are reserved for request {rid!r}"
                        continue
                    item = wanted[i]
                    item_runs = list(zip(item.first_block_ids, item.num_blocks, strict=True))
                    try:
                        n = check_runs(item_runs, reserved, rid)
                    except KVTransferError as exc:
                        refused.append(rid)
                        errors[i] = str(exc)
                    else:
                        accepted.append(rid)
                        runs += item_runs
                        num_bytes.append(n * bytes_per_block)
                if refused:
                    end(refused)
                if not batched and errors[0]:
                    raise KVTransferError(errors[0])
                if runs:
                    receipt = await self.mover.begin_receive(msg.group_name, runs)
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
                    yield worker_pb2.KVWriteMessage(phase=READY, request_id=msg.request_id)
                done = await _next(it)
                if done is None or done.phase != DONE:
                    raise KVTransferError("the sender left a KV write session before DONE")
                if posted:
                    await self.mover.end_receive(receipt)
                    landed = True
                ended = True
                if accepted:
                    end(accepted)
                if batched:
                    yield worker_pb2.KVWriteMessage(
                        phase=DONE,
                        items=[
                            worker_pb2.KVWriteItem(request_id=rid, num_bytes=n)
                            for rid, n in zip(accepted, num_bytes, strict=True)
                        ],
                    )
                else:
                    yield worker_pb2.KVWriteMessage(
                        phase=DONE, request_id=msg.request_id, num_bytes=num_bytes[0]
                    )
            finally:
                if posted and not landed:
                    await self.mover.abandon_receive(receipt)
                if not ended and accepted:
                    end(accepted)
            msg = await _next(it)
