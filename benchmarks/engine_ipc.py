"""What one engine step's outputs cost to cross a process boundary, by encoding and transport.

    python -m benchmarks.engine_ipc [--outputs 256] [--iters 2000] [--out engine_ipc.json]

Encodings of one step's outputs (N requests, one new token each): pickle of the
`EngineCoreOutput` objects, and tandem's columnar STEP frame (`tandem.engine.serial`), each
encoded and decoded back into objects. Transport: the round trip of one such frame between two
processes over a `multiprocessing` pipe (the engine-core process's), sent and echoed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import pickle
import time
from multiprocessing.connection import Connection

from tandem.core.outputs import EngineCoreOutput
from tandem.engine import serial
from tandem.engine.core import EngineStats


def _outputs(n: int) -> list[EngineCoreOutput]:
    return [EngineCoreOutput(f"cmpl-{i:08d}-0", [1000 + i]) for i in range(n)]


def _per_call_us(fn: object, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()  # type: ignore[operator]
    return (time.perf_counter() - t0) / iters * 1e6


def _echo(conn: Connection) -> None:
    while True:
        frame = conn.recv_bytes()
        if not frame:
            return
        conn.send_bytes(frame)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--outputs", type=int, default=256)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--out", default="")
    ns = p.parse_args(argv)
    outs = _outputs(ns.outputs)
    pig = serial.Piggyback(stats=EngineStats(3, 1, 10, 16, 0.375, 40, 12, 2, 1, 0))
    pickled = pickle.dumps((outs, pig), protocol=5)
    frame = serial.encode_step(outs, pig)
    result = {
        "outputs_per_step": ns.outputs,
        "pickle": {
            "encode_us": _per_call_us(lambda: pickle.dumps((outs, pig), protocol=5), ns.iters),
            "decode_us": _per_call_us(lambda: pickle.loads(pickled), ns.iters),
            "bytes": len(pickled),
        },
        "step_frame": {
            "encode_us": _per_call_us(lambda: serial.encode_step(outs, pig), ns.iters),
            "decode_us": _per_call_us(lambda: serial.decode_step(frame), ns.iters),
            "bytes": len(frame),
        },
    }
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_echo, args=(there,), daemon=True)
    proc.start()
    here.send_bytes(frame)
    here.recv_bytes()

    def round_trip() -> None:
        here.send_bytes(frame)
        here.recv_bytes()

    result["pipe_round_trip_us"] = _per_call_us(round_trip, ns.iters)
    here.send_bytes(b"")
    proc.join(timeout=5)
    for name in ("pickle", "step_frame"):
        r = result[name]
        print(
            f"{name:>10}: encode {r['encode_us']:7.1f} us, decode {r['decode_us']:7.1f} us, "
            f"{r['bytes']} bytes ({ns.outputs} outputs)"
        )
    print(f"pipe round trip of one step frame: {result['pipe_round_trip_us']:.1f} us")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
