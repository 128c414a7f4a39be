"""A worker's request state and its one owner, `EngineHost`.

The engine runs in its own process (an EngineCoreProc behind an AsyncMPClient); everything
else a worker knows of its requests (where outputs go, what phase a hand-off is in, which
blocks are reserved) belongs to `EngineHost`, which handles one message at a time on the event
loop.

Named for its place: it is the worker service's side of one engine, the host that takes the
engine's step outputs to their destinations and keeps the requests' service state around
them. It is not an engine core (`EngineCore`, `EngineCoreProc` and `tandem/core/` keep that
word) nor the engine's device `Worker` (`tandem.worker.worker`). The worker service's own
classes keep "Worker" only qualified: `WorkerServicer` (after the `tandem.v1.Worker` proto
service), `WorkerServiceConfig`, `WorkerRole`, and `WorkerRequest` (a request as this service
tracks it, beside the engine's `EngineCoreRequest`).

Request phases by role::

    unified:  running ──────────────────────────────────────────────▶ (finished)
    prefill:  running ─ step: first token ─▶ handing_off ─ sent + AddPrefilled ─▶ (done)
                        (or finished at the first token: eos, max_tokens=1)
    decode:   reserving ─▶ reserved ─▶ receiving ─▶ reserved ─ AddPrefilled ─▶ decoding ─▶ ...

What a request's role changes (its step outputs, the prefill hand-off, what an abort also
does) is decided by the worker's role object (`tandem_services/worker/roles.py`), which the host
asks; the host itself keeps the phases, the destinations and the abort protocol.

Blocks whose bytes are being moved are never freed under the transfer: an abort during
`handing_off` (prefill) or `receiving` (decode) is deferred until the transfer ends.

Outputs: one `StepOutputs` per destination per engine step, put on that destination's queue;
its `StreamOutputs` call drains the queue. A request's output indices start at 0 on the
worker that samples its first token, at 1 on the decode worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from tandem.core.kv_cache_spec import KVCacheSpec
from tandem.core.outputs import EngineCoreOutput
from tandem.engine.core_client import AsyncMPClient
from tandem.engine.ops import EngineOps
from tandem.kv_transfer.base import KVConnector
from tandem_protos.v1 import common_pb2, worker_pb2
from tandem_services.common.actor import Actor, Ask
from tandem_services.common.server import PLAINTEXT, ChannelPool, TlsConfig
from tandem_services.worker.states import TRANSFERRING, Phase, Role, move

if TYPE_CHECKING:
    from tandem_services.worker.roles import WorkerRole

logger = logging.getLogger(__name__)

_ABORT = common_pb2.FINISH_REASON_ABORT


@dataclass
class WorkerRequest:
    request_id: str
    destination: str
    kind: Role
    phase: Phase
    num_prompt_tokens: int
    max_tokens: int | None = None
    # Next output index to send.
    num_emitted: int = 0
    # Prefill side.
    handoff: worker_pb2.KVHandoff | None = None
    first_token_id: int = -1
    # Decode side.
    reserved_block_ids: list[int] = field(default_factory=list)
    aborted: bool = False
    # False from Track until the engine has the request (`Admitted`): an abort in between
    # waits for it, so that the engine's abort is queued after the add, never before.
    admitted: bool = True


# ----------------------------------------------------------------------------- messages


@dataclass
class Track(Ask[bool]):
    """A request enters this worker (before it is added to the engine). False: id in use."""

    request: WorkerRequest


@dataclass
class Untrack:
    """Adding the request to the engine failed: forget it."""

    request_id: str


@dataclass
class Admitted:
    """The engine has run the add of a request tracked with `admitted=False`."""

    request_id: str


@dataclass
class Reserved:
    """The engine reserved blocks for a request's KV hand-off: those the hand-off writes
    (`KVCacheSpec.handoff_indices` of the tables), or None when the pool was short."""

    request_id: str
    block_ids: list[int] | None


@dataclass
class Step:
    outputs: list[EngineCoreOutput]
    # Prefill: request id -> held block ids of requests that finished their prefill.
    held: dict[str, list[int]] | None = None


@dataclass
class BeginReceive(Ask["list[list[int] | None]"]):
    """Mark the reservations of `request_ids` (one write session's, or one TCP stream's
    request) as being written; answers their block ids in order (None: not reserved here, or
    aborted, or already being written: not marked)."""

    request_ids: list[str]


@dataclass
class EndReceive:
    """Clear the marks of `request_ids`: nothing more can land in their blocks."""

    request_ids: list[str]


@dataclass
class BeginAddPrefilled(Ask[bool]):
    request_id: str


@dataclass
class HandoffDone:
    request_id: str
    error: str = ""


@dataclass
class Abort(Ask[int]):
    request_ids: list[str]
    # Tell destinations (the frontend) the request ended, with this error.
    notify_error: str = ""


@dataclass
class Connect(Ask["asyncio.Queue[worker_pb2.StepOutputs | None]"]):
    destination: str


@dataclass
class Disconnect:
    destination: str
    queue: asyncio.Queue[worker_pb2.StepOutputs | None]


@dataclass
class TakeFinished(Ask["tuple[list[str], int]"]):
    """Request ids that left since the last call, and how many are in flight."""


@dataclass
class Inflight(Ask["list[str]"]):
    """The ids of every request this worker is responsible for."""


@dataclass
class HasPendingOutputs(Ask[bool]):
    """Whether a connected destination still has outputs to send."""


@dataclass
class Tick:
    pass


@dataclass
class SetDraining(Ask[None]):
    pass


@dataclass
class CloseStreams(Ask[None]):
    pass


WorkerMessage = (
    Track
    | Untrack
    | Admitted
    | Reserved
    | Step
    | BeginReceive
    | EndReceive
    | BeginAddPrefilled
    | HandoffDone
    | Abort
    | Connect
    | Disconnect
    | TakeFinished
    | Inflight
    | HasPendingOutputs
    | Tick
    | SetDraining
    | CloseStreams
)


@dataclass
class _Destination:
    queue: asyncio.Queue[worker_pb2.StepOutputs | None] = field(default_factory=asyncio.Queue)
    connected: bool = False
    disconnected_since: float = field(default_factory=time.monotonic)


class EngineHost(Actor[WorkerMessage]):
    """Owns the worker's requests, output destinations and hand-offs.

    What differs by role (a step's output, what an abort also does, the hand-off) is asked of
    `role`; the methods it calls back (`finish`, `emit`, `spawn`, `channel`) run on the host's
    event loop, inside its message handling."""

    def __init__(
        self,
        worker_id: str,
        engine: AsyncMPClient,
        block_size: int,
        max_model_len: int,
        destination_timeout_s: float,
        rpc_timeout_s: float,
        role: WorkerRole,
        tls: TlsConfig = PLAINTEXT,
        kv_cache_spec: KVCacheSpec | None = None,
    ) -> None:
        super().__init__(f"engine-host-{worker_id}")
        self.worker_id = worker_id
        self.role = role
        self.engine = engine
        self.block_size = block_size
        # The engine's KV cache groups: which block-table entries a hand-off moves.
        self.kv_cache_spec = kv_cache_spec or KVCacheSpec.full(block_size, 1)
        self.max_model_len = max_model_len
        self.destination_timeout_s = destination_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self.connector: KVConnector | None = None
        self.requests: dict[str, WorkerRequest] = {}
        self.destinations: dict[str, _Destination] = {}
        self.finished: list[str] = []
        self.draining = False
        self._channels = ChannelPool(tls)
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ dispatch

    def handle(self, msg: WorkerMessage) -> None:
        match msg:
            case Track():
                if msg.request.request_id in self.requests:
                    msg.answer(False)
                else:
                    self.requests[msg.request.request_id] = msg.request
                    self._destination(msg.request.destination)
                    msg.answer(True)
            case Untrack():
                self.requests.pop(msg.request_id, None)
            case Admitted():
                self._on_admitted(msg)
            case Reserved():
                self._on_reserved(msg)
            case Step():
                self._on_step(msg)
            case BeginReceive():
                msg.answer([self._begin_receive(rid) for rid in msg.request_ids])
            case EndReceive():
                self._end_receive(msg.request_ids)
            case BeginAddPrefilled():
                r = self.requests.get(msg.request_id)
                ok = r is not None and r.phase == Phase.RESERVED and not r.aborted
                if ok:
                    assert r is not None
                    move(r, Phase.DECODING)
                msg.answer(ok)
            case HandoffDone():
                self.role.on_handoff_done(self, msg)
            case Abort():
                msg.answer(self._abort(msg.request_ids, msg.notify_error))
            case Connect():
                msg.answer(self._connect(msg.destination))
            case Disconnect():
                dest = self.destinations.get(msg.destination)
                if dest is not None and dest.queue is msg.queue:
                    dest.connected = False
                    dest.disconnected_since = time.monotonic()
            case TakeFinished():
                finished, self.finished = self.finished, []
                msg.answer((finished, len(self.requests)))
            case Inflight():
                msg.answer(list(self.requests))
            case HasPendingOutputs():
                msg.answer(
                    any(d.connected and not d.queue.empty() for d in self.destinations.values())
                )
            case Tick():
                self._on_tick()
            case SetDraining():
                self.draining = True
                msg.answer(None)
            case CloseStreams():
                for dest in self.destinations.values():
                    dest.queue.put_nowait(None)
                msg.answer(None)

    # ------------------------------------------------------------------ outputs

    def _destination(self, name: str) -> _Destination:
        dest = self.destinations.get(name)
        if dest is None:
            dest = self.destinations[name] = _Destination()
        return dest

    def _connect(self, name: str) -> asyncio.Queue[worker_pb2.StepOutputs | None]:
        dest = self._destination(name)
        if dest.connected:
            # A newer stream replaces the old one: end the old, move pending outputs over.
            old = dest.queue
            dest.queue = asyncio.Queue()
            while not old.empty():
                item = old.get_nowait()
                if item is not None:
                    dest.queue.put_nowait(item)
            old.put_nowait(None)
        dest.connected = True
        return dest.queue

    def emit(self, batches: dict[str, list[worker_pb2.RequestOutput]]) -> None:
        """Put one `StepOutputs` per destination on that destination's queue."""
        for name, outs in batches.items():
            self._destination(name).queue.put_nowait(worker_pb2.StepOutputs(outputs=outs))

    def _on_step(self, msg: Step) -> None:
        batches: dict[str, list[worker_pb2.RequestOutput]] = defaultdict(list)
        held = msg.held or {}
        for out in msg.outputs:
            r = self.requests.get(out.request_id)
            if r is None or r.aborted:
                continue
            self.role.on_output(self, r, out, held, batches)
        self.emit(batches)

    # ------------------------------------------------------------------ decode side

    def _begin_receive(self, request_id: str) -> list[int] | None:
        r = self.requests.get(request_id)
        if r is None or r.kind != Role.DECODE or r.phase != Phase.RESERVED or r.aborted:
            return None
        move(r, Phase.RECEIVING)
        return r.reserved_block_ids

    def _end_receive(self, request_ids: list[str]) -> None:
        aborted: list[str] = []
        for rid in request_ids:
            r = self.requests.get(rid)
            if r is not None and r.phase == Phase.RECEIVING:
                move(r, Phase.RESERVED)
                if r.aborted:
                    self.finish(r)
                    aborted.append(rid)
        if aborted:
            self.engine.tell(EngineOps.abort_requests, aborted)

    def _on_reserved(self, msg: Reserved) -> None:
        r = self.requests.get(msg.request_id)
        if r is None:
            return
        if msg.block_ids is None:
            del self.requests[msg.request_id]
            return
        r.reserved_block_ids = msg.block_ids
        move(r, Phase.RESERVED)
        if r.aborted:
            # Aborted while reserving. The abort queued then may have run before the reserve
            # (it can overtake the servicer between Track and the engine call): again, now.
            self.engine.tell(EngineOps.abort_requests, [r.request_id])
            self.finish(r)

    def _on_admitted(self, msg: Admitted) -> None:
        r = self.requests.get(msg.request_id)
        if r is None:  # finished already
            return
        r.admitted = True
        if r.aborted:  # the abort that arrived before the add, carried out now
            self.engine.tell(EngineOps.abort_requests, [r.request_id])
            self.finish(r)
            self.role.on_aborted(self, r)

    # ------------------------------------------------------------------ aborts

    def _abort(self, request_ids: list[str], notify_error: str) -> int:
        to_engine: list[str] = []
        notify: dict[str, list[worker_pb2.RequestOutput]] = defaultdict(list)
        count = 0
        for rid in request_ids:
            r = self.requests.get(rid)
            if r is None or r.aborted:
                continue
            count += 1
            r.aborted = True
            if notify_error:
                notify[r.destination].append(abort_output(r, notify_error))
            if r.phase in TRANSFERRING:
                continue  # freed when the transfer ends
            if not r.admitted:
                continue  # carried out on `Admitted`, after the engine's add
            if r.phase == Phase.RESERVING:
                to_engine.append(rid)  # runs after the reserve command
                continue
            to_engine.append(rid)
            self.finish(r)
            self.role.on_aborted(self, r)
        if to_engine:
            self.engine.tell(EngineOps.abort_requests, to_engine)
        self.emit(notify)
        return count

    def finish(self, r: WorkerRequest) -> None:
        """`r` leaves this worker (reported to the scheduler as finished)."""
        if self.requests.pop(r.request_id, None) is not None:
            self.finished.append(r.request_id)

    def _on_tick(self) -> None:
        now = time.monotonic()
        for name, dest in list(self.destinations.items()):
            if dest.connected or now - dest.disconnected_since < self.destination_timeout_s:
                continue
            ids = [rid for rid, r in self.requests.items() if r.destination == name]
            if ids:
                logger.warning("destination %s is gone; aborting %d requests", name, len(ids))
                self._abort(ids, "")
            elif dest.queue.empty():
                del self.destinations[name]
            else:
                # Nobody will read these outputs.
                dest.queue = asyncio.Queue()

    # ------------------------------------------------------------------ plumbing

    def channel(self, address: str) -> grpc.aio.Channel:
        """A pooled channel to another worker."""
        return self._channels.get(address)

    def spawn(self, coro: Any) -> None:
        """Run `coro` in a task the host cancels on `close`."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        await self.stop()
        for task in list(self._tasks):
            task.cancel()
        await self._channels.close()


def abort_output(r: WorkerRequest, error: str) -> worker_pb2.RequestOutput:
    """The last output of a request that ends with `error`."""
    return worker_pb2.RequestOutput(
        request_id=r.request_id, output_index=r.num_emitted, finish_reason=_ABORT, error=error
    )
