"""Engine request ids of one client request's attempts: one definition for every service.

A choice of a client request is one engine request (`cmpl-7`, or `cmpl-7-1` for choice 1 of
`n`). It may run more than once, each time under an id of its own, so that whatever an earlier
run left on a worker (a reservation whose KV receive is still being torn down, an add the
engine has not yet run) can never collide with the next run there, nor its late outputs be
taken for the next run's:

    cmpl-7 ─(scheduler: dispatch failed, may have reached a worker)─▶ cmpl-7~d1 ─▶ cmpl-7~d2
       │
       └─(frontend: worker lost mid-stream; prompt + tokens sent)─▶ cmpl-7~m1 ─▶ cmpl-7~m1~d1

`~m<k>`: the frontend's k-th migration of the choice (a new engine request: a longer prompt,
fewer tokens to go; frontend/tracker.py). `~d<k>`: the scheduler's k-th dispatch again of the
same engine request (same prompt, same outputs expected; scheduler/dispatcher.py). Workers only ever
see the full id; the scheduler maps a worker's report of `cmpl-7~d2` back to `cmpl-7`, and the
frontend maps its outputs to the choice, dropping those of an attempt older than the newest.

Invariant: a client-chosen engine id that itself ends in `~d<digits>` is taken as attempt 0
first (an exact match wins), so such ids still work; only a collision with another request's
attempt id (`x` at attempt 3 and a request named `x~d3` in flight together) is ambiguous.
"""

from __future__ import annotations

MIGRATION_MARK = "~m"
DISPATCH_MARK = "~d"


def migration_request_id(base_id: str, attempt: int) -> str:
    """The engine request id of a choice's `attempt`-th migration (1, 2, ...)."""
    if attempt < 1:
        raise ValueError(f"a migration is numbered from 1, got {attempt}")
    return f"{base_id}{MIGRATION_MARK}{attempt}"


def dispatch_request_id(request_id: str, attempt: int) -> str:
    """The id engine request `request_id` runs under on its `attempt`-th dispatch again
    (0: the first dispatch, under `request_id` itself)."""
    if attempt < 0:
        raise ValueError(f"a dispatch attempt is >= 0, got {attempt}")
    return request_id if attempt == 0 else f"{request_id}{DISPATCH_MARK}{attempt}"


def split_dispatch_request_id(engine_request_id: str) -> tuple[str, int] | None:
    """(request_id, attempt) of an id made by `dispatch_request_id` with attempt >= 1; None
    when it carries no dispatch suffix (attempt 0: the id is the request's own)."""
    base, mark, number = engine_request_id.rpartition(DISPATCH_MARK)
    if not mark or not base or not number.isdigit() or number.startswith("0"):
        return None
    return base, int(number)
