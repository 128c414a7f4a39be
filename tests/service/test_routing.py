"""LoadBasedRouting: picks by load, respects caps and fit; None keeps a request queued."""

from __future__ import annotations

from tandem_protos.v1 import common_pb2
from tandem_services.scheduler.routing import LoadBasedRouting, Route, RoutingRequest, WorkerView

P, D, U = (
    common_pb2.WORKER_ROLE_PREFILL,
    common_pb2.WORKER_ROLE_DECODE,
    common_pb2.WORKER_ROLE_UNIFIED,
)


def _w(wid: str, role: int, free: int = 100, inflight: int = 0, waiting: int = 0) -> WorkerView:
    return WorkerView(wid, role, 0, waiting, free, 100, inflight, 16, 2048)


def _req(n: int = 40) -> RoutingRequest:
    return RoutingRequest("r", list(range(n)), 0)


def test_disaggregated_picks_roomiest_decode_and_idlest_prefill() -> None:
    policy = LoadBasedRouting(max_inflight_per_worker=8, max_inflight_prefills=2)
    workers = [
        _w("p1", P, inflight=1),
        _w("p2", P, inflight=0),
        _w("d1", D, free=10),
        _w("d2", D, free=50),
    ]
    assert policy.route(_req(), workers) == Route("p2", "d2")
    # 40 prompt tokens + 1 need 3 blocks of 16: d1 with 2 free blocks cannot take it.
    assert policy.route(_req(), [_w("p", P), _w("d1", D, free=2)]) is None
    # Caps: a prefill worker at its cap, a decode worker at its cap.
    assert policy.route(_req(), [_w("p", P, inflight=2), _w("d", D)]) is None
    assert policy.route(_req(), [_w("p", P), _w("d", D, inflight=8)]) is None


def test_unified_and_fit() -> None:
    policy = LoadBasedRouting(max_inflight_per_worker=4)
    workers = [_w("u1", U, inflight=3), _w("u2", U, inflight=1)]
    assert policy.route(_req(), workers) == Route("u2", None)
    assert policy.route(_req(), [_w("u", U, inflight=4)]) is None
    assert policy.route(_req(3000), workers) is None  # longer than every context
    assert policy.route(_req(), []) is None
