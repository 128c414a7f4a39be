"""What the scheduler sees of a request's structured output (no torch, no xgrammar).

A request with `SamplingParams.structured_outputs` carries a `GrammarState` (built by the
engine's `tandem.structured_output` manager). The scheduler only asks it three things::

    poll()              READY: schedule it; COMPILING: skip it this step (others go on);
                        FAILED: end it with `error` (FINISHED_ERROR, "error")
    sync()              the output tokens changed (appended, or dropped): advance / roll back
    is_terminated()     the grammar accepted its end: the request stops

The matcher behind it is a pure function of the request's output token ids: it follows
`Request.output_token_ids` (the same list object) and catches up in `sync()`, so a request
resumed after preemption, or started on a decode worker from a first token sampled
elsewhere, needs nothing but its token ids. `reset()` drops the matcher (it is rebuilt from
the token ids at the next `sync()`).
"""

from __future__ import annotations

import enum
from typing import Protocol


class GrammarStatus(enum.IntEnum):
    COMPILING = 0
    READY = 1
    FAILED = 2


class GrammarState(Protocol):
    """A request's grammar as the scheduler sees it (see the module docstring)."""

    @property
    def error(self) -> str | None:
        """Why the grammar is unusable (names the problem), once `poll()` says FAILED."""
        ...

    def poll(self) -> GrammarStatus:
        """Whether the grammar is compiled (and the matcher caught up), still compiling, or
        failed (an invalid spec, or one that did not compile within the time limit)."""
        ...

    def sync(self) -> bool:
        """Bring the matcher to the request's output tokens; False if a token is rejected
        (the output left the grammar: never with the mask applied)."""
        ...

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        ...

    def reset(self) -> None:
        """Drop the matcher; the next `sync()` rebuilds it from the token ids."""
        ...
