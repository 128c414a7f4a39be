"""Process-wide defaults for the OpenMP runtime, set before torch loads.

torch's CPU ops run on an OpenMP pool whose threads, after each parallel region, spin for a
while before they sleep. A step of many small ops needs the spinning (a sleeping thread takes
a wake-up per op); a busy machine is ruined by it (a spinning thread holds the core that the
thread it waits for needs). Measured on 2 shared cores, 30 small ops (a 64x576x1536 matmul,
adds, a norm) took 965-1952 ms with 2 threads spinning, 61-377 ms with 2 threads sleeping,
163-184 ms on 1 thread; on the 2 quiet cores, the fp32 offline workload
(`benchmarks/offline_throughput.py`) did 182.8 output tok/s sleeping (`OMP_WAIT_POLICY=
passive`) against 205.6, 213.8, 199.3 and 209.2 spinning 3,000, 30,000 and 300,000 times and
without end (`active`), one run each.

So the pool spins a bounded 30,000 times (`GOMP_SPINCOUNT`; milliseconds at most), and the
engine itself stops the spinning from hurting: on a busy machine its step runs on one thread,
which has no team to wait for (`tandem.worker.cpu_threads.CpuThreadGovernor`). The runtime
reads these variables once, when it loads, so they are set when `tandem` is imported (before
torch, in every tandem process and in each spawned engine process, which inherits them); a
user's `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` is kept, and then none is set.
"""

from __future__ import annotations

import os
import sys

OPENMP_DEFAULTS = {"GOMP_SPINCOUNT": "30000"}

# Any of these set by the user: the user's wait policy stands, nothing is added to it.
_USER_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def set_openmp_defaults() -> bool:
    """Set `OPENMP_DEFAULTS` in this process's environment unless the user chose a wait
    policy. Returns False when torch is already loaded (too late for this process; children
    still inherit them)."""
    if not any(name in os.environ for name in _USER_WAIT_VARIABLES):
        for name, value in OPENMP_DEFAULTS.items():
            os.environ.setdefault(name, value)
    return "torch" not in sys.modules
