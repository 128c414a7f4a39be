"""Supervision of a running deployment: a worker that dies is started again.

    worker exits ──▶ crash recorded ──▶ more than `max_worker_restarts` crashes within
                                        `restart_window_s`?  yes ──▶ stop everything (a reason)
                                                             no  ──▶ restart after a back-off
    restart due ──▶ same command line, fresh port ──▶ ready file ──▶ registered, takes load

The back-off doubles with each crash still inside the window (`restart_backoff_s`, 2x, ...,
capped at `restart_backoff_max_s`). A worker that dies while starting again counts as another
crash. The scheduler and the frontend hold the deployment's state (admission queue, client
connections): when either exits, supervision gives up at once and says so. The restarted
worker registers with the scheduler under the same worker id; the scheduler has already
dropped the dead one (its load-report stream ended) and the frontend has migrated its
requests (frontend/tracker.py), so the new process starts empty and is routed new work.

`Supervisor.poll` is called from the launcher's foreground loop; it never blocks.
"""

from __future__ import annotations

import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem_services.launcher.deployment import Deployment, read_ready, respawn_service

# Services whose loss ends the deployment (they are not restarted).
_UNSUPERVISED = ("scheduler", "frontend")


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead worker is started again, and when supervision gives up."""

    # Crashes of one worker allowed within `restart_window_s`; one more stops everything.
    max_worker_restarts: int = 5
    restart_window_s: float = 60.0
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_worker_restarts < 0:
            raise ValueError(f"max_worker_restarts must be >= 0, got {self.max_worker_restarts}")
        if self.restart_window_s <= 0:
            raise ValueError(f"restart_window_s must be > 0, got {self.restart_window_s}")
        if not 0 <= self.restart_backoff_s <= self.restart_backoff_max_s:
            raise ValueError(
                "need 0 <= restart_backoff_s <= restart_backoff_max_s, got "
                f"{self.restart_backoff_s} and {self.restart_backoff_max_s}"
            )

    def backoff_s(self, num_recent_crashes: int) -> float:
        """The delay before a restart after `num_recent_crashes` (>= 1) in the window."""
        return min(
            self.restart_backoff_s * 2 ** (num_recent_crashes - 1), self.restart_backoff_max_s
        )


@dataclass
class _WorkerState:
    crashes: deque[float] = field(default_factory=deque)
    restart_at: float | None = None
    # Started again, ready file not yet written.
    starting: bool = False
    restarts: int = 0


def describe_exit(returncode: int) -> str:
    """ "exited with code 3" or "was killed by SIGKILL"."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


class Supervisor:
    """Restarts the workers of `deployment` under `policy`; `poll` says when to give up."""

    def __init__(
        self,
        deployment: Deployment,
        policy: RestartPolicy,
        log: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.deployment = deployment
        self.policy = policy
        self._log = log
        self._clock = clock
        self._workers = {
            name: _WorkerState() for name in deployment.services if name not in _UNSUPERVISED
        }

    @property
    def num_restarts(self) -> int:
        """Workers started again so far (all of them)."""
        return sum(w.restarts for w in self._workers.values())

    def poll(self) -> str | None:
        """Check every service once: record crashes, start due restarts, notice restarted
        workers that are ready. Returns why the deployment must stop, or None."""
        now = self._clock()
        services = self.deployment.services
        for name in _UNSUPERVISED:
            service = services.get(name)
            if service is not None and service.process.poll() is not None:
                return f"{name} {describe_exit(service.process.returncode)}"
        for name, state in self._workers.items():
            service = services[name]
            if state.restart_at is not None:
                if now >= state.restart_at:
                    state.restart_at = None
                    state.starting = True
                    state.restarts += 1
                    services[name] = respawn_service(self.deployment, service)
                    self._log(f"{name}: starting again (restart {state.restarts})")
                continue
            code = service.process.poll()
            if code is None:
                if state.starting:
                    info = read_ready(service.ready_file)
                    if info is not None:
                        service.info = info
                        state.starting = False
                        self._log(f"{name}: restarted, serving at {info.get('grpc', '?')}")
                continue
            why = describe_exit(code) + (" while starting" if state.starting else "")
            state.starting = False
            state.crashes.append(now)
            while state.crashes and now - state.crashes[0] > self.policy.restart_window_s:
                state.crashes.popleft()
            recent = len(state.crashes)
            if recent > self.policy.max_worker_restarts:
                return (
                    f"{name} {why}: {recent} crashes within {self.policy.restart_window_s:g} s "
                    f"(--max-worker-restarts {self.policy.max_worker_restarts}, "
                    f"--restart-window-s {self.policy.restart_window_s:g})"
                )
            delay = self.policy.backoff_s(recent)
            state.restart_at = now + delay
            self._log(
                f"{name} {why}; restarting in {delay:.1f} s (crash {recent} of "
                f"{self.policy.max_worker_restarts} allowed within "
                f"{self.policy.restart_window_s:g} s)"
            )
        return None
