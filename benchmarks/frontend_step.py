"""The frontend's per-step cost: worker step messages in, client stream writes out.

N streams decode together; each of M steps the decode worker sends the frontend one
`StepOutputs` holding every stream's new tokens (serialized here, parsed there as the gRPC
stream does). The frontend's work per step, timed by phase over the whole step:

    parse     StepOutputs.FromString (one message per step)
    tracker   RequestTracker: ordering, ChoiceOutput.update (detokenizer window, stop
              strings), one StepEvent per stream
    http      each stream's handler takes its events and renders them as server-sent events
              (OpenAI completions or chat chunks), encoded to bytes as Starlette writes them
    grpc      the same events as Generate stream messages, serialized

Figures are microseconds per stream-step (phase time / (N * M)) and writes per stream-step
(what the HTTP handler hands the server; one write is one send on the socket). Each stream
has a stop string that never matches (the hold-back scan runs as it does for real requests)
unless --no-stop. `--drain-every K` lets the handlers fall K steps behind (a loaded event
loop): their events queue up meanwhile.

`--path actor` instead runs the tracker as the actor it is (messages through its inbox, the
handlers as tasks awaiting their queues) on the chosen event loop (`--loop uvloop` when
uvloop is installed) and reports wall time per stream-step.

    python -m benchmarks.frontend_step                         # 256 streams x 64 steps
    python -m benchmarks.frontend_step --streams 64 --tokens-per-step 4 --out fe.json
    python -m benchmarks.frontend_step --path actor --loop uvloop
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from tandem.config import add_engine_args
from tandem.sampling_params import SamplingParams
from tandem_protos.v1 import common_pb2, worker_pb2
from tandem_services.frontend.engine import merge_queued
from tandem_services.frontend.grpc_api import stream_response
from tandem_services.frontend.openai_protocol import TokenText
from tandem_services.frontend.sse import ChatStream, CompletionStream
from tandem_services.frontend.tracker import Outputs, Register, RequestTracker
from tandem_services.frontend.types import StepEvent

TEXT = (
    "The quick brown fox jumps over the lazy dog. Émoji time: 🎉🤖 and café, naïve. "
    "日本語のテキストと中文文本。 def f(x):\n    return x ** 2  # ∑ ∫ √ ≠ ≤\n"
    "Servers stream tokens to their clients as soon as each step of the model is done; "
    "every step brings one new token per request, and the frontend turns it into text. "
) * 40


def _load_tokenizer(model: str, cache_dir: str = "") -> Any:
    from tandem.loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(model, cache_dir or None))


def _step_messages(
    token_ids: list[int], streams: int, steps: int, per_step: int, base: int
) -> list[bytes]:
    """Serialized StepOutputs, one per step; stream s starts at its own offset of the text."""
    msgs = []
    n = len(token_ids)
    for k in range(steps):
        step = worker_pb2.StepOutputs()
        for s in range(streams):
            start = (s * 37 + k * per_step) % (n - per_step)
            out = step.outputs.add()
            out.request_id = f"r{base + s}"
            out.output_index = k * per_step
            out.new_token_ids.extend(token_ids[start : start + per_step])
            if k == steps - 1:
                out.finish_reason = common_pb2.FINISH_REASON_LENGTH
        msgs.append(step.SerializeToString())
    return msgs


class _Handler:
    """One client stream: renders its events for the API under test."""

    def __init__(self, api: str, rid: str, token_text: TokenText) -> None:
        self.api = api
        self.rid = rid
        self.num_writes = 0
        self.num_bytes = 0
        if api == "chat":
            self.sse: ChatStream | CompletionStream = ChatStream(
                rid, 0, "m", False, False, token_text
            )
        else:
            self.sse = CompletionStream(rid, 0, "m", 1, False, False, token_text)

    def consume(self, event: StepEvent) -> None:
        if self.api == "grpc":
            data = stream_response(self.rid, event, 16).SerializeToString()
            self.num_writes += 1
            self.num_bytes += len(data)
            return
        writes = self.sse.render(0, event)
        if isinstance(writes, str):
            writes = [writes] if writes else []
        for w in writes:
            self.num_bytes += len(w.encode("utf-8"))
        self.num_writes += len(writes)


async def _run_direct(
    tokenizer: Any, token_ids: list[int], ns: argparse.Namespace, api: str, base: int
) -> dict[str, float]:
    tracker = RequestTracker(tokenizer, lambda ids: None)
    stop = [] if ns.no_stop else ["\n\n###"]
    params = SamplingParams(max_tokens=ns.steps * ns.tokens_per_step, stop=stop)
    token_text = TokenText(tokenizer)
    queues = []
    handlers = []
    for s in range(ns.streams):
        rid = f"r{base + s}"
        msg = Register(rid, token_ids[:16], [(rid, params)])
        tracker.handle(msg)
        queues.append(msg.reply.result())
        handlers.append(_Handler(api, rid, token_text))
    msgs = _step_messages(token_ids, ns.streams, ns.steps, ns.tokens_per_step, base)
    t_parse = t_tracker = t_out = 0.0
    gc.collect()
    for k, data in enumerate(msgs):
        t0 = time.perf_counter()
        step = worker_pb2.StepOutputs.FromString(data)
        t1 = time.perf_counter()
        tracker.handle(Outputs(step))
        t2 = time.perf_counter()
        if (k + 1) % ns.drain_every == 0 or k == len(msgs) - 1:
            for queue, h in zip(queues, handlers, strict=True):
                consume = h.consume
                for event in _take(queue):
                    consume(event)
        t3 = time.perf_counter()
        t_parse += t1 - t0
        t_tracker += t2 - t1
        t_out += t3 - t2
    assert not tracker.requests, "every stream finished"
    n = ns.streams * ns.steps
    return {
        "parse_us": t_parse / n * 1e6,
        "tracker_us": t_tracker / n * 1e6,
        f"{api}_us": t_out / n * 1e6,
        "total_us": (t_parse + t_tracker + t_out) / n * 1e6,
        "writes_per_stream_step": sum(h.num_writes for h in handlers) / n,
        "bytes_per_stream_step": sum(h.num_bytes for h in handlers) / n,
    }


def _take(queue: asyncio.Queue[StepEvent]) -> list[StepEvent]:
    """What a handler gets from its queue, as `FrontendEngine.generate` takes it."""
    events = []
    while not queue.empty():
        events.extend(merge_queued(queue.get_nowait(), queue))
    return events


async def _run_actor(
    tokenizer: Any, token_ids: list[int], ns: argparse.Namespace, api: str, base: int
) -> dict[str, float]:
    tracker = RequestTracker(tokenizer, lambda ids: None)
    tracker.start()
    stop = [] if ns.no_stop else ["\n\n###"]
    params = SamplingParams(max_tokens=ns.steps * ns.tokens_per_step, stop=stop)
    token_text = TokenText(tokenizer)
    handlers = []
    queues = []
    for s in range(ns.streams):
        rid = f"r{base + s}"
        queues.append(await tracker.ask(Register(rid, token_ids[:16], [(rid, params)])))
        handlers.append(_Handler(api, rid, token_text))
    msgs = _step_messages(token_ids, ns.streams, ns.steps, ns.tokens_per_step, base)

    async def handle(queue: asyncio.Queue[StepEvent], h: _Handler) -> None:
        while True:
            for event in merge_queued(await queue.get(), queue):
                h.consume(event)
                if event.finished:
                    return

    gc.collect()
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(handle(q, h)) for q, h in zip(queues, handlers, strict=True)]
    for data in msgs:
        tracker.tell(Outputs(worker_pb2.StepOutputs.FromString(data)))
        await asyncio.sleep(0)  # the worker stream yields between messages
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    await tracker.stop()
    n = ns.streams * ns.steps
    return {
        "wall_us": wall / n * 1e6,
        "writes_per_stream_step": sum(h.num_writes for h in handlers) / n,
    }


def _new_loop(name: str) -> asyncio.AbstractEventLoop:
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # The engine's --model and --cache-dir, as the frontend takes them (the tokenizer's model).
    add_engine_args(p, only=("model", "cache_dir"))
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--tokens-per-step", type=int, default=1)
    p.add_argument("--drain-every", type=int, default=1)
    p.add_argument("--no-stop", action="store_true")
    p.add_argument("--apis", default="completions,chat,grpc")
    p.add_argument("--path", choices=("direct", "actor"), default="direct")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    p.add_argument("--repeat", type=int, default=5, help="runs per API; the fastest is kept")
    p.add_argument("--label", default="", help="a name for this run in the JSON")
    p.add_argument("--out", default="", help="write the JSON report here")
    ns = p.parse_args(argv)

    tokenizer = _load_tokenizer(ns.model, ns.cache_dir)
    token_ids = list(tokenizer(TEXT, add_special_tokens=False).input_ids)
    run = _run_direct if ns.path == "direct" else _run_actor
    results: dict[str, dict[str, float]] = {}
    base = 0
    for api in ns.apis.split(","):
        runs = []
        for _ in range(ns.repeat):
            loop = _new_loop(ns.loop)
            try:
                runs.append(loop.run_until_complete(run(tokenizer, token_ids, ns, api, base)))
            finally:
                loop.close()
            base += ns.streams
        # The fastest run: on a shared machine the others carry other processes' time.
        best = min(runs, key=lambda r: r.get("total_us", r.get("wall_us", 0.0)))
        results[api] = best | {
            "median_total_us": statistics.median(
                r.get("total_us", r.get("wall_us", 0.0)) for r in runs
            )
        }
        print(api, " ".join(f"{k}={v:.2f}" for k, v in results[api].items()), flush=True)
    report = {
        "benchmark": "frontend_step",
        "label": ns.label,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "config": {
            k: getattr(ns, k)
            for k in ("streams", "steps", "tokens_per_step", "drain_every", "no_stop", "path")
        }
        | {"loop": ns.loop, "repeat": ns.repeat},
        "results": results,
    }
    if ns.out:
        Path(ns.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
