"""The scheduler's request status and dispatch results: enums, with every transition in one
table (tandem_services/scheduler/request_state.py)."""

from __future__ import annotations

import asyncio

import pytest

from tandem_protos.v1 import common_pb2
from tandem_services.scheduler.messages import DispatchResult, Submit
from tandem_services.scheduler.request_state import (
    REQUEST_TRANSITIONS,
    Inflight,
    Queued,
    RequestStatus,
)

S = RequestStatus


def _queued(status: RequestStatus = S.QUEUED) -> Queued:
    async def make() -> Submit:  # an Ask's future needs a running loop
        return Submit(common_pb2.EngineRequest(request_id="r"), "fe")

    return Queued(asyncio.run(make()), seq=0, enqueued_at=0.0, status=status)


def test_every_status_has_its_transitions_and_running_is_final() -> None:
    assert set(REQUEST_TRANSITIONS) == set(RequestStatus)
    assert REQUEST_TRANSITIONS[S.RUNNING] == frozenset()
    # Every status but RUNNING leads on; RUNNING is reached only by dispatching.
    assert [s for s in RequestStatus if S.RUNNING in REQUEST_TRANSITIONS[s]] == [S.DISPATCHING]
    assert {r.value for r in DispatchResult} == {"ok", "pool_short", "error"}


def test_a_retried_request_walks_the_table() -> None:
    q = _queued(S.LOOKING_UP)
    for status in (S.QUEUED, S.DISPATCHING, S.BACKING_OFF, S.QUEUED, S.DISPATCHING):
        q.move(status)
    r = Inflight("r", "fe", {"p"}, "p", None, q.submit, q)
    assert r.status is S.DISPATCHING
    q.move(S.QUEUED)  # pool short: back to the queue
    q.move(S.DISPATCHING)
    q.move(S.RUNNING)
    r.submit = r.queued = None
    assert r.status is S.RUNNING


@pytest.mark.parametrize(
    ("start", "bad"),
    [
        (S.QUEUED, S.RUNNING),
        (S.LOOKING_UP, S.DISPATCHING),
        (S.BACKING_OFF, S.DISPATCHING),
        (S.RUNNING, S.QUEUED),
    ],
)
def test_a_transition_outside_the_table_is_refused(
    start: RequestStatus, bad: RequestStatus
) -> None:
    q = _queued(start)
    with pytest.raises(RuntimeError, match="'r'"):
        q.move(bad)
    assert q.status is start
