"""`--routing load`: least-loaded routing with per-worker caps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem_services.scheduler.routing.base import (
    Route,
    RoutingPolicy,
    RoutingRequest,
    WorkerView,
    candidates,
    roomiest_decode,
)


@dataclass(frozen=True)
class LoadBasedRouting(RoutingPolicy):
    """Least-loaded routing with per-worker caps.

    Disaggregated (prefill and decode workers registered): the decode worker with the most
    free blocks that fit the prompt, and the prefill worker with the fewest requests in
    flight. Otherwise the unified worker with the fewest requests in flight that has room.
    """

    max_inflight_per_worker: int = 256
    max_inflight_prefills: int = 64
    name = "load"

    def route(self, request: RoutingRequest, workers: Sequence[WorkerView]) -> Route | None:
        c = candidates(request, workers, self.max_inflight_per_worker, self.max_inflight_prefills)
        if c is None:
            return None
        if c.decode is not None:
            p = min(c.prefill, key=lambda w: (w.num_inflight, w.num_waiting))
            return Route(p.worker_id, roomiest_decode(c.decode).worker_id)
        u = min(c.prefill, key=lambda w: (w.num_inflight, -w.num_free_blocks))
        return Route(u.worker_id, None)
