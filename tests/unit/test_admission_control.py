"""Admission control (scheduler/admission.py) and the frontend's API key check, as functions."""

from __future__ import annotations

import pytest

from tandem_services.frontend.auth import api_key_matches
from tandem_services.scheduler.admission import (
    MAX_RETRY_AFTER_S,
    AdmissionConfigError,
    AdmissionLimits,
    QueuedLoad,
    check,
    retry_after_s,
)


def _queue(*tokens: int, at: float = 100.0) -> list[QueuedLoad]:
    return [QueuedLoad(n, at + i) for i, n in enumerate(tokens)]


def test_the_queue_is_bounded_by_requests() -> None:
    limits = AdmissionLimits(max_queue_len=3)
    assert check(limits, _queue(10, 10), 10, now=101.0) is None
    refusal = check(limits, _queue(10, 10, 10), 10, now=104.2)
    assert refusal is not None and "3 requests waiting" in refusal.message
    assert refusal.retry_after_s == 5  # the oldest has waited 4.2 s


def test_the_queue_is_bounded_by_prompt_tokens() -> None:
    limits = AdmissionLimits(max_queue_len=100, max_queued_tokens=100)
    assert check(limits, _queue(40, 40), 20, now=100.0) is None
    refusal = check(limits, _queue(40, 40), 21, now=100.0)
    assert refusal is not None and "80 prompt tokens waiting" in refusal.message
    # One larger than the whole bound still gets into an empty queue.
    assert check(limits, [], 1000, now=100.0) is None


def test_retry_hint_is_clamped() -> None:
    assert retry_after_s([], now=5.0) == 1
    assert retry_after_s(_queue(1, at=0.0), now=0.1) == 1
    assert retry_after_s(_queue(1, at=0.0), now=1e6) == MAX_RETRY_AFTER_S


def test_limits_are_validated() -> None:
    with pytest.raises(AdmissionConfigError):
        AdmissionLimits(max_queue_len=0)
    with pytest.raises(AdmissionConfigError):
        AdmissionLimits(max_queued_tokens=-1)


def test_api_key_matches_only_the_exact_bearer_token() -> None:
    assert api_key_matches("Bearer s3cret", "s3cret")
    for wrong in ("", "Bearer s3cre", "Bearer s3cret ", "bearer s3cret", "s3cret", "Bearer é"):
        assert not api_key_matches(wrong, "s3cret")
