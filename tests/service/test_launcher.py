"""`tandem serve --unified`: prints its addresses, serves, and stops everything on Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import WORKER_ARGS

pytestmark = pytest.mark.timeout(400)
ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def tandem_serve(
    args: list[str], log_dir: Path, timeout_s: float
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`tandem serve --http-port 0 --grpc-port 0 --log-dir LOG_DIR ARGS` as a child process:
    yields it with its output up to "Ctrl-C stops everything." (within `timeout_s`); kills it
    on the way out if it is still running."""
    cmd = [
        sys.executable,
        "-m",
        "tandem.cli",
        "serve",
        "--http-port",
        "0",
        "--grpc-port",
        "0",
        "--log-dir",
        str(log_dir),
        *args,
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
        deadline = time.monotonic() + timeout_s
        while "Ctrl-C stops everything." not in "".join(lines):
            line = proc.stdout.readline()
            assert line, "tandem serve exited early:\n" + "".join(lines)
            lines.append(line)
            assert time.monotonic() < deadline
        yield proc, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) == 0


# The frontend's flags, given to `tandem serve` (forwarded to its frontend).
FRONTEND_FLAGS = [
    *("--served-model-name", "smol"),
    *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
    *("--max-n", "2"),
]


def test_tandem_serve_unified_ctrl_c(tmp_path: Path) -> None:
    """Also: the frontend's flags on `tandem serve` reach its frontend (the served name, tool
    choice "auto" with a parser, a request limit, --generation-config: a folder whose
    generation_config.json makes requests that leave temperature out greedy, and whose
    max_new_tokens caps every output)."""
    defaults = tmp_path / "generation"
    defaults.mkdir()
    (defaults / "generation_config.json").write_text(
        '{"temperature": 0.0, "top_k": 5, "max_new_tokens": 6}'
    )
    flags = [*FRONTEND_FLAGS, "--generation-config", str(defaults)]
    with tandem_serve(["--unified", *WORKER_ARGS, *flags], tmp_path, 300) as (proc, out):
        http = re.search(r"HTTP \(OpenAI API\)\s+http://(\S+)/v1", out)
        grpc_addr = re.search(r"gRPC\s+(\S+)", out)
        scheduler = re.search(r"scheduler\s+(\S+)", out)
        worker = re.search(r"workers\s+unified (\S+)", out)
        assert http and grpc_addr and scheduler and worker, out
        base = f"http://{http.group(1)}/v1"
        models = httpx.get(f"{base}/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["smol"]
        r = httpx.post(
            f"{base}/completions",
            json={"model": "smol", "prompt": "Hello", "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        bodies = [
            httpx.post(
                f"{base}/completions",
                json={"prompt": "Once upon a time", "max_tokens": 16, **extra},
                timeout=120,
            ).json()
            for extra in ({}, {"temperature": 0})
        ]
        texts = [body["choices"][0]["text"] for body in bodies]
        assert texts[0] == texts[1], texts  # temperature left out: the folder's 0
        # max_tokens 16 asked, the folder's max_new_tokens 6 kept.
        assert [body["usage"]["completion_tokens"] for body in bodies] == [6, 6], bodies
        assert bodies[0]["choices"][0]["finish_reason"] == "length"
        chat = httpx.post(
            f"{base}/chat/completions",
            json={"messages": [{"role": "user", "content": "Tell me a long story."}]},
            timeout=120,
        ).json()
        assert chat["usage"]["completion_tokens"] <= 6, chat  # none asked: the cap, not the context
        many = httpx.post(f"{base}/completions", json={"prompt": "Hi", "n": 3}, timeout=30)
        assert many.status_code == 400 and many.json()["error"]["param"] == "n", many.text
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        auto = httpx.post(
            f"{base}/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Hi"}],
                "tools": [tool],
                "max_tokens": 4,
            },
            timeout=120,
        )
        assert auto.status_code == 200, auto.text  # "auto" needs the parser flags
        proc.send_signal(signal.SIGINT)  # what Ctrl-C delivers to the launcher
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out + rest
        assert "tandem serve: stopped" in rest
        for address in (http.group(1), grpc_addr.group(1), scheduler.group(1), worker.group(1)):
            assert not _listening(address), address
