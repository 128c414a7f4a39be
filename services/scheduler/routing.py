"""Routing policies: which workers run a request.

The scheduler core hands a policy a snapshot of the workers that may take work and the
request's size; the policy answers with a `Route` or None (nobody can take it now; the request
waits in the admission queue). A prefix-aware policy (directory lookups weighed against load)
plugs in here with the same signature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tandem_protos.v1 import common_pb2


@dataclass(frozen=True)
class RoutingRequest:
    request_id: str
    prompt_token_ids: Sequence[int]
    priority: int

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def blocks_needed(self, block_size: int) -> int:
        """Blocks for the prompt and the first output token."""
        return -(-(self.num_prompt_tokens + 1) // block_size)


@dataclass(frozen=True)
class WorkerView:
    """What the scheduler knows of one worker that may take work now.

    `num_free_blocks` is the last reported count minus the blocks the scheduler reserved
    there since; `num_inflight` counts requests dispatched there and not reported finished.
    """

    worker_id: str
    role: int
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    num_inflight: int
    block_size: int
    max_model_len: int


@dataclass(frozen=True)
class Route:
    prefill_worker_id: str
    # None: a unified worker runs the whole request.
    decode_worker_id: str | None


class RoutingPolicy(Protocol):
    def route(self, request: RoutingRequest, workers: Sequence[WorkerView]) -> Route | None:
        """Pick workers for `request` among `workers`, or None to keep it queued."""
        ...


@dataclass(frozen=True)
class LoadBasedRouting:
    """Least-loaded routing with per-worker caps.

    Disaggregated (prefill and decode workers registered): the decode worker with the most
    free blocks that fit the prompt, and the prefill worker with the fewest requests in
    flight. Otherwise the unified worker with the fewest requests in flight that has room.
    """

    max_inflight_per_worker: int = 256
    max_inflight_prefills: int = 64

    def route(self, request: RoutingRequest, workers: Sequence[WorkerView]) -> Route | None:
        prefill = [w for w in workers if w.role == common_pb2.WORKER_ROLE_PREFILL]
        decode = [w for w in workers if w.role == common_pb2.WORKER_ROLE_DECODE]
        if prefill and decode:
            decode_ok = [
                w
                for w in decode
                if w.num_inflight < self.max_inflight_per_worker
                and w.num_free_blocks >= request.blocks_needed(w.block_size)
                and request.num_prompt_tokens < w.max_model_len
            ]
            prefill_ok = [
                w
                for w in prefill
                if w.num_inflight < self.max_inflight_prefills
                and request.num_prompt_tokens < w.max_model_len
            ]
            if not decode_ok or not prefill_ok:
                return None
            d = max(decode_ok, key=lambda w: (w.num_free_blocks, -w.num_inflight))
            p = min(prefill_ok, key=lambda w: (w.num_inflight, w.num_waiting))
            return Route(p.worker_id, d.worker_id)
        unified = [
            w
            for w in workers
            if w.role == common_pb2.WORKER_ROLE_UNIFIED
            and w.num_inflight < self.max_inflight_per_worker
            and request.num_prompt_tokens < w.max_model_len
        ]
        if not unified:
            return None
        u = min(unified, key=lambda w: (w.num_inflight, -w.num_free_blocks))
        return Route(u.worker_id, None)
