"""Can a decode step's attention overlap its matmuls? (probe, llama-3.1-8b shapes, bf16)

One decoder layer's work repeated `--layers` times at batch `--batch` and context `--ctx`:
matmuls (qkv, o, gate_up, down), SiLU-and-mul, and the paged decode attention kernel. Timed:

- serial: everything on one stream, as the engine runs it now;
- halves: two half batches, each on its own stream, no SM partition;
- pipelined: one stream for matmuls, one for attention, the half batches alternating so that
  one half's attention runs while the other half's matmuls do; without an SM partition, with
  cuBLAS's SM carve-out, and with green contexts of n SMs for attention;
- alone: attention and a matmul each restricted to n SMs (green context), to see how their
  rates scale with SMs;
- the pipelined variant captured in a CUDA graph (does capture keep the overlap?).

    python -m benchmarks.overlap_probe --out probe.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks.gpu_throughput import device_ms
from tandem_kernels.activation import silu_and_mul
from tandem_kernels.paged_attention import paged_decode_attention, tune_decode_attention

HIDDEN, INTER, NH, NKV, HD = 4096, 14336, 32, 8, 128
BLOCK = 16


class Layer:
    def __init__(self, dev: torch.device, gen: torch.Generator) -> None:
        def w(o: int, i: int) -> torch.Tensor:
            return (torch.randn(o, i, device=dev, generator=gen) * 0.02).to(torch.bfloat16)

        self.qkv = w((NH + 2 * NKV) * HD, HIDDEN)
        self.o = w(HIDDEN, NH * HD)
        self.gate_up = w(2 * INTER, HIDDEN)
        self.down = w(HIDDEN, INTER)


class Work:
    """Inputs of one step at batch B; `rows` slices pick a half."""

    def __init__(self, batch: int, ctx: int, dev: torch.device) -> None:
        gen = torch.Generator(device=dev).manual_seed(0)
        self.layers = [Layer(dev, gen), Layer(dev, gen)]
        blocks_per_req = -(-ctx // BLOCK)
        num_blocks = batch * blocks_per_req + 16
        self.kv = torch.zeros(
            (num_blocks, 2, BLOCK, NKV, HD), dtype=torch.bfloat16, device=dev
        ).normal_(generator=gen)
        perm = torch.randperm(num_blocks - 16, device=dev, generator=gen)
        self.block_table = perm.view(batch, blocks_per_req).to(torch.int32)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        self.x = torch.randn(batch, HIDDEN, device=dev, generator=gen).to(torch.bfloat16)
        self.batch, self.ctx = batch, ctx
        self.scale = 1.0 / math.sqrt(HD)

    def mm1(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        return (x @ layer.qkv.T)[:, : NH * HD]

    def attn(self, q: torch.Tensor, rows: slice) -> torch.Tensor:
        n = q.shape[0]
        return paged_decode_attention(
            q.reshape(n, NH, HD),
            self.kv,
            self.seq_lens[rows],
            self.block_table[rows],
            self.scale,
            max_seq_len=self.ctx,
        ).reshape(n, NH * HD)

    def mm2(self, layer: Layer, a: torch.Tensor) -> torch.Tensor:
        h = a @ layer.o.T
        return silu_and_mul(h @ layer.gate_up.T) @ layer.down.T


def time_ms(fn: Callable[[], object], iters: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    return device_ms(fn, iters) / iters


@contextlib.contextmanager
def sm_carveout(num_sms: int) -> Iterator[None]:
    """cuBLAS matmuls inside leave `num_sms` SMs free."""
    torch._C._set_sm_carveout_experimental(num_sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(None)


def record(res: dict[str, Any], name: str, make: Callable[[], Callable[[], object]]) -> None:
    """res[name] = ms per call of make()'s function, or the error (a probe: record, go on)."""
    try:
        res[name] = time_ms(make())
        print(f"{name}: {res[name]:.2f} ms", flush=True)
    except Exception as exc:
        res[name] = f"error: {exc!r}"[:300]
        print(f"{name}: {res[name]}", flush=True)
        traceback.print_exc()


