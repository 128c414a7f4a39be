"""The load generator's clients: streamed `Generate` over gRPC and `/v1/completions` over
HTTP with server-sent events, paced by a schedule of arrival times, in one process or spread
over several (`num_procs`), with the CPU they used.

Cheap by construction, so that the client is never what a benchmark measures:

- gRPC: each streamed `GenerateResponse` is parsed once (by the protobuf runtime, in C); the
  per-message Python work is one clock read, one append and a token count.
- HTTP: no HTTP library on the hot path. Each request is one connection driven by an
  `asyncio.Protocol` whose `data_received` only reads the clock and keeps the bytes; the
  response is de-chunked, split into events and JSON-parsed once, after it ended, each event
  stamped with the time its last byte arrived.
- Over `num_procs` processes the requests are dealt round robin (request i to process
  i % num_procs), each process keeps the global arrival offsets of its requests from one
  shared start instant, and the results are merged back in request order: the same schedule
  as one process, its CPU spread.

Process CPU is read with getrusage (user + system, all threads, gRPC's included).
"""

from __future__ import annotations

import asyncio
import bisect
import json
import math
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tandem_services.bench.metrics import ClientCpu, RequestResult, process_cpu_s, record_times
from tandem_services.bench.workload import Workload, arrival_times

Send = Callable[[int, RequestResult], Awaitable[None]]


@dataclass(frozen=True)
class Target:
    """Where and how requests go. `address`: host:port for gRPC, http://host:port for HTTP."""

    backend: str
    address: str
    api_key: str = ""
    model: str = "default"
    ignore_eos: bool = True

    def __post_init__(self) -> None:
        if self.backend not in ("grpc", "http"):
            raise ValueError(f"backend must be grpc or http, got {self.backend!r}")


@dataclass(frozen=True)
class LoadRun:
    """One rate's results (in request order), its duration and the client's CPU."""

    results: list[RequestResult]
    duration_s: float
    cpu: ClientCpu


def _check_len(result: RequestResult, wanted: int, ignore_eos: bool) -> None:
    result.ok = result.output_len == wanted if ignore_eos else 0 < result.output_len <= wanted
    if not result.ok:
        result.error = f"got {result.output_len} tokens"


# ----------------------------------------------------------------------------- pacing


