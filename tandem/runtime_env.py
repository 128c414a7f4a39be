"""Process-wide defaults for the OpenMP runtime, set before torch loads.

torch's CPU ops run on an OpenMP pool whose threads, by default, spin for a while after each
parallel region before they sleep. On a machine whose cores are busy with other processes (the
frontend, the scheduler, other workers, other tenants) the spinning threads take the cores the
others need, and a step of many small ops waits on threads that are descheduled: measured on 2
shared cores, 30 small ops (a 64x576x1536 matmul, adds, a norm) took 965-1952 ms with 2
threads spinning, 61-377 ms with 2 threads sleeping (`OMP_WAIT_POLICY=passive`), 163-184 ms on
1 thread. The runtime reads these variables once, when it loads, so they are set when `tandem`
is imported (before torch, in every tandem process and in each spawned engine process, which
inherits them); a value the user set is kept.
"""

from __future__ import annotations

import os
import sys

OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def set_openmp_defaults() -> bool:
    """Set `OPENMP_DEFAULTS` in this process's environment where unset. Returns False when
    torch is already loaded (too late for this process; children still inherit them)."""
    for name, value in OPENMP_DEFAULTS.items():
        os.environ.setdefault(name, value)
    return "torch" not in sys.modules
