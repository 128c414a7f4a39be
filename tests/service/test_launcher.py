"""`tandem serve --unified`: prints its addresses, serves, and stops everything on Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import WORKER_ARGS

pytestmark = pytest.mark.timeout(400)
ROOT = Path(__file__).resolve().parents[2]


def _listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) == 0


def test_tandem_serve_unified_ctrl_c(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "tandem.cli",
        "serve",
        "--unified",
        "--http-port",
        "0",
        "--grpc-port",
        "0",
        "--log-dir",
        str(tmp_path),
        *WORKER_ARGS,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 300
        while "Ctrl-C stops everything." not in "".join(lines):
            line = proc.stdout.readline()
            assert line, "tandem serve exited early:\n" + "".join(lines)
            lines.append(line)
            assert time.monotonic() < deadline
        out = "".join(lines)
        http = re.search(r"HTTP \(OpenAI API\)\s+http://(\S+)/v1", out)
        grpc_addr = re.search(r"gRPC\s+(\S+)", out)
        scheduler = re.search(r"scheduler\s+(\S+)", out)
        worker = re.search(r"workers\s+unified (\S+)", out)
        assert http and grpc_addr and scheduler and worker, out
        r = httpx.post(
            f"http://{http.group(1)}/v1/completions",
            json={"model": "default", "prompt": "Hello", "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        proc.send_signal(signal.SIGINT)  # what Ctrl-C delivers to the launcher
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out + rest
        assert "tandem serve: stopped" in rest
        for address in (http.group(1), grpc_addr.group(1), scheduler.group(1), worker.group(1)):
            assert not _listening(address), address
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
