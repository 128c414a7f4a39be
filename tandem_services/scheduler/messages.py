"""The messages `Dispatcher` handles, one at a time: the servicer's asks and tells, the
ticker's `Tick`, and what its own tasks report back (`DispatchOutcome`, `RetryDue`,
`PrefixLookedUp`). `SchedulerMessage` is their union; `SubmitError` is how a Submit fails."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from tandem_protos.v1 import common_pb2, scheduler_pb2
from tandem_services.common.actor import Ask
from tandem_services.scheduler.routing import PrefixLookup

if TYPE_CHECKING:
    from tandem_services.scheduler.request_state import Queued


class SubmitError(Exception):
    """A request the scheduler refuses or could not start; maps onto a gRPC status."""

    def __init__(
        self, code: grpc.StatusCode, message: str, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        # RESOURCE_EXHAUSTED: when to come back (admission.py), sent as trailing metadata.
        self.retry_after_s = retry_after_s


@dataclass
class Submit(Ask[scheduler_pb2.SubmitResponse]):
    request: common_pb2.EngineRequest
    destination: str


@dataclass
class Withdraw:
    """The Submit call went away (client cancelled) before it was answered."""

    request_id: str


@dataclass
class Abort(Ask[int]):
    request_ids: list[str]


@dataclass
class Register(Ask[float]):
    info: scheduler_pb2.RegisterWorkerRequest


@dataclass
class Report(Ask["int | None"]):
    """A load report; `generation` is None on a stream's first report. Answer: the worker's
    registration generation, or None when the worker is unknown (it must register again)."""

    report: scheduler_pb2.LoadReport
    generation: int | None


@dataclass
class ReportStreamClosed:
    worker_id: str
    generation: int


@dataclass
class Deregister(Ask[None]):
    worker_id: str


@dataclass
class Watch(Ask["asyncio.Queue[scheduler_pb2.SchedulerEvent | None]"]):
    destination: str


@dataclass
class Unwatch:
    destination: str
    queue: asyncio.Queue[scheduler_pb2.SchedulerEvent | None]


@dataclass
class ListWorkers(Ask[scheduler_pb2.ListWorkersResponse]):
    pass


@dataclass
class Tick:
    pass


class DispatchResult(enum.Enum):
    """How one dispatch attempt ended, as its task reports it (`DispatchOutcome`)."""

    # Every worker took it: the request runs.
    OK = "ok"
    # The decode worker's Reserve found no room (and forgot it): back to the queue head.
    POOL_SHORT = "pool_short"
    # An RPC failed or no KV transport fits: retried after aborts, or failed.
    ERROR = "error"


@dataclass
class DispatchOutcome:
    request_id: str
    # `Inflight.dispatch_id` of the attempt it reports on (a later attempt ignores it).
    dispatch_id: int
    result: DispatchResult
    worker_id: str = ""
    code: grpc.StatusCode = grpc.StatusCode.OK
    message: str = ""


@dataclass
class RetryDue:
    """A failed dispatch's aborts are answered and its back-off is over: queue it again."""

    request_id: str
    queued: Queued


@dataclass
class PrefixLookedUp:
    """A queued request's prefix lookup is back (None: it failed; route without it)."""

    request_id: str
    seq: int
    prefix: PrefixLookup | None


@dataclass
class BeginShutdown(Ask[None]):
    pass


@dataclass
class CountDispatching(Ask[int]):
    pass


SchedulerMessage = (
    Submit
    | Withdraw
    | Abort
    | Register
    | Report
    | ReportStreamClosed
    | Deregister
    | Watch
    | Unwatch
    | ListWorkers
    | Tick
    | DispatchOutcome
    | RetryDue
    | PrefixLookedUp
    | BeginShutdown
    | CountDispatching
)
