"""gRPC edge of the scheduler: each handler turns a call into a message for `Dispatcher`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from tandem_protos.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tandem_services.common.server import RETRY_AFTER_KEY
from tandem_services.scheduler import messages as m
from tandem_services.scheduler.dispatcher import Dispatcher

logger = logging.getLogger(__name__)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    async def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SubmitResponse:
        msg = m.Submit(request=request.request, destination=request.destination)
        try:
            return await self.dispatcher.ask(msg)
        except m.SubmitError as exc:
            trailing: tuple[tuple[str, str], ...] = ()
            if exc.retry_after_s is not None:
                trailing = ((RETRY_AFTER_KEY, str(exc.retry_after_s)),)
            await context.abort(exc.code, exc.message, trailing_metadata=trailing)
            raise  # not reached
        except asyncio.CancelledError:
            self.dispatcher.tell(m.Withdraw(request.request.request_id))
            raise

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        n = await self.dispatcher.ask(m.Abort(request_ids=list(request.request_ids)))
        return common_pb2.AbortResponse(num_aborted=n)

    async def WatchEvents(
        self, request: scheduler_pb2.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.SchedulerEvent]:
        if not request.destination:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "destination is empty")
        queue = await self.dispatcher.ask(m.Watch(destination=request.destination))
        try:
            while True:
                event = await queue.get()
                if event is None:
                    return
                yield event
        finally:
            self.dispatcher.tell(m.Unwatch(request.destination, queue))

    async def RegisterWorker(
        self, request: scheduler_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.RegisterWorkerResponse:
        if not request.worker_id or not request.address:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "worker_id and address are required"
            )
        if request.role == common_pb2.WORKER_ROLE_UNSPECIFIED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "role is required")
        if self.dispatcher.shutting_down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is shutting down")
        interval = await self.dispatcher.ask(m.Register(info=request))
        return scheduler_pb2.RegisterWorkerResponse(report_interval_s=interval)

    async def ReportLoad(
        self,
        request_iterator: AsyncIterator[scheduler_pb2.LoadReport],
        context: grpc.aio.ServicerContext,
    ) -> scheduler_pb2.ReportLoadResponse:
        generation: int | None = None
        worker_id = ""
        try:
            async for report in request_iterator:
                answer = await self.dispatcher.ask(m.Report(report=report, generation=generation))
                if answer is None:
                    await context.abort(
                        grpc.StatusCode.NOT_FOUND,
                        f"worker {report.worker_id!r} is not registered; register again",
                    )
                generation, worker_id = answer, report.worker_id
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # the stream broke: the worker is gone
            logger.info("load report stream of %s ended: %s", worker_id or "?", exc)
        finally:
            if generation is not None:
                self.dispatcher.tell(m.ReportStreamClosed(worker_id, generation))
        return scheduler_pb2.ReportLoadResponse()

    async def DeregisterWorker(
        self, request: scheduler_pb2.DeregisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.DeregisterWorkerResponse:
        await self.dispatcher.ask(m.Deregister(worker_id=request.worker_id))
        return scheduler_pb2.DeregisterWorkerResponse()

    async def ListWorkers(
        self, request: scheduler_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ListWorkersResponse:
        return await self.dispatcher.ask(m.ListWorkers())
