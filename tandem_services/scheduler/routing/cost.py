"""The routing cost model: choosing a prefill worker, cached prefix against load. Pure
Python, no I/O (it is routing policy, not the directory: tandem_services/directory/).

For each candidate worker the cost of sending it a prompt is

    cost = uncached_token   * (prompt tokens it would have to compute)
         + queued_token     * (prefill tokens already queued on it)
         + running_request  * (requests running on it)
         + waiting_request  * (requests waiting on it)

and the cheapest worker wins. Equal costs go to the less loaded worker (fewer queued
tokens, then fewer requests, then more free blocks), then to the smaller worker id, so a
decision is deterministic.

A prompt of N tokens with `c` leading blocks cached on a worker still computes at least
its last token there (the first sampled token needs its logits):

    uncached = N - min(c * block_size, N - 1)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class WorkerLoad:
    """What the scheduler knows of one candidate worker's load right now.

    `free_blocks` None means unknown (it then never wins a tie).
    """

    worker_id: str
    queued_prefill_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    free_blocks: int | None = None

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        for name in ("queued_prefill_tokens", "num_running", "num_waiting"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.free_blocks is not None and self.free_blocks < 0:
            raise ValueError(f"free_blocks must be >= 0, got {self.free_blocks}")


@dataclass(frozen=True)
class RoutingWeights:
    """Weights of the routing cost, in units of "one prompt token to compute"."""

    uncached_token: float = 1.0
    queued_token: float = 1.0
    running_request: float = 32.0
    waiting_request: float = 0.0

    def __post_init__(self) -> None:
        for name in ("uncached_token", "queued_token", "running_request", "waiting_request"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"routing weight {name} must be finite and >= 0, got {value}")


@dataclass(frozen=True)
class RoutingDecision:
    """The chosen worker, its cost and the prompt tokens it already holds."""

    worker_id: str
    cost: float
    num_cached_tokens: int
    used_cache_info: bool = True


def num_uncached_tokens(num_prompt_tokens: int, num_cached_blocks: int, block_size: int) -> int:
    """Prompt tokens a worker holding `num_cached_blocks` leading blocks must compute."""
    if num_prompt_tokens <= 0:
        return 0
    cached = min(num_cached_blocks * block_size, num_prompt_tokens - 1)
    return num_prompt_tokens - max(cached, 0)


def routing_cost(
    load: WorkerLoad,
    num_cached_blocks: int,
    num_prompt_tokens: int,
    block_size: int,
    weights: RoutingWeights,
) -> float:
    """The cost of sending the prompt to `load.worker_id` (lower is better)."""
    uncached = num_uncached_tokens(num_prompt_tokens, num_cached_blocks, block_size)
    return (
        weights.uncached_token * uncached
        + weights.queued_token * load.queued_prefill_tokens
        + weights.running_request * load.num_running
        + weights.waiting_request * load.num_waiting
    )


def _load_key(load: WorkerLoad) -> tuple[int, int, int, str]:
    free = -1 if load.free_blocks is None else load.free_blocks
    return (load.queued_prefill_tokens, load.num_running + load.num_waiting, -free, load.worker_id)


def rank_workers(
    candidates: Sequence[WorkerLoad],
    cached_blocks: Mapping[str, int],
    num_prompt_tokens: int,
    block_size: int,
    weights: RoutingWeights | None = None,
) -> list[RoutingDecision]:
    """Every candidate's decision, best first (cost, then load, then worker id)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    w = weights or RoutingWeights()
    scored = []
    for load in candidates:
        blocks = cached_blocks.get(load.worker_id, 0)
        cost = routing_cost(load, blocks, num_prompt_tokens, block_size, w)
        cached = num_prompt_tokens - num_uncached_tokens(num_prompt_tokens, blocks, block_size)
        scored.append((cost, _load_key(load), RoutingDecision(load.worker_id, cost, cached)))
    scored.sort(key=lambda item: (item[0], item[1]))
    return [decision for _, _, decision in scored]


def choose_worker(
    candidates: Sequence[WorkerLoad],
    cached_blocks: Mapping[str, int],
    num_prompt_tokens: int,
    block_size: int,
    weights: RoutingWeights | None = None,
) -> str:
    """The id of the cheapest candidate. `cached_blocks`: worker id -> leading blocks held
    (absent = 0; `{}` routes on load alone)."""
    if not candidates:
        raise ValueError("no candidate workers")
    ranked = rank_workers(candidates, cached_blocks, num_prompt_tokens, block_size, weights)
    return ranked[0].worker_id


class PrefillChooser(Protocol):
    """Picks one worker among prefill (or unified) candidates for one prompt: the step of a
    `RoutingPolicy` that weighs cache against load. `cached_blocks` may be `{}` (no cache
    information)."""

    name: str

    def choose(
        self,
        candidates: Sequence[WorkerLoad],
        cached_blocks: Mapping[str, int],
        num_prompt_tokens: int,
        block_size: int,
    ) -> RoutingDecision: ...


class CostModelChooser:
    """The cost model above: cached prefix weighed against load."""

    name = "prefix-aware"

    def __init__(self, weights: RoutingWeights | None = None) -> None:
        self.weights = weights or RoutingWeights()

    def choose(
        self,
        candidates: Sequence[WorkerLoad],
        cached_blocks: Mapping[str, int],
        num_prompt_tokens: int,
        block_size: int,
    ) -> RoutingDecision:
        if not candidates:
            raise ValueError("no candidate workers")
        ranked = rank_workers(
            candidates, cached_blocks, num_prompt_tokens, block_size, self.weights
        )
        return ranked[0]


class RoundRobinChooser:
    """Cycles through the candidates sorted by id, ignoring cache and load (the baseline)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(
        self,
        candidates: Sequence[WorkerLoad],
        cached_blocks: Mapping[str, int],
        num_prompt_tokens: int,
        block_size: int,
    ) -> RoutingDecision:
        if not candidates:
            raise ValueError("no candidate workers")
        ordered = sorted(candidates, key=lambda load: load.worker_id)
        load = ordered[next(self._counter) % len(ordered)]
        blocks = cached_blocks.get(load.worker_id, 0)
        cached = num_prompt_tokens - num_uncached_tokens(num_prompt_tokens, blocks, block_size)
        return RoutingDecision(load.worker_id, 0.0, cached)
