"""`--routing round-robin`: the baseline that ignores cache and load."""

from __future__ import annotations

from collections.abc import Sequence

from tandem_services.scheduler.routing.base import (
    Route,
    RoutingPolicy,
    RoutingRequest,
    WorkerView,
    candidates,
    roomiest_decode,
)
from tandem_services.scheduler.routing.cost import RoundRobinChooser, WorkerLoad


class RoundRobinRouting(RoutingPolicy):
    """Prefill (or unified) workers in turn, ignoring cache and load; the decode worker as
    by load (the most free blocks)."""

    name = "round-robin"

    def __init__(self, max_inflight_per_worker: int = 256, max_inflight_prefills: int = 64) -> None:
        self.max_inflight_per_worker = max_inflight_per_worker
        self.max_inflight_prefills = max_inflight_prefills
        self._rr = RoundRobinChooser()

    def route(self, request: RoutingRequest, workers: Sequence[WorkerView]) -> Route | None:
        c = candidates(request, workers, self.max_inflight_per_worker, self.max_inflight_prefills)
        if c is None:
            return None
        loads = [WorkerLoad(w.worker_id) for w in c.prefill]
        block_size = c.prefill[0].block_size
        decision = self._rr.choose(loads, {}, request.num_prompt_tokens, block_size)
        decode = roomiest_decode(c.decode).worker_id if c.decode is not None else None
        return Route(decision.worker_id, decode)
