"""Admission control: whether the scheduler's queue takes one more request, and if not, when
to come back.

The admission queue (`Dispatcher.queued`) is bounded twice, by requests waiting and by their
prompt tokens waiting, so a burst far above capacity costs the scheduler a bounded amount of
memory and leaves the latency of the requests it admitted alone: the excess is refused at once
with RESOURCE_EXHAUSTED, which the frontend answers as HTTP 429. The refusal carries a retry
hint in its trailing metadata (`tandem_services.common.server.RETRY_AFTER_KEY`, whole
seconds), which the frontend passes on as `Retry-After` (HTTP) or the same metadata key
(gRPC)::

    Submit ─▶ check(queue, prompt tokens) ─▶ None: queued
                          │
                          └─▶ Refusal(message, retry_after_s) ─▶ RESOURCE_EXHAUSTED
                                                                 + retry-after: <s>

The hint is the age of the oldest request still queued: about how long the queue takes to turn
over once at the present rate of dispatch, clamped to [`MIN_RETRY_AFTER_S`,
`MAX_RETRY_AFTER_S`].
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 30


class AdmissionConfigError(ValueError):
    pass


@dataclass(frozen=True)
class AdmissionLimits:
    """Bounds of the admission queue: requests waiting (>= 1) and their prompt tokens waiting
    (0: no token bound). A request that would pass either bound is refused."""

    max_queue_len: int = 1024
    max_queued_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_queue_len < 1:
            raise AdmissionConfigError(f"max_queue_len must be >= 1, got {self.max_queue_len}")
        if self.max_queued_tokens < 0:
            raise AdmissionConfigError(
                f"max_queued_tokens must be >= 0, got {self.max_queued_tokens}"
            )


@dataclass(frozen=True)
class QueuedLoad:
    """What one queued request weighs: its prompt tokens and when it was queued."""

    num_prompt_tokens: int
    enqueued_at: float


@dataclass(frozen=True)
class Refusal:
    """Why a request was not admitted, and when to retry (whole seconds)."""

    message: str
    retry_after_s: int


def retry_after_s(queue: Iterable[QueuedLoad], now: float) -> int:
    """The retry hint: the oldest queued request's age in whole seconds, clamped."""
    oldest = min((q.enqueued_at for q in queue), default=now)
    return max(MIN_RETRY_AFTER_S, min(MAX_RETRY_AFTER_S, math.ceil(now - oldest)))


def check(
    limits: AdmissionLimits, queue: list[QueuedLoad], num_prompt_tokens: int, now: float
) -> Refusal | None:
    """None when a request of `num_prompt_tokens` may join `queue`; else the refusal.

    A request larger than the whole token bound is still admitted into an empty queue (the
    bound limits what waits, not what may be asked; the prompt limits are the frontend's)."""
    if len(queue) >= limits.max_queue_len:
        return Refusal(
            f"the admission queue is full ({len(queue)} requests waiting); retry later",
            retry_after_s(queue, now),
        )
    if limits.max_queued_tokens and queue:
        waiting = sum(q.num_prompt_tokens for q in queue)
        if waiting + num_prompt_tokens > limits.max_queued_tokens:
            return Refusal(
                f"the admission queue is full ({waiting} prompt tokens waiting, at most "
                f"{limits.max_queued_tokens}); retry later",
                retry_after_s(queue, now),
            )
    return None
