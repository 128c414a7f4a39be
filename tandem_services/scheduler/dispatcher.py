"""`Dispatcher`: the one owner of the scheduler service's state (the worker registry, the
admission queue, the requests in flight), an actor handling the messages of `messages.py`. A
request's records and states are in `request_state.py`, a worker's in `workers.py`.

Named for what it does with all of that: it admits requests and dispatches each to its
workers (dispatch attempts, `DispatchOutcome`, `dispatch_request_id`), as a cluster-level
router or dispatcher does in disaggregated serving. It is not the engine's step `Scheduler`
(`tandem.core.scheduler`, which plans one engine's batches) nor an engine core
(`tandem.engine.core`). "Scheduler" stays in the service's names that follow its public
surfaces: the `tandem.v1.Scheduler` proto service (`SchedulerServicer`), the `scheduler`
process, its flags and its `tandem_scheduler_*` metrics (`SchedulerServiceConfig`,
`SchedulerMetrics`).

    Submit ─▶ admission queue (bounded, by priority then arrival)
                 │  pump: routing policy picks workers among those with room
                 ▼
              dispatching ── Reserve (decode) ─▶ Prefill (prefill / unified) ──▶ running
                 │ pool short: back to the queue head      worker reports it finished: forgotten

Everything here runs inside `handle`, one message at a time; RPCs to workers run in tasks
that report back with a `DispatchOutcome` (its `DispatchResult`). A policy with
`uses_lookup` (prefix-aware routing asks the directory where the prompt's prefix is cached)
runs its `lookup` in a task at admission that reports back with `PrefixLookedUp`; a request
is routed only once its lookup is back, in queue order. A request's `RequestStatus` changes
only through `Queued.move`, along `REQUEST_TRANSITIONS`.

A worker that misses load reports for `dead_after_s` (or whose report stream ends: a killed
process's connection closes, so that is at once) is dropped, and the directory forgets its
blocks at once. Its requests still dispatching are dispatched again elsewhere like a
retriable failure (below; their Submit fails with UNAVAILABLE only after
`max_dispatch_attempts`); running ones are announced to their frontend as failed (a
`RequestsFailed` event, UNAVAILABLE), and the other worker of each is told to abort it. The
frontend then migrates each (frontend/tracker.py: it alone knows which tokens the client has,
so it submits the continuation, prompt plus those tokens, as a new engine request).

A dispatch that fails retriably (UNAVAILABLE, DEADLINE_EXCEEDED: an engine busy with a long
step answers its Prefill late) or whose worker is lost may still have reached its workers: a
stalled worker acts on it later, a decode worker tears down a reservation whose KV receive is
under way only once that receive ends, a worker aborts a request whose engine add has not run
yet only after it. So each dispatch again runs under an engine id of its own
(`dispatch_request_id`: `cmpl-7~d1`, `cmpl-7~d2`, ...; common/request_ids.py): what an earlier
attempt left on a worker never collides with it (no ALREADY_EXISTS), and the frontend drops
whatever such an attempt still delivers once the newer one's outputs come. The scheduler keys
the request by its own id throughout and maps workers' reports of the attempt's id back to it.
Before the request is dispatched again, the failed attempt is aborted on each worker it may
have reached and those aborts are answered, then a jittered back-off passes (the request waits
in `backing_off`, where an abort still finds it), within `max_dispatch_attempts`.

    Submit cmpl-7 ─▶ attempt cmpl-7     Reserve ok, Prefill DEADLINE_EXCEEDED (engine mid-step)
                     abort cmpl-7 on both (answered; each worker ends it once it can)
                     back-off ─▶ attempt cmpl-7~d1 ─▶ running; Submit answered
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import random
import time
from collections import defaultdict

import grpc

from tandem.kv_transfer.placement import NoKVTransportError, choose_transport
from tandem_protos.v1 import common_pb2, scheduler_pb2, worker_pb2, worker_pb2_grpc
from tandem_services.common.actor import Actor
from tandem_services.common.request_ids import split_dispatch_request_id
from tandem_services.common.server import channel as grpc_channel
from tandem_services.scheduler import admission
from tandem_services.scheduler.config import SchedulerServiceConfig
from tandem_services.scheduler.messages import (
    Abort,
    BeginShutdown,
    CountDispatching,
    Deregister,
    DispatchOutcome,
    DispatchResult,
    ListWorkers,
    PrefixLookedUp,
    Register,
    Report,
    ReportStreamClosed,
    RetryDue,
    SchedulerMessage,
    Submit,
    SubmitError,
    Tick,
    Unwatch,
    Watch,
    Withdraw,
)
from tandem_services.scheduler.request_state import Inflight, Queued, RequestStatus
from tandem_services.scheduler.routing import RoutingPolicy, RoutingRequest, WorkerView
from tandem_services.scheduler.workers import WorkerEntry

logger = logging.getLogger(__name__)

# The dispatch may or may not have reached the worker: retried after its abort is answered.
_RETRIABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class Dispatcher(Actor[SchedulerMessage]):
    """Owns the worker registry, the admission queue and the in-flight requests."""

    def __init__(self, config: SchedulerServiceConfig, policy: RoutingPolicy) -> None:
        super().__init__("dispatcher")
        self.config = config
        self.policy = policy
        self.workers: dict[str, WorkerEntry] = {}
        self._heap: list[tuple[int, int, str]] = []
        self.queued: dict[str, Queued] = {}
        # Between dispatch attempts: waiting for the failed attempt's aborts and the back-off.
        self.backing_off: dict[str, Queued] = {}
        self.inflight: dict[str, Inflight] = {}
        self.watchers: dict[str, list[asyncio.Queue[scheduler_pb2.SchedulerEvent | None]]] = (
            defaultdict(list)
        )
        self._orphaned_since: dict[str, float] = {}
        self._seq = itertools.count()
        self._generation = itertools.count(1)
        self._dispatch_ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self.shutting_down = False
        self._kv_pairs_logged: set[tuple[str, int, str, int]] = set()
        self._random = random.Random()

    # ------------------------------------------------------------------ dispatch table

    def handle(self, msg: SchedulerMessage) -> None:
        match msg:
            case Submit():
                self._on_submit(msg)
            case Withdraw():
                self._abort_ids([msg.request_id], reason="withdrawn")
            case Abort():
                msg.answer(self._abort_ids(msg.request_ids, reason="aborted"))
            case Register():
                msg.answer(self._on_register(msg.info))
            case Report():
                msg.answer(self._on_report(msg.report, msg.generation))
            case ReportStreamClosed():
                entry = self.workers.get(msg.worker_id)
                if entry is not None and entry.generation == msg.generation:
                    self._drop_worker(entry, "its load report stream ended")
            case Deregister():
                entry = self.workers.get(msg.worker_id)
                if entry is not None:
                    entry.draining = True
                    logger.info("worker %s is draining", msg.worker_id)
                    self._broadcast_workers()
                msg.answer(None)
            case Watch():
                msg.answer(self._on_watch(msg.destination))
            case Unwatch():
                queues = self.watchers.get(msg.destination, [])
                if msg.queue in queues:
                    queues.remove(msg.queue)
                if not queues:
                    self.watchers.pop(msg.destination, None)
                    self._orphaned_since[msg.destination] = time.monotonic()
            case ListWorkers():
                msg.answer(
                    scheduler_pb2.ListWorkersResponse(
                        workers=[w.to_info() for w in self.workers.values()],
                        num_queued=len(self.queued) + len(self.backing_off),
                        num_inflight=len(self.inflight),
                    )
                )
            case Tick():
                self._on_tick()
            case DispatchOutcome():
                self._on_outcome(msg)
            case RetryDue():
                if self.backing_off.get(msg.request_id) is msg.queued:
                    del self.backing_off[msg.request_id]
                    self._requeue(msg.queued)
            case PrefixLookedUp():
                queued = self.queued.get(msg.request_id)
                if queued is not None and queued.seq == msg.seq:
                    queued.prefix = msg.prefix
                    queued.move(RequestStatus.QUEUED)
                    self._pump()
            case BeginShutdown():
                self._begin_shutdown()
                msg.answer(None)
            case CountDispatching():
                msg.answer(
                    sum(1 for r in self.inflight.values() if r.status is RequestStatus.DISPATCHING)
                )

    # ------------------------------------------------------------------ admission

    def _on_submit(self, msg: Submit) -> None:
        req = msg.request
        rid = req.request_id
        try:
            if self.shutting_down:
                raise SubmitError(grpc.StatusCode.UNAVAILABLE, "the scheduler is shutting down")
            if not rid:
                raise SubmitError(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
            if not msg.destination:
                raise SubmitError(grpc.StatusCode.INVALID_ARGUMENT, "destination is empty")
            if rid in self.queued or rid in self.inflight or rid in self.backing_off:
                raise SubmitError(
                    grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is already in flight"
                )
            if not req.prompt_token_ids:
                raise SubmitError(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
            limits = [w.info.max_model_len for w in self.workers.values() if not w.draining]
            if limits and len(req.prompt_token_ids) >= max(limits):
                raise SubmitError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"prompt has {len(req.prompt_token_ids)} tokens; the model's context is "
                    f"{max(limits)} tokens, and at least one must remain for output",
                )
            refusal = admission.check(
                self.config.admission_limits,
                [
                    admission.QueuedLoad(len(q.submit.request.prompt_token_ids), q.enqueued_at)
                    for q in self.queued.values()
                ],
                len(req.prompt_token_ids),
                time.monotonic(),
            )
            if refusal is not None:
                raise SubmitError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.message, refusal.retry_after_s
                )
        except SubmitError as exc:
            msg.fail(exc)
            return
        looking_up = self.policy.uses_lookup and self._num_prefill_capable() > 1
        status = RequestStatus.LOOKING_UP if looking_up else RequestStatus.QUEUED
        queued = Queued(msg, next(self._seq), time.monotonic(), status=status)
        self.queued[rid] = queued
        heapq.heappush(self._heap, (req.priority, queued.seq, rid))
        if looking_up:
            self._spawn(self._lookup(queued))
        self._pump()

    async def _lookup(self, queued: Queued) -> None:
        req = queued.submit.request
        prefix = None
        try:
            prefix = await self.policy.lookup(
                req.prompt_token_ids,
                req.cache_salt if req.HasField("cache_salt") else None,
                self._prefix_block_size(),
            )
        except Exception:  # routing without cache information never fails a request
            logger.exception("prefix lookup of %s failed", req.request_id)
        self.tell(PrefixLookedUp(req.request_id, queued.seq, prefix))

    def _num_prefill_capable(self) -> int:
        """Workers a prompt could go to (a lookup is pointless with one or none)."""
        return sum(
            1
            for w in self.workers.values()
            if w.info.role != common_pb2.WORKER_ROLE_DECODE and not w.draining
        )

    def _prefix_block_size(self) -> int:
        """The block size prompts are hashed with: that of the workers prompts go to."""
        for w in self.workers.values():
            if w.info.role != common_pb2.WORKER_ROLE_DECODE and w.info.block_size:
                return w.info.block_size
        return 16

    def _pump(self) -> None:
        """Dispatch queued requests, head first, while the policy finds room."""
        while self._heap:
            priority, seq, rid = self._heap[0]
            queued = self.queued.get(rid)
            if queued is None or queued.seq != seq:
                heapq.heappop(self._heap)
                continue
            if queued.status is RequestStatus.LOOKING_UP:
                return  # routed once its lookup is back, in queue order
            req = queued.submit.request
            routing_req = RoutingRequest(rid, req.prompt_token_ids, priority, queued.prefix)
            route = self.policy.route(routing_req, self._views())
            if route is None:
                return
            heapq.heappop(self._heap)
            del self.queued[rid]
            queued.move(RequestStatus.DISPATCHING)
            prefill = self.workers[route.prefill_worker_id]
            decode = self.workers[route.decode_worker_id] if route.decode_worker_id else None
            workers = {prefill.worker_id}
            prefill.inflight.add(rid)
            if decode is not None:
                workers.add(decode.worker_id)
                decode.inflight.add(rid)
                decode.reserved_since_report += routing_req.blocks_needed(decode.kv_cache_spec)
            self.inflight[rid] = Inflight(
                request_id=rid,
                destination=queued.submit.destination,
                workers=workers,
                prefill_worker_id=prefill.worker_id,
                decode_worker_id=decode.worker_id if decode else None,
                submit=queued.submit,
                queued=queued,
                num_prefill_tokens=max(len(req.prompt_token_ids) - route.num_cached_tokens, 0),
                dispatch_id=next(self._dispatch_ids),
                engine_request_id=queued.engine_request_id,
            )
            self._spawn(self._dispatch(queued.submit, prefill, decode, self.inflight[rid]))

    def _views(self) -> list[WorkerView]:
        views = []
        queued_tokens: dict[str, int] = defaultdict(int)
        for r in self.inflight.values():
            if r.prefill_worker_id in r.workers:  # not yet reported done there
                queued_tokens[r.prefill_worker_id] += r.num_prefill_tokens
        for w in self.workers.values():
            if w.draining:
                continue
            s = w.stats
            free = 0 if w.full else max(s.num_free_blocks - w.reserved_since_report, 0)
            views.append(
                WorkerView(
                    worker_id=w.worker_id,
                    role=w.info.role,
                    num_running=s.num_running,
                    num_waiting=s.num_waiting,
                    num_free_blocks=free,
                    num_blocks=s.num_blocks,
                    num_inflight=len(w.inflight),
                    block_size=w.info.block_size or 16,
                    max_model_len=w.info.max_model_len,
                    queued_prefill_tokens=queued_tokens.get(w.worker_id, 0),
                    kv_cache_spec=w.kv_cache_spec,
                )
            )
        return views

    async def _dispatch(
        self, submit: Submit, prefill: WorkerEntry, decode: WorkerEntry | None, r: Inflight
    ) -> None:
        """Reserve on the decode worker (if any), then Prefill; the attempt runs there under
        `r.engine_request_id`. Reports a `DispatchOutcome` keyed by the scheduler's id."""
        rid, dispatch_id = r.request_id, r.dispatch_id
        request = submit.request
        if r.engine_request_id != request.request_id:
            request = common_pb2.EngineRequest()
            request.CopyFrom(submit.request)
            request.request_id = r.engine_request_id
        timeout = self.config.rpc_timeout_s
        target = decode if decode is not None else prefill
        try:
            handoff = None
            if decode is not None:
                try:
                    transport = self._kv_transport(prefill, decode)
                except NoKVTransportError as exc:
                    self.tell(
                        DispatchOutcome(
                            rid,
                            dispatch_id,
                            DispatchResult.ERROR,
                            decode.worker_id,
                            grpc.StatusCode.FAILED_PRECONDITION,
                            str(exc),
                        )
                    )
                    return
                reply = await decode.stub.Reserve(
                    worker_pb2.ReserveRequest(request=request, destination=submit.destination),
                    timeout=timeout,
                )
                if not reply.block_ids:
                    self.tell(
                        DispatchOutcome(
                            rid, dispatch_id, DispatchResult.POOL_SHORT, decode.worker_id
                        )
                    )
                    return
                handoff = worker_pb2.KVHandoff(
                    decode_worker_id=decode.worker_id,
                    decode_address=decode.info.address,
                    block_ids=reply.block_ids,
                    transport=transport,
                    num_cached_tokens=reply.num_cached_tokens,
                )
            target = prefill
            await prefill.stub.Prefill(
                worker_pb2.PrefillRequest(
                    request=request, destination=submit.destination, handoff=handoff
                ),
                timeout=timeout,
            )
            self.tell(DispatchOutcome(rid, dispatch_id, DispatchResult.OK))
        except grpc.aio.AioRpcError as exc:
            self.tell(
                DispatchOutcome(
                    rid,
                    dispatch_id,
                    DispatchResult.ERROR,
                    target.worker_id,
                    exc.code(),
                    exc.details() or "",
                )
            )

    def _kv_transport(self, prefill: WorkerEntry, decode: WorkerEntry) -> str:
        """The pair's KV transport, from where the two workers are (or the --kv-connector
        flag). Raises NoKVTransportError."""
        transport = choose_transport(prefill.placement, decode.placement, self.config.kv_connector)
        key = (prefill.worker_id, prefill.generation, decode.worker_id, decode.generation)
        if key not in self._kv_pairs_logged:
            self._kv_pairs_logged.add(key)
            logger.info("KV from %s to %s over %s", prefill.worker_id, decode.worker_id, transport)
        return transport

    def _on_outcome(self, msg: DispatchOutcome) -> None:
        r = self.inflight.get(msg.request_id)
        if (
            r is None
            or r.status is not RequestStatus.DISPATCHING
            or r.dispatch_id != msg.dispatch_id
        ):
            return  # ended meanwhile (worker dropped): failed, or dispatched again
        submit, queued = r.submit, r.queued
        assert submit is not None and queued is not None
        if msg.result is DispatchResult.OK:
            queued.move(RequestStatus.RUNNING)
            r.submit = r.queued = None
            if r.aborted:
                self._send_abort(r.workers, [r.engine_request_id])
            submit.answer(
                scheduler_pb2.SubmitResponse(
                    prefill_worker_id=r.prefill_worker_id,
                    decode_worker_id=r.decode_worker_id or "",
                    queue_time_s=time.monotonic() - queued.enqueued_at,
                )
            )
            if not r.workers:
                del self.inflight[r.request_id]
            return
        # Not started: undo the placement, then retry or fail.
        self._forget(r)
        if msg.result is DispatchResult.POOL_SHORT:
            # The decode worker refused and forgot it; the prefill worker never saw it.
            entry = self.workers.get(msg.worker_id)
            if entry is not None:
                entry.full = True
            if not r.aborted:
                self._requeue(queued)
            else:
                submit.fail(SubmitError(grpc.StatusCode.CANCELLED, "request aborted"))
            return
        # ALREADY_EXISTS is never an earlier attempt of this request (each has its own id):
        # another request with this id is on that worker. Not retried.
        retriable = msg.code in _RETRIABLE
        queued.attempts += 1
        if not r.aborted and retriable and queued.attempts < self.config.max_dispatch_attempts:
            delay = self._backoff_s(queued.attempts)
            logger.warning(
                "dispatch of %s to %s failed (%s, attempt %d); retrying in %.0f ms once "
                "aborted there",
                r.request_id,
                msg.worker_id,
                msg.code.name,
                queued.attempts,
                delay * 1000,
            )
            self._back_off(r, queued, delay)
            return
        self._send_abort(r.workers, [r.engine_request_id])
        if r.aborted:
            submit.fail(SubmitError(grpc.StatusCode.CANCELLED, "request aborted"))
            return
        code = msg.code if msg.code != grpc.StatusCode.OK else grpc.StatusCode.INTERNAL
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            code = grpc.StatusCode.UNAVAILABLE
        submit.fail(SubmitError(code, msg.message or f"worker {msg.worker_id} failed"))

    def _back_off(self, r: Inflight, queued: Queued, delay_s: float) -> None:
        """Queue `r` again after its attempt is aborted on the workers it may have reached
        (those still registered) and `delay_s` has passed; the next attempt runs under an id
        of its own (a worker may still hold this one)."""
        queued.move(RequestStatus.BACKING_OFF)
        queued.dispatch_attempt += 1
        self.backing_off[r.request_id] = queued
        entries = [self.workers[w] for w in sorted(r.workers) if w in self.workers]
        self._spawn(self._retry_later(queued, entries, r.engine_request_id, delay_s))

    def _backoff_s(self, attempts: int) -> float:
        """Back-off after `attempts` failed attempts: exponential, capped, jittered."""
        cap = min(
            self.config.dispatch_backoff_s * 2 ** (attempts - 1), self.config.dispatch_backoff_max_s
        )
        return self._random.uniform(cap / 2, cap)

    async def _retry_later(
        self, queued: Queued, entries: list[WorkerEntry], engine_request_id: str, delay_s: float
    ) -> None:
        """Abort the failed attempt (`engine_request_id`) on every worker it may have reached,
        wait for those aborts to be answered (each within rpc_timeout_s), back off, then queue
        the request again. A worker has taken the abort before the retry can reach it (and
        ends the attempt as soon as it can: after a KV receive or an engine add under way)."""
        rid = queued.submit.request.request_id
        # An abort on a worker dropped meanwhile ends with the drop (`_abort_on`).
        await asyncio.gather(
            *(self._abort_on(e, [engine_request_id]) for e in entries), return_exceptions=True
        )
        await asyncio.sleep(delay_s)
        self.tell(RetryDue(rid, queued))

    def _requeue(self, queued: Queued) -> None:
        rid = queued.submit.request.request_id
        queued.move(RequestStatus.QUEUED)
        self.queued[rid] = queued
        heapq.heappush(self._heap, (queued.submit.request.priority, queued.seq, rid))
        self._pump()

    def _forget(self, r: Inflight) -> None:
        self.inflight.pop(r.request_id, None)
        for wid in r.workers:
            entry = self.workers.get(wid)
            if entry is not None:
                entry.inflight.discard(r.request_id)

    # ------------------------------------------------------------------ aborts

    def _abort_ids(self, request_ids: list[str], reason: str) -> int:
        count = 0
        by_worker: dict[str, list[str]] = defaultdict(list)
        for rid in request_ids:
            queued = self.queued.pop(rid, None) or self.backing_off.pop(rid, None)
            if queued is not None:
                queued.submit.fail(SubmitError(grpc.StatusCode.CANCELLED, f"request {reason}"))
                count += 1
                continue
            r = self.inflight.get(rid)
            if r is None or r.aborted:
                continue
            r.aborted = True
            count += 1
            if r.status is RequestStatus.RUNNING:  # the workers report it finished once aborted
                for wid in r.workers:
                    by_worker[wid].append(r.engine_request_id)
        for wid, ids in by_worker.items():
            self._send_abort({wid}, ids)
        return count

    def _send_abort(self, worker_ids: set[str], request_ids: list[str]) -> None:
        for wid in worker_ids:
            entry = self.workers.get(wid)
            if entry is not None:
                self._spawn(self._abort_on(entry, request_ids))

    async def _abort_on(self, entry: WorkerEntry, request_ids: list[str]) -> None:
        """Abort on one worker; done when it answers, fails, or is dropped (a lost worker's
        requests are gone with it, and its channel is closed under the call)."""
        call = asyncio.ensure_future(
            entry.stub.Abort(
                common_pb2.AbortRequest(request_ids=request_ids),
                timeout=self.config.rpc_timeout_s,
            )
        )
        lost = asyncio.ensure_future(entry.lost.wait())
        try:
            await asyncio.wait({call, lost}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            call.cancel()
            raise
        finally:
            lost.cancel()
        if not call.done():
            call.cancel()
            return
        exc = call.exception() if not call.cancelled() else None
        if isinstance(exc, grpc.aio.AioRpcError):
            logger.warning("abort on %s failed: %s", entry.worker_id, exc.code().name)
        elif exc is not None:
            raise exc

    # ------------------------------------------------------------------ workers

    def _on_register(self, info: scheduler_pb2.RegisterWorkerRequest) -> float:
        old = self.workers.get(info.worker_id)
        if old is not None:
            # Its directory entries stay: a worker registering again is usually the same
            # process after a lost stream (a new one replaces them when it publishes).
            self._drop_worker(old, "it registered again", broadcast=False, leave_directory=False)
        self._forget_cache(info.worker_id, remove_from_directory=False)
        channel = grpc_channel(info.address, self.config.tls)
        entry = WorkerEntry(
            info=info,
            generation=next(self._generation),
            channel=channel,
            stub=worker_pb2_grpc.WorkerStub(channel),
            stats=common_pb2.WorkerStats(
                worker_id=info.worker_id,
                role=info.role,
                num_free_blocks=info.num_blocks,
                num_blocks=info.num_blocks,
                block_size=info.block_size,
                max_model_len=info.max_model_len,
            ),
            last_report=time.monotonic(),
        )
        self.workers[info.worker_id] = entry
        logger.info(
            "worker %s registered: %s at %s, %d blocks",
            info.worker_id,
            common_pb2.WorkerRole.Name(info.role),
            info.address,
            info.num_blocks,
        )
        self._broadcast_workers()
        self._pump()
        return self.config.report_interval_s

    def _on_report(self, report: scheduler_pb2.LoadReport, generation: int | None) -> int | None:
        entry = self.workers.get(report.worker_id)
        if entry is None or (generation is not None and generation != entry.generation):
            return None
        entry.stats = report.stats
        entry.last_report = time.monotonic()
        entry.full = False
        entry.reserved_since_report = 0
        for engine_id in report.finished_request_ids:
            r = self._inflight_of(engine_id)
            if r is None:
                # An earlier attempt of a request retried since (its current attempt may run
                # on this worker too), or a request forgotten already.
                if engine_id not in self.inflight:
                    entry.inflight.discard(engine_id)
                continue
            entry.inflight.discard(r.request_id)
            r.workers.discard(entry.worker_id)
            if not r.workers and r.status is RequestStatus.RUNNING:
                del self.inflight[r.request_id]
        self._pump()
        return entry.generation

    def _inflight_of(self, engine_request_id: str) -> Inflight | None:
        """The in-flight request whose current attempt runs under `engine_request_id` on the
        workers (None: none, or an earlier attempt's id). An exact id wins over a suffix."""
        r = self.inflight.get(engine_request_id)
        if r is not None and r.engine_request_id == engine_request_id:
            return r
        split = split_dispatch_request_id(engine_request_id)
        if split is None:
            return None
        r = self.inflight.get(split[0])
        return r if r is not None and r.engine_request_id == engine_request_id else None

    def _drop_worker(
        self, entry: WorkerEntry, why: str, broadcast: bool = True, leave_directory: bool = True
    ) -> None:
        if self.workers.get(entry.worker_id) is not entry:
            return
        del self.workers[entry.worker_id]
        entry.lost.set()
        self._forget_cache(entry.worker_id, remove_from_directory=leave_directory)
        message = f"worker {entry.worker_id} was lost ({why})"
        if entry.inflight:
            logger.warning("%s; failing %d requests", message, len(entry.inflight))
        failed: dict[str, list[str]] = defaultdict(list)
        for rid in entry.inflight:
            r = self.inflight.get(rid)
            if r is None:
                continue
            r.workers.discard(entry.worker_id)
            self._forget(r)
            queued = r.queued
            if r.submit is not None and queued is not None:  # DISPATCHING: dispatch again
                queued.attempts += 1
                if not r.aborted and queued.attempts < self.config.max_dispatch_attempts:
                    logger.warning("%s was being dispatched there: dispatching it again", rid)
                    self._back_off(r, queued, self._backoff_s(queued.attempts))
                    continue
                self._send_abort(r.workers, [r.engine_request_id])
                r.submit.fail(
                    SubmitError(
                        grpc.StatusCode.CANCELLED if r.aborted else grpc.StatusCode.UNAVAILABLE,
                        "request aborted" if r.aborted else message,
                    )
                )
            else:
                self._send_abort(r.workers, [r.engine_request_id])
                failed[r.destination].append(rid)
        for destination, ids in failed.items():
            event = scheduler_pb2.SchedulerEvent(
                failed=scheduler_pb2.RequestsFailed(
                    request_ids=ids, code=grpc.StatusCode.UNAVAILABLE.value[0], message=message
                )
            )
            for queue in self.watchers.get(destination, []):
                queue.put_nowait(event)
        self._spawn(entry.channel.close())
        if broadcast:
            self._broadcast_workers()
        self._pump()

    def _forget_cache(self, worker_id: str, remove_from_directory: bool) -> None:
        """What routing believed the worker caches is void (it left, or is a new process).
        A worker dropped for silence also leaves the directory at once rather than at its
        expiry; if it is alive after all, its publisher notices and republishes."""
        self.policy.forget_worker(worker_id)
        if remove_from_directory:
            self._spawn(self.policy.leave_directory(worker_id))

    # ------------------------------------------------------------------ frontends

    def _on_watch(self, destination: str) -> asyncio.Queue[scheduler_pb2.SchedulerEvent | None]:
        queue: asyncio.Queue[scheduler_pb2.SchedulerEvent | None] = asyncio.Queue()
        queue.put_nowait(self._worker_set_event())
        if self.shutting_down:
            queue.put_nowait(None)
        self.watchers[destination].append(queue)
        self._orphaned_since.pop(destination, None)
        return queue

    def _worker_set_event(self) -> scheduler_pb2.SchedulerEvent:
        return scheduler_pb2.SchedulerEvent(
            workers=scheduler_pb2.WorkerSet(workers=[w.to_info() for w in self.workers.values()])
        )

    def _broadcast_workers(self) -> None:
        event = self._worker_set_event()
        for queues in self.watchers.values():
            for queue in queues:
                queue.put_nowait(event)

    # ------------------------------------------------------------------ time

    def _on_tick(self) -> None:
        now = time.monotonic()
        for entry in list(self.workers.values()):
            if now - entry.last_report > self.config.dead_after_s:
                self._drop_worker(entry, f"no load report for {now - entry.last_report:.1f}s")
        for rid, queued in list(self.queued.items()):
            if now - queued.enqueued_at > self.config.queue_timeout_s:
                del self.queued[rid]
                queued.submit.fail(
                    SubmitError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"no worker could take the request within "
                        f"{self.config.queue_timeout_s:g}s ({len(self.workers)} workers)",
                    )
                )
        for destination, since in list(self._orphaned_since.items()):
            if now - since > self.config.orphan_timeout_s:
                del self._orphaned_since[destination]
                ids = [r.request_id for r in self.inflight.values() if r.destination == destination]
                if ids:
                    logger.warning(
                        "frontend %s is gone; aborting %d requests", destination, len(ids)
                    )
                    self._abort_ids(ids, reason="orphaned")

    # ------------------------------------------------------------------ shutdown

    def _begin_shutdown(self) -> None:
        self.shutting_down = True
        waiting = list(self.queued.values()) + list(self.backing_off.values())
        self.queued.clear()
        self.backing_off.clear()
        for queued in waiting:
            queued.submit.fail(
                SubmitError(grpc.StatusCode.UNAVAILABLE, "the scheduler is shutting down")
            )
        for queues in self.watchers.values():
            for queue in queues:
                queue.put_nowait(None)

    async def close(self) -> None:
        await self.stop()
        for task in list(self._tasks):
            task.cancel()
        for entry in self.workers.values():
            await entry.channel.close()
        await self.policy.close()

    def _spawn(self, coro: object) -> None:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
