"""Two spawned processes moving KV blocks, for the connector tests: a decode process that
reserves blocks and reports its cache, and a prefill process that sends jobs to it."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_kv_pair(
    decode_main: Callable[..., None],
    prefill_main: Callable[..., None],
    reservations: dict[str, list[int]],
    jobs: dict[str, Any],
    out: Path,
    *,
    start_timeout_s: float,
    finish_timeout_s: float,
) -> tuple[Any, Any]:
    """Start `decode_main(conn, reservations, out)`, which sends its address and, told
    "stop", its report (writing its cache to `out`); then `prefill_main(conn, address, jobs)`,
    which sends its result. Returns (prefill result, decode report); both processes are gone
    afterwards (killed when they outlive 30 s past the end)."""
    ctx = mp.get_context("spawn")
    decode_conn, decode_child = ctx.Pipe()
    prefill_conn, prefill_child = ctx.Pipe()
    decode = ctx.Process(target=decode_main, args=(decode_child, reservations, str(out)))
    decode.start()
    prefill = None
    try:
        assert decode_conn.poll(start_timeout_s), "the decode process did not start"
        address = decode_conn.recv()
        prefill = ctx.Process(target=prefill_main, args=(prefill_child, address, jobs))
        prefill.start()
        assert prefill_conn.poll(finish_timeout_s), "the prefill process did not finish"
        result = prefill_conn.recv()
        decode_conn.send("stop")
        assert decode_conn.poll(60), "the decode process did not report"
        report = decode_conn.recv()
    finally:
        for p in (prefill, decode):
            if p is not None:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return result, report
