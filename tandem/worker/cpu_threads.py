"""CPU set-up of an engine: which cores its threads run on, and whether the CPU has bf16.

`DeviceConfig.cpu_cores` picks the cores ("0-3,8", "all", "none", "auto"); `--num-threads`
caps how many. With a core list, the engine's OpenMP pool gets one thread per core and thread
i is bound to core i (the calling thread is thread 0), through `tandem_kernels.cpu`; without
the extension, or with "none", only the thread count is set. "auto" is "none" here: binding an
engine on the caller's thread would pin the caller's own thread; the engine-core process (which
runs nothing else) turns "auto" into `engine_process_cpu_cores` before it builds its engine
(`core_proc`): "all" when the engine owns every core it may run on (no `--num-threads`, or at
least one per allowed core: a container's cpuset, a launcher's core set), else "none" (a thread
count below the allowed cores, as under a CPU quota: binding would stack every such engine on
the first cores).

The OpenMP wait policy (spinning vs sleeping between parallel regions) is set before torch
loads, in `tandem.runtime_env`: threads spin a bounded while, then sleep. Spinning is what a
step of many small ops needs on free cores, and what ruins it on busy ones (a spinning thread
holds the core the thread it waits for needs). `CpuThreadGovernor` resolves that at run time:
before each step it looks at how much of the engine's cores other processes used since it
last looked (`/proc/stat` less this process's own CPU time) and runs the step on as many
threads as there are cores left: all of them, bound, on a quiet machine; one, unbound, when
the others take a core (a team of one has no barrier to spin at).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.config import DeviceConfig, parse_core_list

logger = logging.getLogger(__name__)


@functools.cache
def cpu_supports_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic natively (avx512_bf16 or AMX-BF16), so bf16
    weights and activations run faster than fp32 rather than emulated."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return False
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


# The calling thread's cores before `setup_cpu_threads` first bound it (to one core: OpenMP's
# thread 0). None until then.
_cores_before_binding: tuple[int, ...] | None = None


def process_cpu_cores() -> tuple[int, ...]:
    """The cores this process may use: the calling thread's affinity, or what it was before
    an engine bound this thread. A second engine in the process (a benchmark's fp32 and bf16
    engines) must not read the first one's binding as the process's cores."""
    if _cores_before_binding is not None:
        return _cores_before_binding
    return tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()


def engine_process_cpu_cores(config: DeviceConfig) -> str:
    """What "auto" means in an engine-core process (see the module doc)."""
    if config.cpu_cores != "auto":
        return config.cpu_cores
    allowed = process_cpu_cores()
    if allowed and (config.num_threads <= 0 or config.num_threads >= len(allowed)):
        return "all"
    return "none"


def resolve_cpu_cores(config: DeviceConfig) -> tuple[int, ...] | None:
    """The cores to bind to (None: no binding), at most `num_threads` of them when set."""
    spec = config.cpu_cores
    if spec in ("auto", "none"):
        return None
    allowed = process_cpu_cores()
    cores = allowed if spec == "all" else parse_core_list(spec)
    if spec != "all" and allowed and not set(cores) <= set(allowed):
        raise ValueError(f"cpu_cores {spec!r} names cores this process may not use: {allowed}")
    if config.num_threads > 0:
        cores = cores[: config.num_threads]
    return cores or None


def setup_cpu_threads(config: DeviceConfig) -> tuple[int, ...] | None:
    """Set the engine's intra-op thread count and bind its threads (see the module doc).
    Returns the cores bound to, or None."""
    cores = resolve_cpu_cores(config)
    if cores is not None:
        from tandem_kernels import cpu

        if cpu.available():
            global _cores_before_binding
            if _cores_before_binding is None:
                _cores_before_binding = process_cpu_cores()
            got = cpu.bind_threads(list(cores))
            logger.info("engine threads bound to cores %s", got)
            return cores
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    return None


def read_busy_core_seconds(cores: frozenset[int]) -> float | None:
    """CPU seconds the machine has spent busy on `cores` since boot (every process, steal
    included; `/proc/stat`, in clock ticks), or None where there is no `/proc/stat`."""
    try:
        with open("/proc/stat", "rb") as f:
            lines = f.read().split(b"\n")
    except OSError:
        return None
    ticks = 0
    for line in lines[1:]:
        if not line.startswith(b"cpu"):
            break
        fields = line.split()
        if int(fields[0][3:]) in cores:
            values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
            ticks += sum(values) - values[3] - values[4]
    return ticks / os.sysconf("SC_CLK_TCK")


class CpuThreadGovernor:
    """Sizes the engine's OpenMP team to the cores other processes leave it (module doc).

    Every `interval_s` at most, `before_step` compares the busy time of the engine's cores
    with this process's CPU time over the window: what is left is the others' load, in
    cores. It drops to fewer threads when the others take more than `down_at` of a core
    beyond what the team leaves them, and grows back only when they leave a whole core
    free but `up_at` (hysteresis: the others' load is measured to about a clock tick a
    core). With bound cores, a full team is bound one thread a core and a smaller one runs
    unbound on those cores, where the kernel finds it a free one. A window longer than
    `max_window_s` (the engine sat idle between steps) tells what the others did while it
    was idle, not what they do now: it only starts a new window.

    Invariant: 1 <= threads <= max_threads; `rebind(n)` is called only on a change.
    """

    def __init__(
        self,
        cores: tuple[int, ...],
        max_threads: int,
        rebind: Callable[[int], None],
        *,
        interval_s: float = 0.1,
        max_window_s: float = 1.0,
        down_at: float = 0.4,
        up_at: float = 0.25,
        busy_seconds: Callable[[], float | None] | None = None,
        own_seconds: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cores = frozenset(cores)
        self.max_threads = max(1, max_threads)
        self.threads = self.max_threads
        self._rebind = rebind
        self.interval_s, self.max_window_s = interval_s, max_window_s
        self.down_at, self.up_at = down_at, up_at
        self._busy = busy_seconds or (lambda: read_busy_core_seconds(self.cores))
        self._own, self._clock = own_seconds, clock
        self.others_load = 0.0  # cores the other processes used over the last window
        self._last = self._sample()

    def _sample(self) -> tuple[float, float | None, float]:
        return self._clock(), self._busy(), self._own()

    def before_step(self) -> int:
        """Re-size the team if a window has passed; returns the threads the step runs on."""
        now = self._clock()
        if now - self._last[0] < self.interval_s:
            return self.threads
        sample = self._sample()
        (t0, busy0, own0), (t1, busy1, own1) = self._last, sample
        self._last = sample
        if busy0 is None or busy1 is None or t1 <= t0 or t1 - t0 > self.max_window_s:
            return self.threads
        self.others_load = max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)
        free = len(self.cores) - self.others_load  # cores the others leave this engine
        target = self.threads
        if free < self.threads - self.down_at:
            target = max(1, int(free + self.down_at))
        elif free >= self.threads + 1 - self.up_at:
            target = min(self.max_threads, int(free + self.up_at))
        if target != self.threads:
            logger.debug(
                "CPU threads %d -> %d (others use %.2f cores)",
                self.threads,
                target,
                self.others_load,
            )
            self.threads = target
            self._rebind(target)
        return self.threads


def make_cpu_thread_governor(
    config: DeviceConfig, bound: tuple[int, ...] | None
) -> CpuThreadGovernor | None:
    """The governor of an engine whose threads `setup_cpu_threads` set up (None: off by
    `--no-cpu-adaptive-threads`, or a single thread, where there is nothing to size)."""
    if not config.cpu_adaptive_threads:
        return None
    # Bound: the cores the engine was given (this thread is already bound to the first of
    # them, so its own affinity no longer tells them); unbound: the process's.
    cores = bound or process_cpu_cores()
    max_threads = torch.get_num_threads()
    if max_threads <= 1 or not cores or read_busy_core_seconds(frozenset(cores)) is None:
        return None

    def rebind(n: int) -> None:
        if bound is not None and n >= len(bound):
            from tandem_kernels import cpu

            cpu.bind_threads(list(bound))
            return
        torch.set_num_threads(n)
        if bound is not None:
            os.sched_setaffinity(0, bound)  # this (the step's) thread, free on all its cores

    return CpuThreadGovernor(cores, max_threads, rebind)


def default_cpu_backend() -> str:
    """The attention backend "auto" picks on a CPU: "cpu" (C++ kernels) when they build."""
    from tandem_kernels import cpu

    return "cpu" if cpu.available() else "torch"
