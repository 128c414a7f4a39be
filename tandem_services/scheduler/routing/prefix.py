"""KV-aware routing: send a prompt where its prefix is cached, weighed against load.

Per request, before it is routed (`lookup`, awaited once by the dispatcher):

    prompt token ids ──compute_block_hashes(block size of the workers, cache salt)──▶ chain
    chain ──PrefixRouter──▶ directory: worker -> leading blocks it holds   (None: unreachable)

then, when it reaches the head of the admission queue (`route`, synchronous):

    cached[w] = max(directory[w], dispatched[w])          per prefill (or unified) candidate
    cost[w]   = uncached_token * (prompt - cached tokens) + queued_token * queued_prefill_tokens
              + running_request * running + waiting_request * waiting
    cheapest wins; ties go to the less loaded worker (tandem_services/scheduler/routing/cost.py)

`dispatched` is the scheduler's own record of where it sent which prompt prefixes
(`DispatchedPrefixes`): an LRU of block hashes per worker, bounded by the worker's block
count, each entry living `hint_ttl_s`. With a directory server it covers the moments before
a worker's publish lands (requests sharing a new prefix that arrive together go to the same
worker); without one it is all the scheduler knows, an estimate that misses evictions caused
by other traffic.

The hashes equal the workers' own: the same function (tandem.core.kv_cache_utils), the same
block size (from the workers' registration), the same cache salt. A worker whose block size
differs from the one hashed for is treated as holding nothing.

Never fails a request: when the directory is down the lookup answers None (PrefixRouter
warns once per outage and stops asking for a second), the request routes on load and the
dispatch record, and `num_fallbacks` counts it (exported as
`tandem_scheduler_prefix_directory_fallbacks_total`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.metrics_core import Metric

from tandem.core.kv_cache_utils import compute_block_hashes
from tandem_services.common.metrics import counter, gauge
from tandem_services.directory import DirectoryUnavailable, PrefixDirectory
from tandem_services.scheduler.routing.base import (
    PrefixLookup,
    Route,
    RoutingPolicy,
    RoutingRequest,
    WorkerView,
    candidates,
    roomiest_decode,
)
from tandem_services.scheduler.routing.cost import CostModelChooser, RoutingWeights, WorkerLoad
from tandem_services.scheduler.routing.directory_lookup import PrefixRouter

logger = logging.getLogger(__name__)


def prompt_block_hashes(
    prompt_token_ids: Sequence[int], block_size: int, cache_salt: str | None
) -> list[bytes]:
    """The block-hash chain of a prompt's full blocks, exactly as a worker computes it."""
    return compute_block_hashes(prompt_token_ids, block_size, cache_salt)


class DispatchedPrefixes:
    """Block hashes the scheduler sent to each worker recently: worker -> LRU of hashes.

    `record` refreshes a chain's entries, its first block most recently (a worker's pool
    evicts a request's last blocks first; so does this record). Entries expire `ttl_s` after
    their last refresh; a worker keeps at most `capacity` entries (its block count).
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._by_worker: dict[str, OrderedDict[bytes, float]] = {}

    def record(self, worker_id: str, block_hashes: Sequence[bytes], capacity: int) -> None:
        entries = self._by_worker.setdefault(worker_id, OrderedDict())
        now = self._clock()
        expiry = now + self.ttl_s
        for h in reversed(block_hashes):
            entries[h] = expiry
            entries.move_to_end(h)
        self._expire(entries, now)
        while len(entries) > max(capacity, 0):
            entries.popitem(last=False)

    def longest_prefix(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Per worker, leading blocks of the chain recorded and unexpired (absent: none)."""
        now = self._clock()
        result: dict[str, int] = {}
        for worker_id, entries in self._by_worker.items():
            n = 0
            for h in block_hashes:
                expiry = entries.get(h)
                if expiry is None or expiry <= now:
                    break
                n += 1
            if n:
                result[worker_id] = n
        return result

    def forget_worker(self, worker_id: str) -> None:
        self._by_worker.pop(worker_id, None)

    def num_entries(self, worker_id: str) -> int:
        return len(self._by_worker.get(worker_id, ()))

    @staticmethod
    def _expire(entries: OrderedDict[bytes, float], now: float) -> None:
        # Entries are in expiry order (each refresh moves one to the end with the latest).
        while entries:
            h, expiry = next(iter(entries.items()))
            if expiry > now:
                return
            del entries[h]


