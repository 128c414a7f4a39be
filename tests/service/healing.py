"""Helpers of the healing tests (test_migration, test_chaos, test_supervision): `tandem serve`
as a child process, its workers found and killed by pid, streams read token by token, and the
session's one healing cluster (2 prefill + 2 decode workers; a killed worker always has a
survivor of its role while it restarts).

The fixtures are imported by conftest.py (the references are computed once per session).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest

from tandem_protos.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
HEAL_MAX_TOKENS = 24
# Prompts of the healing tests, short (decode-bound) ...
HEAL_PROMPTS = [f"Story {i}: once upon a time, in a land far away," for i in range(8)]
# ... and long (prefill-bound: ~400 tokens each, a second or more of prefill on a CPU; not
# longer: with one of the two prefill workers killed, the other computes them all, and steps of
# 10 s on a small shared machine push its Prefill answers past the scheduler's RPC timeout).
LONG_PROMPTS = [
    f"Note {i}. " + " ".join(f"The {w} of item {i} is number {j}." for j in range(32))
    for i, w in enumerate(["colour", "shape", "weight", "size"])
]
HEAL_ARGS = (
    "--max-model-len",
    "2048",
    "--num-gpu-blocks",
    "512",
    "--num-threads",
    "1",
)


@dataclass
class Serve:
    """A running `tandem serve`: its process, the addresses from its banner, all its output."""

    proc: subprocess.Popen[str]
    log_dir: Path
    lines: list[str] = field(default_factory=list)
    http: str = ""
    grpc: str = ""
    scheduler: str = ""

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_output(self, pattern: str, timeout_s: float, start: int = 0) -> re.Match[str]:
        """The first match of `pattern` in the output lines from line `start` on."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = re.search(pattern, "".join(self.lines[start:]))
            if m is not None:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} within {timeout_s}s in:\n{self.output}")
            time.sleep(0.1)

    def worker_pid(self, worker_id: str) -> int:
        """The pid of the launcher's child started with `--worker-id worker_id`."""
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])
            if ppid != self.proc.pid or b"--worker-id" not in cmdline:
                continue
            if cmdline[cmdline.index(b"--worker-id") + 1].decode() == worker_id:
                return int(entry)
        raise LookupError(f"no worker {worker_id} under {self.proc.pid}")

    def kill_worker(self, worker_id: str) -> None:
        os.kill(self.worker_pid(worker_id), signal.SIGKILL)

    def workers(self) -> scheduler_pb2.ListWorkersResponse:
        with grpc.insecure_channel(self.scheduler) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            return stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=30)

    def registered(self) -> set[str]:
        return {w.worker_id for w in self.workers().workers}

    def running(self) -> dict[str, int]:
        """Each registered worker's running requests (its Stats; a worker that does not
        answer, e.g. one just killed, is left out)."""
        counts: dict[str, int] = {}
        for w in self.workers().workers:
            try:
                with grpc.insecure_channel(w.address) as channel:
                    stats = worker_pb2_grpc.WorkerStub(channel).Stats(
                        worker_pb2.StatsRequest(), timeout=5
                    )
                counts[w.worker_id] = stats.num_running
            except grpc.RpcError:
                continue
        return counts

    def wait_registered(self, worker_ids: set[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not worker_ids <= self.registered():
            if time.monotonic() > deadline:
                raise AssertionError(f"{worker_ids - self.registered()} not registered")
            time.sleep(0.2)

    def idle_and_whole(self) -> bool:
        """Nothing queued or in flight at the scheduler; every worker's pool whole."""
        listed = self.workers()
        if listed.num_queued or listed.num_inflight:
            return False
        for w in listed.workers:
            with grpc.insecure_channel(w.address) as channel:
                s = worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=30)
            if (
                s.num_inflight
                or s.num_running
                or s.num_waiting
                or s.num_held
                or s.num_reserved
                or s.num_free_blocks != s.num_blocks
            ):
                return False
        return True

    def wait_idle_and_whole(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.idle_and_whole():
            if time.monotonic() > deadline:
                raise AssertionError(f"not idle and whole: {self.workers()}")
            time.sleep(0.2)

    def log(self, service: str) -> str:
        path = self.log_dir / f"{service}.log"
        return path.read_text(errors="replace") if path.exists() else ""


@contextmanager
def tandem_serve(args: list[str], log_dir: Path, timeout_s: float = 400) -> Iterator[Serve]:
    """`python -m tandem_services.launcher --http-port 0 --grpc-port 0 --log-dir LOG_DIR ARGS`
    until its banner is out; its output is collected by a thread. Killed on the way out if it
    is still running (a test that stops it checks how)."""
    cmd = [
        sys.executable,
        "-m",
        "tandem_services.launcher",
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
    serve = Serve(proc, log_dir)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            serve.lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + timeout_s
        while "Ctrl-C stops everything." not in serve.output:
            assert proc.poll() is None, "tandem serve exited early:\n" + serve.output
            assert time.monotonic() < deadline, serve.output
            time.sleep(0.1)
        out = serve.output
        http = re.search(r"HTTP \(OpenAI API\)\s+http://(\S+)/v1", out)
        grpc_address = re.search(r"gRPC\s+(\S+)", out)
        scheduler = re.search(r"scheduler\s+(\S+)", out)
        assert http and grpc_address and scheduler, out
        serve.http, serve.grpc, serve.scheduler = (
            http.group(1),
            grpc_address.group(1),
            scheduler.group(1),
        )
        yield serve
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(timeout=5)


@dataclass
class StreamResult:
    """One streamed completion: its text, tokens seen (chunks with text), and how it ended."""

    index: int
    text: str = ""
    num_chunks: int = 0
    status: int = 0
    finish_reason: str | None = None
    error: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.finish_reason is not None


async def stream_completion(
    client: httpx.AsyncClient,
    http: str,
    prompt: str,
    result: StreamResult,
    max_tokens: int = HEAL_MAX_TOKENS,
    timeout_s: float = 120.0,
) -> StreamResult:
    """Stream a greedy completion of `prompt` into `result` (updated as chunks come)."""
    t0 = time.monotonic()
    body = {
        "model": "default",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream(
                "POST", f"http://{http}/v1/completions", json=body, timeout=timeout_s
            ) as r:
                result.status = r.status_code
                if r.status_code != 200:
                    result.error = (await r.aread()).decode(errors="replace")
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            result.error = json.dumps(chunk["error"])
                            continue
                        for choice in chunk.get("choices", []):
                            if choice.get("text"):
                                result.text += choice["text"]
                                result.num_chunks += 1
                            if choice.get("finish_reason"):
                                result.finish_reason = choice["finish_reason"]
    except TimeoutError:
        result.error = f"no end within {timeout_s}s (client deadline)"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.seconds = time.monotonic() - t0
    return result


async def streams_flowing(
    client: httpx.AsyncClient, http: str, prompts: list[str], timeout_s: float = 120.0
) -> tuple[list[StreamResult], list[asyncio.Task[StreamResult]]]:
    """Start one greedy stream per prompt; return once each has 2 chunks out and none has
    ended (the moment to kill a worker mid-stream): their results and tasks."""
    results = [StreamResult(i) for i in range(len(prompts))]
    tasks = [
        asyncio.create_task(stream_completion(client, http, p, r))
        for p, r in zip(prompts, results, strict=True)
    ]
    deadline = time.monotonic() + timeout_s
    while min(r.num_chunks for r in results) < 2:
        assert time.monotonic() < deadline, results
        assert not any(t.done() for t in tasks), results  # all still streaming
        await asyncio.sleep(0.02)
    return results, tasks


def offline_greedy(prompts: list[str], max_tokens: int) -> list[str]:
    """The offline engine's greedy texts (the deployment must stream exactly these)."""
    from tandem import LLM, SamplingParams

    llm = LLM(
        model="default", dtype="float32", max_model_len=2048, num_gpu_blocks=512, num_threads=1
    )
    try:
        outs = llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False
        )
        return [o.outputs[0].text for o in outs]
    finally:
        llm.shutdown()


@dataclass(frozen=True)
class HealReference:
    texts: dict[str, str]


@pytest.fixture(scope="session")
def heal_reference() -> HealReference:
    """Greedy texts of HEAL_PROMPTS."""
    texts = offline_greedy(HEAL_PROMPTS, HEAL_MAX_TOKENS)
    return HealReference(dict(zip(HEAL_PROMPTS, texts, strict=True)))


@pytest.fixture(scope="session")
def long_reference() -> HealReference:
    """Greedy texts of LONG_PROMPTS."""
    texts = offline_greedy(LONG_PROMPTS, HEAL_MAX_TOKENS)
    return HealReference(dict(zip(LONG_PROMPTS, texts, strict=True)))


CLUSTER_WORKERS = {"prefill-0", "prefill-1", "decode-0", "decode-1"}


@pytest.fixture(scope="module")
def healing_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    """`tandem serve` with 2 prefill and 2 decode workers, restarts without limit (the chaos
    test kills a worker every few seconds). Per module: on a small machine its six idle
    processes would slow every later test of the session."""
    logs = tmp_path_factory.mktemp("logs-healing")
    args = [
        "--num-prefill-workers",
        "2",
        "--num-decode-workers",
        "2",
        "--max-worker-restarts",
        "1000",
        "--restart-backoff-s",
        "0.5",
        *HEAL_ARGS,
    ]
    with tandem_serve(args, logs) as serve:
        yield serve
        assert serve.proc.poll() is None, serve.output
        serve.proc.send_signal(signal.SIGINT)
        serve.proc.wait(timeout=60)
        assert "Traceback" not in serve.output, serve.output
