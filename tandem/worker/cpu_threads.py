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
loads, in `tandem.runtime_env`; see there for the figures.
"""

from __future__ import annotations

import functools
import logging
import os
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


def engine_process_cpu_cores(config: DeviceConfig) -> str:
    """What "auto" means in an engine-core process (see the module doc)."""
    if config.cpu_cores != "auto":
        return config.cpu_cores
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    if allowed and (config.num_threads <= 0 or config.num_threads >= len(allowed)):
        return "all"
    return "none"


def resolve_cpu_cores(config: DeviceConfig) -> tuple[int, ...] | None:
    """The cores to bind to (None: no binding), at most `num_threads` of them when set."""
    spec = config.cpu_cores
    if spec in ("auto", "none"):
        return None
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = tuple(allowed) if spec == "all" else parse_core_list(spec)
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
            got = cpu.bind_threads(list(cores))
            logger.info("engine threads bound to cores %s", got)
            return cores
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    return None


def default_cpu_backend() -> str:
    """The attention backend "auto" picks on a CPU: "cpu" (C++ kernels) when they build."""
    from tandem_kernels import cpu

    return "cpu" if cpu.available() else "torch"
