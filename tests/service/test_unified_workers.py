"""`tandem serve --unified --num-unified-workers 2`: two unified workers (ids unified-0 and
unified-1) behind one scheduler; concurrent requests are spread over both, each answered, and
Ctrl-C stops everything. A tiny random Llama keeps the start-up light."""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from tandem_protos.v1 import (
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.service.test_launcher import tandem_serve

pytestmark = pytest.mark.timeout(300)
NUM_REQUESTS = 8


def _stats(address: str) -> common_pb2.WorkerStats:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=30)


def test_two_unified_workers_share_the_load(
    tmp_path: Path, tiny_model_path: Callable[[str], Path]
) -> None:
    model = str(tiny_model_path("llama"))
    args = ["--unified", "--num-unified-workers", "2", "--model", model]
    args += ["--max-model-len", "512", "--num-gpu-blocks", "64", "--num-threads", "1"]
    with tandem_serve(args, tmp_path, 240) as (proc, out):
        assert "2 unified worker(s)" in out
        http = re.search(r"HTTP \(OpenAI API\)\s+http://(\S+)/v1", out)
        scheduler = re.search(r"scheduler\s+(\S+)", out)
        workers = re.search(r"workers\s+unified (\S+), unified-1 (\S+)", out)
        assert http and scheduler and workers, out

        with grpc.insecure_channel(scheduler.group(1)) as channel:
            listed = scheduler_pb2_grpc.SchedulerStub(channel).ListWorkers(
                scheduler_pb2.ListWorkersRequest(), timeout=30
            )
        assert sorted(w.worker_id for w in listed.workers) == ["unified-0", "unified-1"]

        # Distinct prompts (no shared prefix to route by), all in flight at once.
        prompts = [f"request {i}: " + "lorem ipsum dolor " * 6 for i in range(NUM_REQUESTS)]

        def complete(prompt: str) -> httpx.Response:
            return httpx.post(
                f"http://{http.group(1)}/v1/completions",
                json={"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0},
                timeout=120,
            )

        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            responses = list(pool.map(complete, prompts))
        for r in responses:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 6

        served = [_stats(a).prefix_cache_queries for a in workers.groups()]
        assert all(n > 0 for n in served), f"prompt tokens looked up per worker: {served}"
        for address in workers.groups():
            s = _stats(address)
            assert s.num_inflight == 0 and s.num_free_blocks == s.num_blocks

        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out + rest
        assert "tandem serve: stopped" in rest
