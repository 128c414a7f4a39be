"""Supervision (issue 15): `tandem serve` restarts a worker that dies, the new process
registers and takes load; one crash more than `--max-worker-restarts` within
`--restart-window-s` stops the whole deployment with one line naming why, exit code 1, and
no traceback anywhere; a request still in flight then ends with 503 and Retry-After within the
grace period."""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from tandem_protos.v1 import worker_pb2, worker_pb2_grpc
from tests.service.healing import HEAL_ARGS, tandem_serve

pytestmark = pytest.mark.timeout(600)


def _complete(http: str, prompt: str) -> str:
    r = httpx.post(
        f"http://{http}/v1/completions",
        json={"model": "default", "prompt": prompt, "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def _listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) == 0


def test_worker_restarted_then_too_many_crashes_stop_everything(tmp_path: Path) -> None:
    args = [
        "--unified",
        "--max-worker-restarts",
        "1",
        "--restart-window-s",
        "600",
        "--restart-backoff-s",
        "0.2",
        "--grace-period-s",
        "3",
        *HEAL_ARGS,
    ]
    with tandem_serve(args, tmp_path) as serve:
        text = _complete(serve.http, "The capital of France is")
        first = next(w for w in serve.workers().workers if w.worker_id == "unified-0")
        old_pid = serve.worker_pid("unified-0")

        # Crash 1 of 1 allowed: restarted; the new process registers and serves.
        mark = len(serve.lines)
        serve.kill_worker("unified-0")
        serve.wait_output(r"unified was killed by SIGKILL; restarting in 0\.2 s", 30, mark)
        serve.wait_output(r"unified: restarted, serving at", 300, mark)
        serve.wait_registered({"unified-0"}, 30)
        assert serve.worker_pid("unified-0") != old_pid
        again = next(w for w in serve.workers().workers if w.worker_id == "unified-0")
        assert again.address != first.address
        assert _complete(serve.http, "The capital of France is") == text
        with grpc.insecure_channel(again.address) as channel:
            stats = worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest())
        assert stats.prefix_cache_queries > 0  # the new process took that request

        # Crash 2 within the window: one more than allowed; everything stops, and says why.
        # A request in flight then has no worker left: it ends with 503 at the grace period.
        inflight: list[httpx.Response] = []
        body = {"model": "default", "prompt": "Count:", "max_tokens": 500, "ignore_eos": True}
        sender = threading.Thread(
            target=lambda: inflight.append(
                httpx.post(f"http://{serve.http}/v1/completions", json=body, timeout=120)
            )
        )
        sender.start()
        deadline = time.monotonic() + 60
        while not stats.num_running:
            assert time.monotonic() < deadline
            with grpc.insecure_channel(again.address) as channel:
                stats = worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest())
        t0 = time.monotonic()
        serve.kill_worker("unified-0")
        code = serve.proc.wait(timeout=60)
        took = time.monotonic() - t0
        sender.join(timeout=30)
        assert inflight and inflight[0].status_code == 503, inflight
        assert "shutting down" in inflight[0].json()["error"]["message"]
        assert inflight[0].headers.get("retry-after") == "1", inflight[0].headers
        time.sleep(0.5)  # the output thread reads the last lines
        out = serve.output
        assert code == 1, out
        assert re.search(
            r"unified was killed by SIGKILL: 2 crashes within 600 s \(--max-worker-restarts 1, "
            r"--restart-window-s 600\); stopping everything",
            out,
        ), out
        assert took < 40, took
        assert "Traceback" not in out, out
        for log in tmp_path.glob("*.log"):
            assert "Traceback" not in log.read_text(errors="replace"), log
        for address in (serve.http, serve.grpc, serve.scheduler):
            assert not _listening(address), address
