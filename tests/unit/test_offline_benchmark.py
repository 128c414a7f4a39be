"""The offline benchmark's fairness between systems: no system is timed while another one's
threads still keep a core busy (`benchmarks.offline_throughput.settle`)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.offline_throughput import settle

SPIN = "import time, sys\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end: pass\n"


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs /proc/stat")
def test_settle_waits_out_a_spinning_process() -> None:
    """A process that keeps a core busy for 0.8 s after the caller's run: `settle` returns
    only after it ended (or at its cap)."""
    proc = subprocess.Popen([sys.executable, "-c", SPIN, "0.8"])
    time.sleep(0.2)  # the interpreter is up and spinning
    try:
        quiet = settle(20.0)
        assert proc.poll() is not None, f"settle returned while a core was busy: {quiet}"
        assert quiet["waited_s"] >= 0.4
        assert quiet["busy_cores"] < 0.1 or quiet["waited_s"] >= 20.0
    finally:
        proc.kill()
        proc.wait()


def test_settle_zero_does_not_wait() -> None:
    quiet = settle(0.0)
    assert quiet["waited_s"] < 0.05