def write_result(res: dict[str, Any], out: str) -> None:
    print(json.dumps(res, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


def serial(w: Work, layers: int) -> Callable[[], object]:
    def run() -> object:
        x = w.x
        for i in range(layers):
            layer = w.layers[i % 2]
            x = w.mm2(layer, w.attn(w.mm1(layer, x), slice(0, w.batch)))
        return x

    return run


def halves(w: Work, layers: int, streams: list[torch.cuda.Stream]) -> Callable[[], object]:
    half = w.batch // 2
    parts = [slice(0, half), slice(half, w.batch)]

    def run() -> object:
        main = torch.cuda.current_stream()
        xs = [w.x[p] for p in parts]
        for s in streams:
            s.wait_stream(main)
        for i in range(layers):
            layer = w.layers[i % 2]
            for h, (s, p) in enumerate(zip(streams, parts, strict=True)):
                with torch.cuda.stream(s):
                    xs[h] = w.mm2(layer, w.attn(w.mm1(layer, xs[h]), p))
        for s in streams:
            main.wait_stream(s)
        return xs

    return run


def pipelined(
    w: Work, layers: int, mm_stream: torch.cuda.Stream, attn_stream: torch.cuda.Stream
) -> Callable[[], object]:
    """mm stream: qkv(A0) | o..down(B,l-1) qkv(B,l) | o..down(A,l) qkv(A,l+1) | ...
    attn stream: attn(A,l) | attn(B,l) | ...; events carry the dependencies."""
    half = w.batch // 2
    parts = [slice(0, half), slice(half, w.batch)]

    def run() -> object:
        main = torch.cuda.current_stream()
        mm_stream.wait_stream(main)
        attn_stream.wait_stream(main)
        xs = [w.x[p] for p in parts]
        qs: list[Any] = [None, None]
        ats: list[Any] = [None, None]
        ready_q = [torch.cuda.Event(), torch.cuda.Event()]
        ready_a = [torch.cuda.Event(), torch.cuda.Event()]
        with torch.cuda.stream(mm_stream):
            for h in range(2):
                qs[h] = w.mm1(w.layers[0], xs[h])
                ready_q[h].record(mm_stream)
        for i in range(layers):
            layer = w.layers[i % 2]
            nxt = w.layers[(i + 1) % 2]
            for h in range(2):
                with torch.cuda.stream(attn_stream):
                    attn_stream.wait_event(ready_q[h])
                    ats[h] = w.attn(qs[h], parts[h])
                    ready_a[h].record(attn_stream)
                with torch.cuda.stream(mm_stream):
                    mm_stream.wait_event(ready_a[h])
                    xs[h] = w.mm2(layer, ats[h])
                    if i + 1 < layers:
                        qs[h] = w.mm1(nxt, xs[h])
                        ready_q[h].record(mm_stream)
        main.wait_stream(mm_stream)
        main.wait_stream(attn_stream)
        return xs

    return run


def green_stream(num_sms: int, dev: torch.device) -> tuple[Any, torch.cuda.Stream]:
    from torch.cuda.green_contexts import GreenContext

    ctx = GreenContext.create(num_sms=num_sms, device_id=dev.index or 0)
    if hasattr(ctx, "Stream"):
        return ctx, ctx.Stream()
    ctx.set_context()
    s = torch.cuda.Stream()
    ctx.pop_context()
    return ctx, s


def concurrent(
    jobs: list[tuple[torch.cuda.Stream, Callable[[], object]]],
) -> Callable[[], object]:
    """Each job on its own stream, no dependencies between them: do they run at once?"""

    def run() -> object:
        main = torch.cuda.current_stream()
        for s, _ in jobs:
            s.wait_stream(main)
        out = []
        for s, job in jobs:
            with torch.cuda.stream(s):
                out.append(job())
        for s, _ in jobs:
            main.wait_stream(s)
        return out

    return run


def concurrency_probe(w: Work, layers: int, res: dict[str, Any], dev: torch.device) -> None:
    """Attention-only and matmul-only work, alone and at once, on plain streams, on green
    contexts (SM partitions) and with cuBLAS's SM carve-out."""
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    full = slice(0, w.batch)
    layer = w.layers[0]
    q = w.mm1(layer, w.x)
    a = w.attn(q, full)

    def attn_job() -> object:
        return [w.attn(q, full) for _ in range(layers)]

    def mm_job() -> object:
        return [w.mm2(layer, w.mm1(layer, a)) for _ in range(layers)]

    def rec(name: str, fn: Callable[[], object]) -> None:
        record(res, name, lambda: fn)

    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    rec("c_attn_alone", attn_job)
    rec("c_mm_alone", mm_job)
    rec("c_both_plain_streams", concurrent([(s1, mm_job), (s2, attn_job)]))
    for n_attn in (48, 64, 80):

        def carved_mm(c: int = n_attn) -> object:
            with sm_carveout(c):
                return mm_job()

        rec(f"c_both_carveout{n_attn}", concurrent([(s1, carved_mm), (s2, attn_job)]))
        try:
            ctx_a, st_a = green_stream(n_attn, dev)
            ctx_m, st_m = green_stream(num_sms - n_attn, dev)
        except Exception as exc:
            res[f"c_green{n_attn}"] = f"error: {exc!r}"[:300]
            continue
        rec(f"c_green_attn{n_attn}_alone", concurrent([(st_a, attn_job)]))
        rec(f"c_green_mm{num_sms - n_attn}_alone", concurrent([(st_m, mm_job)]))
        rec(f"c_green_both_{n_attn}", concurrent([(st_m, mm_job), (st_a, attn_job)]))
        del ctx_a, ctx_m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--ctx", type=int, default=640)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out", default="")
    ap.add_argument("--concurrency-only", action="store_true")
    ns = ap.parse_args(argv)
    dev = torch.device("cuda", torch.cuda.current_device())
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    res: dict[str, Any] = {"batch": ns.batch, "ctx": ns.ctx, "layers": ns.layers, "sms": num_sms}
    res["torch"] = torch.__version__
    res["green_contexts"] = hasattr(torch._C, "_CUDAGreenContext")
    res["carveout_api"] = hasattr(torch._C, "_set_sm_carveout_experimental")
    w = Work(ns.batch, ns.ctx, dev)
    tune_decode_attention(w.kv, NH, num_reqs=min(ns.batch, 512), seq_len=min(ns.ctx, 1024))

    if ns.concurrency_only:
        concurrency_probe(w, ns.layers, res, dev)
        write_result(res, ns.out)
        return 0

    measure = functools.partial(record, res)

    L = ns.layers
    full = slice(0, ns.batch)
    layer = w.layers[0]
    q = w.mm1(layer, w.x)
    a = w.attn(q, full)
    measure("serial", lambda: serial(w, L))
    measure("attn_only", lambda: lambda: [w.attn(q, full) for _ in range(L)])
    measure("mm_only", lambda: lambda: [w.mm2(layer, w.mm1(layer, a)) for _ in range(L)])
    kv_bytes = ns.batch * ns.ctx * NKV * HD * 2 * 2 * L
    flops = 2 * ns.batch * L * (6144 * 4096 + 4096 * 4096 + 2 * INTER * 4096 + INTER * 4096)
    if isinstance(res["attn_only"], float):
        res["attn_GBps"] = kv_bytes / res["attn_only"] / 1e6
    if isinstance(res["mm_only"], float):
        res["mm_TFLOPs"] = flops / res["mm_only"] / 1e9
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    measure("halves_2streams", lambda: halves(w, L, [s1, s2]))
    measure("pipelined_nopartition", lambda: pipelined(w, L, s1, s2))
    if res["carveout_api"]:
        for carve in (32, 48, 64):

            def carved(c: int = carve) -> Callable[[], object]:
                run = pipelined(w, L, s1, s2)

                def go() -> object:
                    with sm_carveout(c):
                        return run()

                return go

            measure(f"pipelined_carveout{carve}", carved)

            def mm_carved(c: int = carve) -> Callable[[], object]:
                def go() -> object:
                    with sm_carveout(c):
                        return [w.mm2(layer, w.mm1(layer, a)) for _ in range(L)]

                return go

            measure(f"mm_only_carveout{carve}", mm_carved)
    if res["green_contexts"]:
        for n_attn in (32, 48, 64):
            try:
                _ctx_attn, st_attn = green_stream(n_attn, dev)
                _ctx_mm, st_mm = green_stream(num_sms - n_attn, dev)
            except Exception as exc:
                res[f"green{n_attn}"] = f"error: {exc!r}"[:300]
                traceback.print_exc()
                continue

            def attn_alone(st: torch.cuda.Stream = st_attn) -> Callable[[], object]:
                def go() -> object:
                    st.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(st):
                        r = [w.attn(q, full) for _ in range(L)]
                    torch.cuda.current_stream().wait_stream(st)
                    return r

                return go

            def mm_alone(st: torch.cuda.Stream = st_mm) -> Callable[[], object]:
                def go() -> object:
                    st.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(st):
                        r = [w.mm2(layer, w.mm1(layer, a)) for _ in range(L)]
                    torch.cuda.current_stream().wait_stream(st)
                    return r

                return go

            measure(f"green_attn_only_{n_attn}sms", attn_alone)
            measure(f"green_mm_only_{num_sms - n_attn}sms", mm_alone)
            measure(
                f"pipelined_green_attn{n_attn}",
                lambda sm=st_mm, sa=st_attn: pipelined(w, L, sm, sa),
            )
            try:
                run = pipelined(w, L, st_mm, st_attn)
                run()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                cap = torch.cuda.Stream()
                with torch.cuda.graph(graph, stream=cap):
                    run()
                measure(f"graph_pipelined_green_attn{n_attn}", lambda g=graph: g.replay)
            except Exception as exc:
                res[f"graph_pipelined_green_attn{n_attn}"] = f"error: {exc!r}"[:300]
                traceback.print_exc()
    try:
        run = pipelined(w, L, s1, s2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        measure("graph_pipelined_nopartition", lambda: graph.replay)
        graph2 = torch.cuda.CUDAGraph()
        run2 = serial(w, L)
        with torch.cuda.graph(graph2):
            run2()
        measure("graph_serial", lambda: graph2.replay)
    except Exception as exc:
        res["graph"] = f"error: {exc!r}"[:300]
        traceback.print_exc()
    write_result(res, ns.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
