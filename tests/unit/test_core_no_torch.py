"""tandem.core is plain Python: importing it must not load torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import sys
import tandem.core.block_pool
import tandem.core.kv_cache_manager
import tandem.core.kv_cache_utils
import tandem.core.outputs
import tandem.core.scheduler
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not loaded, loaded
print("ok")
"""


def test_importing_the_core_does_not_load_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