class PrefixAwareRouting(RoutingPolicy):
    """`--routing prefix`: cached prefix (directory and dispatch record) against load.

    `router` is None without a directory server (the dispatch record alone), `hints` None
    with `--prefix-hint-ttl-s 0` (the directory alone). The decode worker is chosen as by
    load (the most free blocks).
    """

    name = "prefix"
    uses_lookup = True

    def __init__(
        self,
        router: PrefixRouter | None,
        weights: RoutingWeights | None = None,
        hints: DispatchedPrefixes | None = None,
        max_inflight_per_worker: int = 256,
        max_inflight_prefills: int = 64,
    ) -> None:
        self.router = router
        self.chooser = CostModelChooser(weights)
        self.hints = hints
        self.max_inflight_per_worker = max_inflight_per_worker
        self.max_inflight_prefills = max_inflight_prefills
        # Counters (exported by `routing_metrics`).
        self.num_lookups = 0
        self.num_directory_answers = 0
        self.num_fallbacks = 0
        self.num_routed = 0
        self.num_routed_to_cache = 0
        self.routed_prompt_tokens = 0
        self.routed_cached_tokens = 0

    @property
    def directory(self) -> PrefixDirectory | None:
        return self.router.directory if self.router is not None else None

    @property
    def directory_degraded(self) -> bool:
        return self.router is not None and self.router.degraded

    async def lookup(
        self, prompt_token_ids: Sequence[int], cache_salt: str | None, block_size: int
    ) -> PrefixLookup:
        """Hash the prompt and ask the directory; never raises on a lost server."""
        self.num_lookups += 1
        hashes = tuple(prompt_block_hashes(prompt_token_ids, block_size, cache_salt))
        cached: dict[str, int] | None = None
        if self.router is not None:
            if not hashes:
                cached = {}
            else:
                cached = await self.router.cached_blocks(hashes)
            if cached is None:
                self.num_fallbacks += 1
            else:
                self.num_directory_answers += 1
        return PrefixLookup(block_size, hashes, cached)

    def cached_blocks(self, prefix: PrefixLookup | None) -> dict[str, int]:
        """Per worker, the leading blocks believed cached: directory and dispatch record."""
        if prefix is None or not prefix.block_hashes:
            return {}
        cached = dict(prefix.cached_blocks or {})
        if self.hints is not None:
            for worker_id, n in self.hints.longest_prefix(prefix.block_hashes).items():
                cached[worker_id] = max(cached.get(worker_id, 0), n)
        return cached

    def route(self, request: RoutingRequest, workers: Sequence[WorkerView]) -> Route | None:
        c = candidates(request, workers, self.max_inflight_per_worker, self.max_inflight_prefills)
        if c is None:
            return None
        prefix = request.prefix
        block_size = prefix.block_size if prefix is not None else c.prefill[0].block_size
        cached = self.cached_blocks(prefix)
        # A worker with another block size cannot hold this chain.
        usable = {
            w.worker_id: cached[w.worker_id]
            for w in c.prefill
            if w.worker_id in cached and w.block_size == block_size
        }
        loads = [
            WorkerLoad(
                w.worker_id,
                queued_prefill_tokens=w.queued_prefill_tokens,
                num_running=w.num_running,
                num_waiting=w.num_waiting,
                free_blocks=w.num_free_blocks,
            )
            for w in c.prefill
        ]
        decision = self.chooser.choose(loads, usable, request.num_prompt_tokens, block_size)
        chosen = next(w for w in c.prefill if w.worker_id == decision.worker_id)
        if self.hints is not None and prefix is not None and prefix.block_hashes:
            self.hints.record(chosen.worker_id, prefix.block_hashes, chosen.num_blocks)
        self.num_routed += 1
        self.routed_prompt_tokens += request.num_prompt_tokens
        self.routed_cached_tokens += decision.num_cached_tokens
        if decision.num_cached_tokens:
            self.num_routed_to_cache += 1
        decode = roomiest_decode(c.decode).worker_id if c.decode is not None else None
        return Route(chosen.worker_id, decode, decision.num_cached_tokens)

    def forget_worker(self, worker_id: str) -> None:
        """The worker left or registered again: its cache is gone or unknown."""
        if self.hints is not None:
            self.hints.forget_worker(worker_id)

    async def leave_directory(self, worker_id: str) -> None:
        directory = self.directory
        if directory is None:
            return
        try:
            await directory.remove_worker(worker_id)
        except DirectoryUnavailable as exc:
            logger.info("could not remove %s from the prefix directory: %s", worker_id, exc)

    async def close(self) -> None:
        if self.router is not None:
            await self.router.directory.close()

    def metrics(self) -> Iterator[Metric]:
        """The routing info gauge, then the counters below (`_total` added by the exporter):

        tandem_scheduler_prefix_lookups_total                       prompts looked up
        tandem_scheduler_prefix_directory_answers_total             lookups the directory answered
        tandem_scheduler_prefix_directory_fallbacks_total           lookups it could not (load)
        tandem_scheduler_prefix_directory_up                        0 while it is unreachable
        tandem_scheduler_prefix_routed_requests_total               routed by the prefix policy
        tandem_scheduler_prefix_routed_to_cache_requests_total      ... to a worker with a prefix
        tandem_scheduler_prefix_routed_prompt_tokens_total          their prompt tokens
        tandem_scheduler_prefix_routed_cached_tokens_total          ... expected cached there
        """
        yield from super().metrics()
        yield counter(
            "tandem_scheduler_prefix_lookups", "Prompts looked up for routing.", self.num_lookups
        )
        yield counter(
            "tandem_scheduler_prefix_directory_answers",
            "Prefix lookups the directory answered.",
            self.num_directory_answers,
        )
        yield counter(
            "tandem_scheduler_prefix_directory_fallbacks",
            "Prefix lookups the directory could not answer (routed on load instead).",
            self.num_fallbacks,
        )
        if self.router is not None:
            yield gauge(
                "tandem_scheduler_prefix_directory_up",
                "0 while the prefix directory is unreachable.",
                0.0 if self.directory_degraded else 1.0,
            )
        yield counter(
            "tandem_scheduler_prefix_routed_requests",
            "Requests routed by the prefix-aware policy.",
            self.num_routed,
        )
        yield counter(
            "tandem_scheduler_prefix_routed_to_cache_requests",
            "Requests routed to a worker believed to hold part of their prompt.",
            self.num_routed_to_cache,
        )
        yield counter(
            "tandem_scheduler_prefix_routed_prompt_tokens",
            "Prompt tokens of the requests routed by the prefix-aware policy.",
            self.routed_prompt_tokens,
        )
        yield counter(
            "tandem_scheduler_prefix_routed_cached_tokens",
            "Prompt tokens the chosen workers were believed to hold.",
            self.routed_cached_tokens,
        )
