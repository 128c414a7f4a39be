"""The CPU container image has no Triton: every entry point and the CPU engine's modules must
import without it (Triton kernels are imported where they run, on CUDA). Checked in a child
process with `triton` blocked, as the image's own build step imports them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROGRAM = """
import sys
sys.modules["triton"] = None
import tandem.cli, tandem_services.common.entrypoint
from tandem.loader.model_loader import resolve_model_path
import tandem.engine.core, tandem.engine.core_client, tandem.worker.model_runner
import tandem.layers.quantization, tandem.layers.moe, tandem.models.registry
import tandem_services.worker.app, tandem_services.frontend.app
from tandem.layers.attention import get_attention_backend
get_attention_backend("cpu"); get_attention_backend("torch")
print("ok")
"""


def test_cpu_modules_import_without_triton() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROGRAM], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
