"""gRPC edge of a worker: converts protos, then passes messages to the engine thread (engine
state) and to `EngineHost` (everything else)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import grpc

from tandem.engine.core_client import AsyncMPClient
from tandem.kv_transfer.base import KVTransferError
from tandem.request import EngineCoreRequest
from tandem_protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tandem_services.common.convert import engine_request_from_proto
from tandem_services.worker import engine_host as m
from tandem_services.worker.kv_transports import KVTransports
from tandem_services.worker.roles import ROLE_TO_PROTO, WorkerRole
from tandem_services.worker.states import Phase, Role

logger = logging.getLogger(__name__)

__all__ = ["ROLE_TO_PROTO", "WorkerServicer", "stats_to_proto"]

T = TypeVar("T")
# Tasks whose caller was cancelled, kept alive until they end.
_orphans: set[asyncio.Task[Any]] = set()


async def _to_the_end(coro: Coroutine[Any, Any, T]) -> T:
    """Await `coro` in its own task, which a cancelled caller (an RPC past its deadline) does
    not cancel: an engine command and the engine host's record of its result stay paired."""
    task = asyncio.ensure_future(coro)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        _orphans.add(task)
        task.add_done_callback(_orphan_done)
        raise


def _orphan_done(task: asyncio.Task[Any]) -> None:
    _orphans.discard(task)
    if not task.cancelled() and task.exception() is not None:
        logger.warning("engine command of a cancelled call failed: %s", task.exception())


