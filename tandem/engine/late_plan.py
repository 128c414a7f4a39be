"""When to plan the next step under late planning (`--async-scheduling late`).

Async scheduling plans step N+1 as soon as step N is launched, so the device never waits for
the host; but a request that arrives while step N runs misses N+1 (already planned) and starts
its prefill one whole step later than a synchronous engine would start it. Late planning keeps
the overlap and plans N+1 as late as it still can: a little before step N is predicted to end,
the margin being the host's measured planning time. Requests that arrived meanwhile join N+1.

`StepClock` makes the prediction from the steps it has seen land:

- a step's device time is the time from its start (its launch, or the landing of the step
  before it if that was later: steps queue on the device) to its landing (the host had its
  sampled ids);
- steps are grouped by kind (decode-only or with prefill rows) and size (the power of two
  above their scheduled tokens), and a step's predicted time is the shortest of the last few
  of its group. Too short a prediction only plans early (what async scheduling does anyway);
  too long a one leaves the device idle, so the prediction leans short, and a host that
  landed a step late (so measured it long) does not push it out;
- the margin is the longest of the last few planning times (schedule through launch), plus
  `SAFETY_S`.

No group yet, or nothing in flight: no deadline (plan now). Torch-free; times are
`time.perf_counter()` seconds.
"""

from __future__ import annotations

from collections import deque

# Seconds planned ahead of the predicted end beyond the longest recent planning time: the
# wake-up and launch jitter of the host.
SAFETY_S = 0.0005
# Observations kept per group (durations) and of planning times.
WINDOW = 8


def step_kind(num_scheduled_tokens: int, num_prefill_tokens: int) -> tuple[bool, int]:
    """The group of a step: whether it has prefill rows, and the bit length of its scheduled
    token count (steps within a factor of two of each other)."""
    return num_prefill_tokens > 0, max(num_scheduled_tokens, 1).bit_length()


class StepClock:
    """Launches and landings of an engine's steps, in order; see the module docstring."""

    def __init__(self, window: int = WINDOW, safety_s: float = SAFETY_S) -> None:
        self.window = window
        self.safety_s = safety_s
        self._in_flight: deque[tuple[tuple[bool, int], float]] = deque()
        self._durations: dict[tuple[bool, int], deque[float]] = {}
        self._planning: deque[float] = deque(maxlen=window)
        self._last_landed: float | None = None

    def planned(self, seconds: float) -> None:
        """The host took `seconds` from starting to plan a step to having launched it."""
        self._planning.append(seconds)

    def launched(self, kind: tuple[bool, int], now: float) -> None:
        """A step of `kind` was launched at `now` (it runs after every step before it)."""
        self._in_flight.append((kind, now))

    def landed(self, now: float) -> None:
        """The oldest step in flight landed at `now`."""
        if not self._in_flight:
            return
        kind, launched_at = self._in_flight.popleft()
        start = self._start(launched_at)
        self._last_landed = now
        seen = self._durations.setdefault(kind, deque(maxlen=self.window))
        seen.append(now - start)

    def _start(self, launched_at: float) -> float:
        """When a step launched at `launched_at` started on the device: then, or when the
        step before it landed, if later (steps queue)."""
        return launched_at if self._last_landed is None else max(launched_at, self._last_landed)

    def forget(self) -> None:
        """Nothing is in flight any more (the engine went idle, or dropped its launched step):
        the next step starts when it is launched."""
        self._in_flight.clear()
        self._last_landed = None

    def predicted(self, kind: tuple[bool, int]) -> float | None:
        """The predicted device time of a step of `kind` (None: none seen yet)."""
        seen = self._durations.get(kind)
        return min(seen) if seen else None

    def deadline(self) -> float | None:
        """When to start planning the next step: the predicted end of the one step in
        flight, less the margin. None unless exactly one step is in flight and its group has
        been seen."""
        if len(self._in_flight) != 1:
            return None
        kind, launched_at = self._in_flight[0]
        duration = self.predicted(kind)
        if duration is None:
            return None
        start = self._start(launched_at)
        margin = (max(self._planning) if self._planning else 0.0) + self.safety_s
        return start + duration - margin
