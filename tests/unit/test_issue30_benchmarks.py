"""Issue 30's benchmark pieces that run without a GPU: the long-context loads, their per-class
figures, the kernel table's checks (SDPA and the torch reference on the CPU) and the bench
client's readiness wait against a small HTTP server that is not ready, then ready."""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.attention_kernels import main as kernels_main
from benchmarks.attention_kernels import parse_shapes
from benchmarks.attention_kernels import sdpa_rows as kernels_rows
from benchmarks.serving import class_summary, long_context_workloads
from tandem_services.bench.metrics import RequestResult
from tandem_services.bench.ready import NotReadyError, wait_until_serving


def test_long_context_loads() -> None:
    short_only, mixed, is_long = long_context_workloads(
        40, (100, 10, 0.5), (2000, 8, 0.6), 0.1, 5000, seed=3
    )
    assert short_only.num_requests == mixed.num_requests == len(is_long) == 40
    assert sum(is_long) == 4
    for prompt, out, flag in zip(mixed.prompts, mixed.output_lens, is_long, strict=True):
        lo, hi = (800, 3200) if flag else (50, 150)
        assert lo <= len(prompt) <= hi
        assert out <= (12 if flag else 15)
    assert all(50 <= len(p) <= 150 for p in short_only.prompts)
    # Fresh short prompts in the mixed load: no prefix-cache hit carries over.
    assert not {tuple(p[:16]) for p in short_only.prompts} & {tuple(p[:16]) for p in mixed.prompts}
    again = long_context_workloads(40, (100, 10, 0.5), (2000, 8, 0.6), 0.1, 5000, seed=3)
    assert again[1].prompts == mixed.prompts and again[2] == is_long
    with pytest.raises(ValueError, match="long-fraction"):
        long_context_workloads(4, (10, 2, 0.0), (20, 2, 0.0), 1.5, 500, seed=0)


def test_class_summary_splits_long_and_short() -> None:
    def result(ttft_s: float, tpot_s: float, ok: bool = True) -> RequestResult:
        r = RequestResult(10, output_len=5, ttft_s=ttft_s, e2e_s=ttft_s + 4 * tpot_s, ok=ok)
        if not ok:
            r.error = "got 0 tokens"
        return r

    results = [result(0.01, 0.002), result(0.5, 0.004), result(0.02, 0.003), result(9, 9, False)]
    s = class_summary(results, [False, True, False, False])
    assert (s["short"]["num"], s["short"]["num_ok"], s["long"]["num_ok"]) == (3, 2, 1)
    assert s["short"]["ttft_ms"]["p50"] == pytest.approx(15.0)
    assert s["short"]["tpot_ms"]["p99"] == pytest.approx(2.99, abs=0.01)
    assert s["long"]["ttft_ms"]["p50"] == pytest.approx(500.0)
    assert s["short"]["errors"] == ["got 0 tokens"]


def test_kernel_table_checks_sdpa_against_the_reference(tmp_path: Path) -> None:
    out = tmp_path / "k.json"
    argv = ["--device", "cpu", "--dtype", "float32", "--prefill", "2x40", "--decode", "3x50"]
    assert kernels_main([*argv, "--backends", "sdpa,flashinfer", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    prefill, decode = report["shapes"]
    assert (prefill["seq_len"], prefill["query_rows"], decode["query_rows"]) == (40, 80, 3)
    # Causal FLOPs: 4 * (visible keys) * heads * head size.
    assert prefill["flops"] == 4 * 2 * (40 * 41 / 2) * 32 * 128
    for row in (prefill, decode):
        sdpa = row["backends"]["sdpa"]
        assert sdpa["matches_reference"] is True and sdpa["max_abs_err"] < 1e-4
        assert "flashinfer" in report["unavailable"]
        assert "unavailable" in row["backends"]["flashinfer"]
    assert decode["kv_bytes"] == 3 * 50 * 8 * 128 * 2 * 4
    with pytest.raises(ValueError, match="REQUESTSxTOKENS"):
        parse_shapes("8x")


def test_kernel_table_reports_a_wrong_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import benchmarks.attention_kernels as kernels

    monkeypatch.setattr(kernels, "sdpa_rows", lambda o: torch.zeros_like(kernels_rows(o)))
    out = tmp_path / "k.json"
    argv = ["--device", "cpu", "--dtype", "float32", "--prefill", "1x24", "--decode", ""]
    assert kernels_main([*argv, "--backends", "sdpa", "--out", str(out)]) == 1
    (row,) = json.loads(out.read_text())["shapes"]
    assert row["backends"]["sdpa"]["matches_reference"] is False


@contextlib.contextmanager
def models_server(statuses: list[int]) -> Iterator[tuple[str, list[int]]]:
    """An HTTP server whose /v1/models answers `statuses` in turn (503s with Retry-After:
    0.1), then the last one again; yields its address and the statuses it sent."""
    seen: list[int] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status = statuses[min(len(seen), len(statuses) - 1)]
            seen.append(status)
            self.send_response(status)
            if status == 503:
                self.send_header("Retry-After", "0.1")
            self.end_headers()
            self.wfile.write(b'{"object": "list"}')

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_readiness_wait_until_200() -> None:
    said: list[str] = []
    with models_server([503, 503, 200]) as (address, seen):
        waited = wait_until_serving(address, 10.0, log=said.append)
    assert seen == [503, 503, 200] and waited >= 0.2
    assert "waiting for" in said[0] and "200 after" in said[-1]
    # A wrong API key ends the wait at once; a server without /v1/models is not waited on.
    with models_server([401]) as (address, seen), pytest.raises(NotReadyError, match="401"):
        wait_until_serving(address, 10.0, log=said.append)
    with models_server([404]) as (address, seen):
        wait_until_serving(address, 10.0, log=said.append)
    assert seen == [404] and "readiness not awaited" in said[-1]


def test_readiness_wait_gives_up_naming_the_last_answer() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    with pytest.raises(NotReadyError, match=rf"127.0.0.1:{port}/v1/models did not answer 200"):
        wait_until_serving(f"http://127.0.0.1:{port}", 0.3, log=lambda _: None)
