"""Where a submitted request stands in the scheduler: `RequestStatus`, every transition in
`REQUEST_TRANSITIONS`, and the two records a request moves through, `Queued` (from its Submit
until it runs) and `Inflight` (one dispatch attempt, then the running request)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tandem_services.common.request_ids import dispatch_request_id
from tandem_services.scheduler.messages import Submit
from tandem_services.scheduler.routing import PrefixLookup


class RequestStatus(enum.Enum):
    """Where a submitted request stands in the scheduler. Transitions: `REQUEST_TRANSITIONS`.

    LOOKING_UP ─▶ QUEUED ─▶ DISPATCHING ─▶ RUNNING
                    ▲  ▲        │  │
                    │  └────────┘  │ pool short            (any state may also end: aborted,
                    │              ▼                        failed, timed out, finished)
                    └──────── BACKING_OFF    retriable failure: aborts answered, back-off over
    """

    # Its routing lookup (prefix directory) is awaited; it is routed once it is back.
    LOOKING_UP = "looking_up"
    # In the admission queue (`Dispatcher.queued`).
    QUEUED = "queued"
    # Routed; Reserve / Prefill RPCs under way (`Dispatcher.inflight`, Submit unanswered).
    DISPATCHING = "dispatching"
    # A failed attempt is being aborted on its workers, then backs off (`backing_off`).
    BACKING_OFF = "backing_off"
    # On its workers (`inflight`, Submit answered) until they report it finished.
    RUNNING = "running"


REQUEST_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.LOOKING_UP: frozenset({RequestStatus.QUEUED}),
    RequestStatus.QUEUED: frozenset({RequestStatus.DISPATCHING}),
    RequestStatus.DISPATCHING: frozenset(
        {RequestStatus.RUNNING, RequestStatus.QUEUED, RequestStatus.BACKING_OFF}
    ),
    RequestStatus.BACKING_OFF: frozenset({RequestStatus.QUEUED}),
    RequestStatus.RUNNING: frozenset(),
}


@dataclass
class Queued:
    """A request from its Submit until it runs (or ends)."""

    submit: Submit
    seq: int
    enqueued_at: float
    # Failed dispatch attempts (the limit is max_dispatch_attempts).
    attempts: int = 0
    # Earlier attempts that may have reached a worker (failed retriably, or their worker was
    # lost): the next one runs under `dispatch_request_id(request_id, dispatch_attempt)`.
    dispatch_attempt: int = 0
    # Prefix-aware routing: the directory's answer.
    prefix: PrefixLookup | None = None
    status: RequestStatus = RequestStatus.QUEUED

    @property
    def engine_request_id(self) -> str:
        """The id the next dispatch attempt runs under on the workers."""
        return dispatch_request_id(self.submit.request.request_id, self.dispatch_attempt)

    def move(self, status: RequestStatus) -> None:
        """The one place a request's status changes; refuses a transition not in the table."""
        if status not in REQUEST_TRANSITIONS[self.status]:
            raise RuntimeError(
                f"request {self.submit.request.request_id!r}: {self.status} -> {status}"
            )
        self.status = status


@dataclass
class Inflight:
    request_id: str
    destination: str
    workers: set[str]
    prefill_worker_id: str
    decode_worker_id: str | None
    submit: Submit | None  # set while dispatching
    queued: Queued | None  # set while dispatching (to requeue)
    aborted: bool = False
    # Prompt tokens the prefill (or unified) worker computes: not cached there, as
    # estimated when routing.
    num_prefill_tokens: int = 0
    # Which dispatch attempt this is (outcomes of an earlier attempt of the id are stale).
    dispatch_id: int = 0
    # The id this attempt runs under on its workers ("": `request_id`; see request_ids.py).
    engine_request_id: str = ""

    def __post_init__(self) -> None:
        if not self.engine_request_id:
            self.engine_request_id = self.request_id

    @property
    def status(self) -> RequestStatus:
        """DISPATCHING until its Submit is answered, then RUNNING."""
        return RequestStatus.RUNNING if self.queued is None else self.queued.status
