"""Whether the deployment behind this frontend can serve a request: the answer of `/health`
and `/ready`.

A request needs either a unified worker, or a prefill worker and a decode worker; a worker
counts while the scheduler lists it and it is not draining (a worker whose engine died or
stalled stops reporting and is dropped by the scheduler, so it leaves the list). `/health`
reads the worker set the scheduler last pushed to this frontend (no RPC: cheap to poll);
`/ready` asks the scheduler now (`ListWorkers`), so it also fails while the scheduler is
unreachable.

The HTTP API follows `/health`: until it would answer 200, `/v1/models` and the completion
endpoints answer 503 with a Retry-After header (`require_serving`), so a client that polls
`/v1/models` for readiness (as clients of vLLM do) starts its load only when a request can be
served. The listening socket is up from the start, so probes and `/health` always answer.
(gRPC `Generate` is not gated: the scheduler queues or fails those requests as before.)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from tandem_protos.v1 import common_pb2, scheduler_pb2
from tandem_services.frontend.types import FrontendError

# What a client is told to wait before it asks again while no request can be served.
NOT_READY_RETRY_AFTER_S = 1

_ROLE_NAMES = {
    common_pb2.WORKER_ROLE_PREFILL: "prefill",
    common_pb2.WORKER_ROLE_DECODE: "decode",
    common_pb2.WORKER_ROLE_UNIFIED: "unified",
}


@dataclass(frozen=True)
class Readiness:
    """Serving workers per role, and whether that covers a request."""

    workers: dict[str, int]
    draining: bool = False
    scheduler_error: str = ""

    @property
    def ok(self) -> bool:
        w = self.workers
        covered = w["unified"] > 0 or (w["prefill"] > 0 and w["decode"] > 0)
        return covered and not self.draining and not self.scheduler_error

    @property
    def status(self) -> str:
        if self.draining:
            return "draining"
        if self.scheduler_error:
            return "scheduler unreachable"
        return "ok" if self.ok else "no serving worker for every role"

    def body(self) -> dict[str, object]:
        body: dict[str, object] = {"status": self.status, "workers": dict(self.workers)}
        if self.scheduler_error:
            body["error"] = self.scheduler_error
        return body


def readiness(
    workers: Iterable[scheduler_pb2.WorkerInfo], draining: bool = False, scheduler_error: str = ""
) -> Readiness:
    """Count the serving (listed, not draining) workers of each role."""
    counts = dict.fromkeys(_ROLE_NAMES.values(), 0)
    for w in workers:
        name = _ROLE_NAMES.get(w.role)
        if name is not None and not w.draining:
            counts[name] += 1
    return Readiness(counts, draining, scheduler_error)


def require_serving(state: Readiness) -> None:
    """Raise UNAVAILABLE (HTTP 503, Retry-After) unless `state` can serve a request."""
    if state.ok:
        return
    if state.draining:
        message = "the frontend is shutting down"
    else:
        workers = ", ".join(f"{role} {n}" for role, n in state.workers.items())
        message = f"not ready: {state.status} yet (workers: {workers}); retry shortly"
    raise FrontendError(grpc.StatusCode.UNAVAILABLE, message, retry_after_s=NOT_READY_RETRY_AFTER_S)