def stats_to_proto(
    stats: Any, worker_id: str, role: Role, num_inflight: int, block_size: int, max_model_len: int
) -> common_pb2.WorkerStats:
    return common_pb2.WorkerStats(
        worker_id=worker_id,
        role=ROLE_TO_PROTO[role],
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_free_blocks=stats.num_free_blocks,
        num_blocks=stats.num_blocks,
        kv_usage=stats.kv_usage,
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits,
        num_preemptions=stats.num_preemptions,
        num_held=stats.num_held,
        num_reserved=stats.num_reserved,
        num_inflight=num_inflight,
        block_size=block_size,
        max_model_len=max_model_len,
    )


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        role: WorkerRole,
        worker_id: str,
        host: m.EngineHost,
        engine: AsyncMPClient,
        eos_token_id: int | None,
        connector: KVTransports | None,
    ) -> None:
        self.role = role
        self.worker_id = worker_id
        self.host = host
        self.engine = engine
        self.eos_token_id = eos_token_id
        self.connector = connector

    async def _refuse_wrong_role(self, rpc: str, context: grpc.aio.ServicerContext) -> None:
        """FAILED_PRECONDITION when this worker's role does not serve `rpc`."""
        refusal = self.role.refusal(rpc)
        if refusal is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)

    async def _request(
        self, msg: common_pb2.EngineRequest, context: grpc.aio.ServicerContext
    ) -> EngineCoreRequest:
        if self.host.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        try:
            req = engine_request_from_proto(msg)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not req.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        if req.sampling_params.n != 1:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "n must be 1 at a worker (the frontend fans a request out)",
            )
        if req.eos_token_id is None:
            req.eos_token_id = self.eos_token_id
        return req

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        await self._refuse_wrong_role("Prefill", context)
        has_handoff = request.HasField("handoff")
        if has_handoff != self.role.needs_handoff:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "a prefill worker needs a KV hand-off target; a unified worker takes none",
            )
        req = await self._request(request.request, context)
        params = req.sampling_params
        req = self.role.admit(req)
        tracked = await self.host.ask(
            m.Track(
                m.WorkerRequest(
                    request_id=req.request_id,
                    destination=request.destination,
                    kind=self.role.role,
                    phase=Phase.RUNNING,
                    num_prompt_tokens=len(req.prompt_token_ids),
                    max_tokens=params.max_tokens,
                    handoff=request.handoff if has_handoff else None,
                    admitted=False,
                )
            )
        )
        if not tracked:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request id {req.request_id!r} is in use"
            )
        hold_kv = self.role.hold_kv

        async def admit() -> None:
            try:
                await self.engine.add_request(req, hold_kv=hold_kv)
            except ValueError:
                self.host.tell(m.Untrack(req.request_id))
                raise
            self.host.tell(m.Admitted(req.request_id))

        try:
            await _to_the_end(admit())
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return worker_pb2.PrefillResponse()

    async def Reserve(
        self, request: worker_pb2.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReserveResponse:
        await self._refuse_wrong_role("Reserve", context)
        req = await self._request(request.request, context)
        if req.sampling_params.prompt_logprobs is not None:
            # The prefill worker computes them and sends them with the first token.
            req.sampling_params = req.sampling_params.clone(prompt_logprobs=None)
        tracked = await self.host.ask(
            m.Track(
                m.WorkerRequest(
                    request_id=req.request_id,
                    destination=request.destination,
                    kind=Role.DECODE,
                    phase=Phase.RESERVING,
                    num_prompt_tokens=len(req.prompt_token_ids),
                    max_tokens=req.sampling_params.max_tokens,
                    num_emitted=1,
                )
            )
        )
        if not tracked:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request id {req.request_id!r} is in use"
            )

        async def reserve() -> tuple[list[int], int] | None:
            try:
                result = await self.engine.reserve(req)
            except ValueError:
                self.host.tell(m.Untrack(req.request_id))
                raise
            writable = None
            if result is not None:
                # The receivers accept writes into these alone: not a cached block, nor a
                # table's null entry (id 0, which a real block may have).
                block_ids, num_cached_tokens = result
                spec = self.host.kv_cache_spec
                indices = spec.handoff_indices(len(req.prompt_token_ids), num_cached_tokens)
                writable = [block_ids[i] for i in indices]
            self.host.tell(m.Reserved(req.request_id, writable))
            return result

        try:
            result = await _to_the_end(reserve())
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if result is None:
            return worker_pb2.ReserveResponse()
        block_ids, num_cached_tokens = result
        return worker_pb2.ReserveResponse(block_ids=block_ids, num_cached_tokens=num_cached_tokens)

    async def ReceiveKV(
        self,
        request_iterator: AsyncIterator[worker_pb2.KVBlockRun],
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.ReceiveKVResponse:
        await self._refuse_wrong_role("ReceiveKV", context)
        assert self.connector is not None
        started: list[str] = []

        async def reserved_for(request_id: str) -> list[int] | None:
            started.append(request_id)
            (reserved,) = await self.host.ask(m.BeginReceive([request_id]))
            if reserved is None:
                started.remove(request_id)
            return reserved

        try:
            return await self.connector.receive_stream(request_iterator, reserved_for)
        except KVTransferError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            raise  # not reached
        finally:
            if started:
                self.host.tell(m.EndReceive(started))

    # ------------------------------------------------------------------ CUDA IPC / NCCL KV

    async def ConnectKV(
        self, request: worker_pb2.ConnectKVRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ConnectKVResponse:
        await self._refuse_wrong_role("ConnectKV", context)
        assert self.connector is not None
        try:
            return await self.connector.connect(request)
        except KVTransferError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            raise  # not reached

    async def WriteKV(
        self,
        request_iterator: AsyncIterator[worker_pb2.KVWriteMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.KVWriteMessage]:
        await self._refuse_wrong_role("WriteKV", context)
        assert self.connector is not None
        # Requests whose BeginReceive may have marked them; each gets one EndReceive. One ask
        # of the engine host per session (not per request): a burst of sessions does not queue one
        # round trip through the engine host's inbox per request behind the others.
        started: set[str] = set()

        async def begin(request_ids: list[str]) -> list[list[int] | None]:
            started.update(request_ids)
            found = await self.host.ask(m.BeginReceive(request_ids))
            started.difference_update(
                rid for rid, r in zip(request_ids, found, strict=True) if r is None
            )
            return found

        def end(request_ids: list[str]) -> None:
            ended = [rid for rid in request_ids if rid in started]
            if ended:
                started.difference_update(ended)
                self.host.tell(m.EndReceive(ended))

        try:
            async with contextlib.aclosing(
                self.connector.serve_write(request_iterator, begin, end)
            ) as replies:
                async for reply in replies:
                    yield reply
        except KVTransferError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        finally:
            end(list(started))

    async def AddPrefilled(
        self, request: worker_pb2.AddPrefilledRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AddPrefilledResponse:
        rid, token = request.request_id, request.first_token_id
        if not await self.host.ask(m.BeginAddPrefilled(rid)):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"request {rid!r} has no reservation with its KV here (aborted?)",
            )
        try:
            out = await self.engine.add_prefilled_request(rid, token)
        except Exception as exc:
            logger.exception("add_prefilled_request(%s) failed", rid)
            self.host.tell(m.Abort([rid], notify_error=f"decode worker failed: {exc}"))
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        if out is not None:
            self.host.tell(m.Step([out]))
        return worker_pb2.AddPrefilledResponse()

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        n = await self.host.ask(m.Abort(list(request.request_ids)))
        return common_pb2.AbortResponse(num_aborted=n)

    async def Stats(
        self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.WorkerStats:
        stats = await self.engine.stats()
        inflight = await self.host.ask(m.Inflight())
        return stats_to_proto(
            stats,
            self.worker_id,
            self.role.role,
            len(inflight),
            self.host.block_size,
            self.host.max_model_len,
        )

    async def StreamOutputs(
        self, request: worker_pb2.StreamOutputsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.StepOutputs]:
        if not request.destination:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "destination is empty")
        queue = await self.host.ask(m.Connect(request.destination))
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                # Steps that piled up while the stream was busy leave as one message.
                while not queue.empty():
                    more = queue.get_nowait()
                    if more is None:
                        yield item
                        return
                    item.outputs.extend(more.outputs)
                yield item
        finally:
            self.host.tell(m.Disconnect(request.destination, queue))
