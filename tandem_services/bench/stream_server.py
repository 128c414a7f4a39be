"""A streaming server with a known schedule, to measure and test `tandem bench serve` itself.

It speaks the frontend's real wire formats: the `tandem.v1.Frontend/Generate` gRPC stream
(`GenerateResponse` messages) and the OpenAI `/v1/completions` server-sent events the HTTP API
writes (one `data: {...}` chunk per step, a usage chunk, `data: [DONE]`). There is no model
behind it: every request gets its first token `ttft_ms` after it arrives (aligned to the next
step), then one message of `tokens_per_step` tokens per step of a shared `step_ms` clock (as an
engine's steps are shared by the batch), until `max_tokens`. So the client's TTFT lies in
[ttft_ms, ttft_ms + step_ms] and its inter-token latency is step_ms, whatever the load, for as
long as this process keeps up (it is run in its own process, away from the client it measures).

    python -m tandem_services.bench.stream_server --step-ms 5 --ttft-ms 20  # prints its two ports

Timeline of one request (S = step_ms, T = ttft_ms):

    arrive        first token        2nd            3rd
      |---- T ---->|.. <= S ..|---- S ----|---- S ----| ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Schedule:
    """When tokens come out: `ttft_ms` after arrival (then the next step), one message of
    `tokens_per_step` tokens per `step_ms`."""

    step_ms: float = 5.0
    ttft_ms: float = 20.0
    tokens_per_step: int = 1

    def __post_init__(self) -> None:
        if self.step_ms <= 0 or self.ttft_ms < 0 or self.tokens_per_step < 1:
            raise ValueError(f"bad schedule {self}")


class StepClock:
    """One shared clock: `wait()` returns at the next step boundary. Every stream waiting on
    it wakes on the same future, so a step costs one timer, not one per stream."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self._future: asyncio.Future[None] | None = None
        self._t0 = time.monotonic()

    def wait(self) -> asyncio.Future[None]:
        if self._future is None or self._future.done():
            loop = asyncio.get_running_loop()
            self._future = loop.create_future()
            n = int((time.monotonic() - self._t0) / self.step_s) + 1
            delay = self._t0 + n * self.step_s - time.monotonic()
            loop.call_later(max(0.0, delay), self._tick, self._future)
        return self._future

    @staticmethod
    def _tick(future: asyncio.Future[None]) -> None:
        if not future.done():
            future.set_result(None)


async def token_batches(
    schedule: Schedule, clock: StepClock, max_tokens: int
) -> AsyncIterator[list[int]]:
    """The token ids of one request, one list per step, on the schedule."""
    await asyncio.sleep(schedule.ttft_ms / 1000)
    sent = 0
    while sent < max_tokens:
        await clock.wait()
        n = min(schedule.tokens_per_step, max_tokens - sent)
        yield [(sent + k) % 1000 + 100 for k in range(n)]
        sent += n


# ----------------------------------------------------------------------------- gRPC


