"""The routing-policy interface and what it is handed: which workers run a request.

The scheduler's `Dispatcher` hands a policy a snapshot of the workers that may take work and
the request's size; the policy answers with a `Route` or None (nobody can take it now; the
request waits in the admission queue). `route` is plain synchronous code run by the
dispatcher: a policy that needs I/O first (the prefix-aware one asks the directory which
workers hold the prompt's prefix) says so with `uses_lookup` and does it in `lookup`, which
the dispatcher awaits once per request, before routing it, and hands over as
`RoutingRequest.prefix`.

Every hook the dispatcher calls is declared on `RoutingPolicy`, with a default there; a policy
overrides what it needs. All policies share `candidates`: the same caps and fit rules decide
who *may* take a request.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from prometheus_client.metrics_core import Metric

from tandem.core.kv_cache_spec import KVCacheSpec
from tandem_protos.v1 import common_pb2
from tandem_services.common.metrics import gauge


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

    def blocks_needed(self, kv_cache_spec: KVCacheSpec) -> int:
        """Blocks a decode worker with `kv_cache_spec` holds for this request once its
        prompt is reserved and its first output token has a slot, over every KV cache group
        (a sliding group's window alone; no prefix hit assumed there)."""
        return kv_cache_spec.num_blocks_needed(self.num_prompt_tokens, 1)


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
    # Its KV cache groups (None: one full-attention group of `block_size` blocks).
    kv_cache_spec: KVCacheSpec | None = None

    @property
    def cache_spec(self) -> KVCacheSpec:
        """`kv_cache_spec`, or the plain cache's when it is None."""
        return self.kv_cache_spec or KVCacheSpec.full(self.block_size, 1)


@dataclass(frozen=True)
class Route:
    prefill_worker_id: str
    # None: a unified worker runs the whole request.
    decode_worker_id: str | None
    # Prompt tokens the policy expects the prefill worker to find cached (an estimate).
    num_cached_tokens: int = 0


class RoutingPolicy(abc.ABC):
    """What the scheduler's `Dispatcher` asks of a routing policy; the one interface every
    policy implements. Only `route` is required; every other hook has a do-nothing default.

    Called on the dispatcher's event loop, one message at a time: `route` and
    `forget_worker` synchronously, `lookup`, `leave_directory` and `close` awaited in tasks.
    """

    # The `--routing` value that selects the policy (also the `policy` metric label).
    name: ClassVar[str]
    # True: the dispatcher awaits `lookup` for every request before routing it (when more than
    # one worker could take its prompt).
    uses_lookup: ClassVar[bool] = False

    @abc.abstractmethod
    def route(self, request: RoutingRequest, workers: Sequence[WorkerView]) -> Route | None:
        """Pick workers for `request` among `workers`, or None to keep it queued."""

    async def lookup(
        self, prompt_token_ids: Sequence[int], cache_salt: str | None, block_size: int
    ) -> PrefixLookup | None:
        """I/O before routing (policies with `uses_lookup`); its answer becomes
        `RoutingRequest.prefix`. Must not raise for a lost server (answer without it)."""
        return None

    def forget_worker(self, worker_id: str) -> None:
        """The worker left or registered again: what the policy believed it caches is void."""
        return None

    async def leave_directory(self, worker_id: str) -> None:
        """The worker was dropped: remove it from the prefix directory, if there is one
        (it republishes should it be alive after all). Never raises for a lost server."""
        return None

    def metrics(self) -> Iterator[Metric]:
        """The policy's metrics, read at scrape time on the scheduler's event loop."""
        labels = {"policy": self.name}
        yield gauge("tandem_scheduler_routing_info", "The routing policy.", 1, labels)

    async def close(self) -> None:
        """Release what the policy holds (a directory client)."""
        return None


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
            and w.num_free_blocks >= request.blocks_needed(w.cache_spec)
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