async def paced(
    arrivals: Sequence[float],
    results: list[RequestResult],
    start_at: float,
    max_concurrency: int,
    send: Send,
) -> float:
    """Send request i at `start_at + arrivals[i]` (perf_counter clock), at most
    `max_concurrency` in flight (0: no cap); returns when the last one ended (perf_counter)."""
    sem = asyncio.Semaphore(max_concurrency if max_concurrency > 0 else max(1, len(arrivals)))

    async def one(i: int) -> None:
        delay = start_at + arrivals[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with sem:
            try:
                await send(i, results[i])
            except Exception as exc:
                results[i].ok = False
                results[i].error = f"{type(exc).__name__}: {exc}"[:200]

    await asyncio.gather(*(one(i) for i in range(len(arrivals))))
    return time.perf_counter()


# ----------------------------------------------------------------------------- gRPC


def grpc_request(prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> Any:
    """The `GenerateRequest` of one benchmark prompt (greedy)."""
    from tandem_protos.v1 import common_pb2, frontend_pb2

    return frontend_pb2.GenerateRequest(
        token_ids=frontend_pb2.TokenIds(ids=prompt),
        sampling_params=common_pb2.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos
        ),
    )


async def grpc_stream(stub: Any, request: Any, result: RequestResult, api_key: str = "") -> None:
    """One streamed `Generate`: message times and the token count into `result`."""
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
    times: list[float] = []
    append, clock = times.append, time.perf_counter
    tokens = 0
    t_send = clock()
    async for resp in stub.Generate(request, metadata=metadata):
        t = clock()
        n = 0
        for choice in resp.choices:
            n += len(choice.token_ids)
        if n:
            append(t)
            tokens += n
    record_times(result, t_send, times)
    result.output_len = tokens


def grpc_channel(address: str) -> Any:
    import grpc

    return grpc.aio.insecure_channel(
        address, options=[("grpc.max_receive_message_length", 64 << 20)]
    )


async def _run_grpc(
    target: Target,
    workload: Workload,
    arrivals: Sequence[float],
    max_concurrency: int,
    results: list[RequestResult],
    start: Callable[[], float],
) -> float:
    from tandem_protos.v1 import frontend_pb2_grpc

    async with grpc_channel(target.address) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        stub = frontend_pb2_grpc.FrontendStub(channel)
        requests = [
            grpc_request(p, n, target.ignore_eos)
            for p, n in zip(workload.prompts, workload.output_lens, strict=True)
        ]

        async def send(i: int, result: RequestResult) -> None:
            await grpc_stream(stub, requests[i], result, target.api_key)
            _check_len(result, workload.output_lens[i], target.ignore_eos)

        return await paced(arrivals, results, start(), max_concurrency, send)


# ----------------------------------------------------------------------------- HTTP / SSE


class _Recorder(asyncio.Protocol):
    """Keeps every byte of one HTTP response with the time it arrived; nothing else on the
    hot path. `done` resolves when the server closes or the last chunk (`0\\r\\n\\r\\n`) is in."""

    def __init__(self, done: asyncio.Future[None]) -> None:
        self.done = done
        self.parts: list[bytes] = []
        self.times: list[float] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.times.append(time.perf_counter())
        self.parts.append(data)
        if data.endswith(b"0\r\n\r\n") and self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            if exc is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(exc)


def sse_events(
    parts: Sequence[bytes], times: Sequence[float]
) -> tuple[int, list[tuple[bytes, float]]]:
    """The HTTP status and the server-sent events of one response received as `parts` at
    `times`: each event's payload (after `data: `) with the time its last byte arrived.
    Handles chunked and close-delimited bodies; events may span reads and chunks."""
    raw = b"".join(parts)
    ends = []
    total = 0
    for p in parts:
        total += len(p)
        ends.append(total)

    def time_at(offset: int) -> float:
        return times[min(bisect.bisect_left(ends, offset), len(times) - 1)]

    head_end = raw.find(b"\r\n\r\n")
    if head_end < 0:
        raise ValueError("no complete response head")
    head = raw[:head_end].decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    chunked = any(
        h.lower().startswith("transfer-encoding:") and "chunked" in h.lower() for h in head[1:]
    )
    pos = head_end + 4
    pieces: list[tuple[bytes, float]] = []  # de-chunked body pieces, each with its time
    if chunked:
        while pos < len(raw):
            eol = raw.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(raw[pos:eol].split(b";")[0], 16)
            if size == 0:
                break
            start, stop = eol + 2, eol + 2 + size
            pieces.append((raw[start:stop], time_at(stop)))
            pos = stop + 2
    else:
        for p_end, t in zip(ends, times, strict=True):
            if p_end > pos:
                pieces.append((raw[pos:p_end], t))
                pos = p_end
    events: list[tuple[bytes, float]] = []
    buf = b""
    for data, t in pieces:
        buf += data
        *complete, buf = buf.split(b"\n\n")
        for ev in complete:
            if ev.startswith(b"data: "):
                events.append((ev[6:], t))
    return status, events


def http_request(url: str, body: dict[str, Any], api_key: str = "") -> tuple[str, int, bytes]:
    """host, port and the bytes of one `POST /v1/completions` (connection: close)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payload = json.dumps(body, separators=(",", ":")).encode()
    lines = [
        f"POST {parts.path.rstrip('/')}/v1/completions HTTP/1.1",
        f"host: {host}:{port}",
        "content-type: application/json",
        "accept: text/event-stream",
        f"content-length: {len(payload)}",
        "connection: close",
    ]
    if api_key:
        lines.append(f"authorization: Bearer {api_key}")
    return host, port, ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


async def http_stream(
    host: str, port: int, request: bytes, result: RequestResult, timeout_s: float = 3600.0
) -> None:
    """One streamed completion: the times of the events that carry text into `result`, the
    output length from the usage event."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    t_send = time.perf_counter()
    transport, proto = await loop.create_connection(lambda: _Recorder(done), host, port)
    try:
        transport.write(request)
        await asyncio.wait_for(done, timeout_s)
    finally:
        transport.close()
    status, events = sse_events(proto.parts, proto.times)
    if status != 200:
        body = b"".join(proto.parts).partition(b"\r\n\r\n")[2]
        raise RuntimeError(f"HTTP {status}: {body[:200]!r}")
    times: list[float] = []
    total = 0
    for payload, t in events:
        if not payload.startswith(b"{"):
            continue
        chunk = json.loads(payload)
        if "error" in chunk:
            raise RuntimeError(f"stream error: {str(chunk['error'])[:200]}")
        if chunk.get("usage"):
            total = chunk["usage"]["completion_tokens"]
        choices = chunk.get("choices")
        if choices and choices[0].get("text"):
            times.append(t)
    record_times(result, t_send, times)
    result.output_len = total


async def _run_http(
    target: Target,
    workload: Workload,
    arrivals: Sequence[float],
    max_concurrency: int,
    results: list[RequestResult],
    start: Callable[[], float],
) -> float:
    requests = []
    for p, n in zip(workload.prompts, workload.output_lens, strict=True):
        body = {
            "model": target.model,
            "prompt": p,
            "max_tokens": n,
            "temperature": 0.0,
            "ignore_eos": target.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        requests.append(http_request(target.address, body, target.api_key))

    async def send(i: int, result: RequestResult) -> None:
        await http_stream(*requests[i], result)
        _check_len(result, workload.output_lens[i], target.ignore_eos)

    return await paced(arrivals, results, start(), max_concurrency, send)


# ----------------------------------------------------------------------------- runs


async def run_requests(
    target: Target,
    workload: Workload,
    arrivals: Sequence[float],
    max_concurrency: int,
    start: Callable[[], float],
) -> tuple[list[RequestResult], float]:
    """Every request of `workload` at its arrival offset from the instant `start()` returns
    (called once the connection is up); the results and the end instant (perf_counter)."""
    results = [RequestResult(len(p)) for p in workload.prompts]
    run = _run_grpc if target.backend == "grpc" else _run_http
    end = await run(target, workload, arrivals, max_concurrency, results, start)
    return results, end


def _child_main() -> None:
    """A client process (`python -m tandem_services.bench.client`), driven over stdin / stdout with
    pickles: gets its share, connects, says ready, gets the shared start instant (epoch
    seconds), runs, sends back (results, end - start, CPU seconds)."""
    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, not into the pickles

    def send(obj: object) -> None:
        pickle.dump(obj, out)
        out.flush()

    target, workload, arrivals, max_concurrency = pickle.load(inp)
    cpu0, t_start = [0.0], [0.0]

    def start() -> float:
        send("ready")
        epoch = pickle.load(inp)
        cpu0[0] = process_cpu_s()
        t_start[0] = time.perf_counter() + (epoch - time.time())
        return t_start[0]

    results, end = asyncio.run(run_requests(target, workload, arrivals, max_concurrency, start))
    send((results, end - t_start[0], process_cpu_s() - cpu0[0]))


def run_load(
    target: Target,
    workload: Workload,
    rate: float,
    *,
    seed: int = 0,
    burstiness: float = 1.0,
    max_concurrency: int = 0,
    num_procs: int = 1,
) -> LoadRun:
    """The whole workload at `rate` req/s (Poisson for burstiness 1; `inf`: all at once),
    from `num_procs` client processes (1: this one)."""
    arrivals = arrival_times(workload.num_requests, rate, seed, burstiness)
    num_procs = max(1, min(num_procs, workload.num_requests))
    if num_procs == 1:
        cpu0, t0 = [0.0], [0.0]

        def start() -> float:
            cpu0[0], t0[0] = process_cpu_s(), time.perf_counter()
            return t0[0]

        results, end = asyncio.run(run_requests(target, workload, arrivals, max_concurrency, start))
        wall = end - t0[0]
        cpu = process_cpu_s() - cpu0[0]
        return LoadRun(results, wall, ClientCpu(cpu, wall, 1, (cpu,)))
    return _run_procs(target, workload, arrivals, max_concurrency, num_procs)


def _run_procs(
    target: Target,
    workload: Workload,
    arrivals: list[float],
    max_concurrency: int,
    num_procs: int,
) -> LoadRun:
    shares = [list(range(k, workload.num_requests, num_procs)) for k in range(num_procs)]
    cap = math.ceil(max_concurrency / num_procs) if max_concurrency > 0 else 0
    here = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for share in shares:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tandem_services.bench.client"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )
            procs.append(proc)
            assert proc.stdin is not None
            pickle.dump(
                (target, workload.subset(share), [arrivals[i] for i in share], cap), proc.stdin
            )
            proc.stdin.flush()
        for proc in procs:
            assert proc.stdout is not None
            if pickle.load(proc.stdout) != "ready":
                raise RuntimeError("a client process did not start")
        cpu0 = process_cpu_s()
        epoch = time.time() + 0.2
        for proc in procs:
            assert proc.stdin is not None
            pickle.dump(epoch, proc.stdin)
            proc.stdin.flush()
        results: list[RequestResult | None] = [None] * workload.num_requests
        wall, per_proc = 0.0, []
        for share, proc in zip(shares, procs, strict=True):
            assert proc.stdout is not None
            part, duration, cpu_s = pickle.load(proc.stdout)
            for i, r in zip(share, part, strict=True):
                results[i] = r
            wall = max(wall, duration)
            per_proc.append(cpu_s)
        for proc in procs:
            proc.wait(30)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    cpu = sum(per_proc) + process_cpu_s() - cpu0
    merged = [r for r in results if r is not None]
    assert len(merged) == workload.num_requests
    return LoadRun(merged, wall, ClientCpu(cpu, wall, num_procs, tuple(per_proc)))


if __name__ == "__main__":
    _child_main()
