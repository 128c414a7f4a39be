"""Routing policies: which workers run a request.

The scheduler core hands a policy a snapshot of the workers that may take work and the
request's size; the policy answers with a `Route` or None (nobody can take it now; the request
waits in the admission queue). `route` is plain synchronous code run by the scheduler's core:
a policy that needs I/O first (the prefix-aware one asks the directory which workers hold
the prompt's prefix) does it in `lookup`, which the core awaits once per request, before
routing it, and hands over as `RoutingRequest.prefix` (services/scheduler/prefix_routing.py).

Three policies, by `--routing`: `load` (`LoadBasedRouting`), `round-robin` and `prefix`.
All share `candidates`: the same caps and fit rules decide who *may* take a request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from tandem_protos.v1 import common_pb2


@dataclass(frozen=True)
class PrefixLookup:
    """What the directory said of one prompt, looked up before routing.

    `cached_blocks`: worker id -> leading blocks of `block_hashes` it holds; None when there
    is no directory server or it could not be reached (route on load, and on the
    scheduler's own record of recent dispatches).
    """

    block_size: int
    block_hashes: tuple[bytes, ...]
    cached_blocks: Mapping[str, int] | None


@dataclass(frozen=True)
class RoutingRequest:
    request_id: str
    prompt_token_ids: Sequence[int]
    priority: int
    # Set for policies with a `lookup` step (prefix-aware routing).
    prefix: PrefixLookup | None = None

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
    there since; `num_inflight` counts requests dispatched there and not reported finished;
    `queued_prefill_tokens` sums the prompt tokens those requests compute there (prefill and
    unified workers; their cached prefixes, as estimated at routing, left out).
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
    queued_prefill_tokens: int = 0


@dataclass(frozen=True)
class Route:
    prefill_worker_id: str
    # None: a unified worker runs the whole request.
    decode_worker_id: str | None
    # Prompt tokens the policy expects the prefill worker to find cached (an estimate).
    num_cached_tokens: int = 0


class RoutingPolicy(Protocol):
    def route(self, request: RoutingRequest, workers: Sequence[WorkerView]) -> Route | None:
        """Pick workers for `request` among `workers`, or None to keep it queued."""
        ...


@dataclass(frozen=True)
class Candidates:
    """Who may take a request now. `decode` is None when unified workers run it whole
    (then `prefill` lists unified workers)."""

    prefill: list[WorkerView]
    decode: list[WorkerView] | None


def candidates(
    request: RoutingRequest,
    workers: Sequence[WorkerView],
    max_inflight_per_worker: int,
    max_inflight_prefills: int,
) -> Candidates | None:
    """The workers that may take `request` now, or None when nobody can (it stays queued).

    Disaggregated when prefill and decode workers are registered: decode workers under
    their cap with free blocks for the prompt, prefill workers under theirs. Otherwise
    unified workers under their cap. Every candidate's context must fit the prompt.
    """
    prefill = [w for w in workers if w.role == common_pb2.WORKER_ROLE_PREFILL]
    decode = [w for w in workers if w.role == common_pb2.WORKER_ROLE_DECODE]
    if prefill and decode:
        decode_ok = [
            w
            for w in decode
            if w.num_inflight < max_inflight_per_worker
            and w.num_free_blocks >= request.blocks_needed(w.block_size)
            and request.num_prompt_tokens < w.max_model_len
        ]
        prefill_ok = [
            w
            for w in prefill
            if w.num_inflight < max_inflight_prefills
            and request.num_prompt_tokens < w.max_model_len
        ]
        if not decode_ok or not prefill_ok:
            return None
        return Candidates(prefill_ok, decode_ok)
    unified = [
        w
        for w in workers
        if w.role == common_pb2.WORKER_ROLE_UNIFIED
        and w.num_inflight < max_inflight_per_worker
        and request.num_prompt_tokens < w.max_model_len
    ]
    if not unified:
        return None
    return Candidates(unified, None)


def roomiest_decode(decode: Sequence[WorkerView]) -> WorkerView:
    """The decode worker with the most free blocks (then the fewest requests in flight)."""
    return max(decode, key=lambda w: (w.num_free_blocks, -w.num_inflight))


@dataclass(frozen=True)
class LoadBasedRouting:
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