def make_grpc_server(schedule: Schedule, clock: StepClock, port: int) -> tuple[Any, int]:
    """A `grpc.aio` server with the Frontend service's `Generate` (the other methods answer
    UNIMPLEMENTED); returns it (not started) and its bound port."""
    import grpc

    from tandem_protos.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc

    class Frontend(frontend_pb2_grpc.FrontendServicer):
        async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
            max_tokens = request.sampling_params.max_tokens or 16
            prompt_len = len(request.token_ids.ids)
            rid = request.request_id or "stream"
            sent = 0
            async for ids in token_batches(schedule, clock, max_tokens):
                sent += len(ids)
                last = sent >= max_tokens
                choice = frontend_pb2.Choice(
                    index=0,
                    text=" ".join(f"t{i}" for i in ids),
                    token_ids=ids,
                    finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
                )
                if last:
                    usage = frontend_pb2.Usage(
                        prompt_tokens=prompt_len,
                        completion_tokens=sent,
                        total_tokens=prompt_len + sent,
                    )
                    yield frontend_pb2.GenerateResponse(
                        request_id=rid, choices=[choice], usage=usage
                    )
                else:
                    yield frontend_pb2.GenerateResponse(request_id=rid, choices=[choice])

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    frontend_pb2_grpc.add_FrontendServicer_to_server(Frontend(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    return server, bound


# ----------------------------------------------------------------------------- SSE


def _sse(obj: dict[str, Any]) -> bytes:
    data = f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _http_conn(
    schedule: Schedule, clock: StepClock, reader: asyncio.StreamReader, w: asyncio.StreamWriter
) -> None:
    """One HTTP/1.1 request: POST /v1/completions with `stream: true`, answered with chunked
    server-sent events in the HTTP API's completion format (any other path: 404); then the
    connection closes."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = json.loads(await reader.readexactly(length)) if length else {}
        if head.split(b" ", 2)[1:2] != [b"/v1/completions"]:
            w.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await w.drain()
            return
        max_tokens = int(body.get("max_tokens") or 16)
        prompt = body.get("prompt") or []
        prompt_len = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        )
        base = {"id": "cmpl-stream", "object": "text_completion", "created": int(time.time())}
        base["model"] = body.get("model", "default")
        sent = 0
        async for ids in token_batches(schedule, clock, max_tokens):
            sent += len(ids)
            choice = {
                "index": 0,
                "text": "".join(f" t{i}" for i in ids),
                "logprobs": None,
                "finish_reason": "length" if sent >= max_tokens else None,
                "stop_reason": None,
            }
            w.write(_sse({**base, "choices": [choice]}))
            await w.drain()
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {
                "prompt_tokens": prompt_len,
                "completion_tokens": sent,
                "total_tokens": prompt_len + sent,
            }
            w.write(_sse({**base, "choices": [], "usage": usage}))
        data = b"data: [DONE]\n\n"
        w.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
        await w.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        w.close()


# ----------------------------------------------------------------------------- process


class StreamServerProcess:
    """`python -m tandem_services.bench.stream_server` in a child process on free ports of
    127.0.0.1; a context manager (the child is terminated on exit)."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.grpc_address = ""
        self.http_url = ""
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> StreamServerProcess:
        argv = [
            sys.executable,
            "-m",
            "tandem_services.bench.stream_server",
            "--step-ms",
            str(self.schedule.step_ms),
            "--ttft-ms",
            str(self.schedule.ttft_ms),
            "--tokens-per-step",
            str(self.schedule.tokens_per_step),
        ]
        self._proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().split()
        if len(line) != 2:
            self.__exit__()
            raise RuntimeError(f"stream server did not start (said {line!r})")
        ports = dict(kv.split("=") for kv in line)
        self.grpc_address = f"127.0.0.1:{ports['grpc']}"
        self.http_url = f"http://127.0.0.1:{ports['http']}"
        return self

    def cpu_s(self) -> float:
        """User + system CPU seconds the server has used so far (Linux /proc)."""
        assert self._proc is not None
        fields = Path(f"/proc/{self._proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


# ----------------------------------------------------------------------------- main


async def serve(schedule: Schedule, grpc_port: int, http_port: int) -> None:
    """Both servers until cancelled; prints `grpc=<port> http=<port>` once both listen."""
    clock = StepClock(schedule.step_ms / 1000)
    server, bound = make_grpc_server(schedule, clock, grpc_port)
    await server.start()
    http = await asyncio.start_server(
        lambda r, w: _http_conn(schedule, clock, r, w), "127.0.0.1", http_port, backlog=1024
    )
    http_bound = http.sockets[0].getsockname()[1]
    print(f"grpc={bound} http={http_bound}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        http.close()
        await server.stop(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--tokens-per-step", type=int, default=1)
    p.add_argument("--grpc-port", type=int, default=0)
    p.add_argument("--http-port", type=int, default=0)
    ns = p.parse_args(argv)
    schedule = Schedule(ns.step_ms, ns.ttft_ms, ns.tokens_per_step)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(schedule, ns.grpc_port, ns.http_port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
