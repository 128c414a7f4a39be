"""KV transfer rate between two processes, through tandem's connectors, in one run.

One prompt's KV of the llama-3.1-8b shape by default: 2,048 tokens, 32 layers, 8 KV heads,
head size 128, bf16, blocks of 16 tokens -> 128 blocks of 2 MiB, 256 MiB per prompt. A
receiver process (the decode side: a zeroed cache behind a Worker service with every block
reserved) and this process (the prefill side) move whole prompts:

    contiguous   128 consecutive source blocks into 128 consecutive destination blocks
    scattered    shuffled source and destination blocks (a pool after churn)
    throughput   `--prompts` prompts sent by C senders for each C in `--concurrency`, each
                 sending its next prompt as soon as its last one is done (closed loop):
                 aggregate bytes over wall time. Concurrent hand-offs to one decode worker
                 share write sessions (up to the connector's `max_sessions` in flight, so one
                 session's copies overlap the others' messages): this is the rate under load;
                 each sender has its own destination blocks. `<name>_throughput` is the largest
                 C, `<name>_throughput_c<C>` the others.

    cuda mode (one GPU, two processes): the CUDA IPC connector. Beside it, measured in the
        same run: the device-to-device copy bandwidth (a local `copy_` of one prompt's bytes),
        a raw copy into the IPC-mapped cache, and the `copy_blocks` kernel alone into it
        (consecutive and shuffled block pairs; shuffled also at other per-program chunk
        sizes). These are device times: each timed op waits behind a short device-side spin,
        so the host's launch cost (given apart, `host_launch_us`) is not counted in them.
        Rates are also given as a fraction of the local copy bandwidth.
    nccl mode (two GPUs, two processes: this one on cuda:0, the receiver on cuda:1): the NCCL
        connector, beside a GPU-to-GPU `copy_` of the same bytes.
    cpu mode: the NCCL connector over gloo and the TCP connector, beside a local memcpy; and
        `shm`: the CUDA IPC session protocol (the same RemoteKVConnector, max_sessions and copy
        plan) over a decode cache in shared memory (/dev/shm) that the sender maps and writes
        straight into, with an event that is already complete. With a tiny shape (one block,
        one layer, small heads) its figures are the session machinery's host cost per prompt,
        what CUDA IPC pays on top of its device copies.

Rates are bytes of KV moved per second (GB/s = 1e9 B/s; a copy's bytes are counted once).
`data`: the connector's data path (copies or sends, then one device wait); `session`: the
whole `send_blocks` (with the WriteKV messages, or the TCP stream).

    python -m benchmarks.kv_transfer --mode cuda --out kv_transfer_cuda.json
    python -m benchmarks.kv_transfer --mode nccl --out kv_transfer_nccl.json     # 2 GPUs
    python -m benchmarks.kv_transfer --mode cpu --tokens 512 --out kv_transfer_cpu.json
    # host overhead per prompt of the session machinery (tiny shape, shm only):
    python -m benchmarks.kv_transfer --mode cpu --connectors shm --tokens 16 --layers 1 \
        --kv-heads 1 --head-size 8 --iters 300 --prompts 1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch


def cache_shape(ns: argparse.Namespace) -> tuple[int, ...]:
    return (ns.num_blocks, ns.layers, 2, ns.block_size, ns.kv_heads, ns.head_size)


CPU_CONNECTORS = ("shm", "nccl", "tcp")


def _connectors(
    mode: str, cache: torch.Tensor, worker_id: str, names: tuple[str, ...], shm_path: str
) -> dict[str, Any]:
    from tandem.kv_transfer.base import DirectEngine
    from tandem_services.worker.kv_sessions import RemoteKVConnector

    engine = DirectEngine()
    if mode == "cuda":
        from tandem.kv_transfer.cuda_ipc import CudaIpcMover

        return {"cuda_ipc": RemoteKVConnector(CudaIpcMover(cache, engine, worker_id))}
    from tandem.kv_transfer.nccl import NcclMover
    from tandem_services.worker.kv_tcp import TcpKVConnector

    if mode == "nccl":
        mover = NcclMover(cache, engine, worker_id, group_timeout_s=60.0)
        return {"nccl": RemoteKVConnector(mover)}

    out: dict[str, Any] = {}
    for name in names:
        if name == "shm":
            out[name] = _shm_connector(cache, engine, worker_id, shm_path)
        elif name == "nccl":
            mover = NcclMover(cache, engine, worker_id, backend="gloo", group_timeout_s=60.0)
            out[name] = RemoteKVConnector(mover)
        else:
            out[name] = TcpKVConnector(cache, engine)
    return out


def _shm_connector(cache: torch.Tensor, engine: Any, worker_id: str, path: str) -> Any:
    """The CUDA IPC session protocol over a CPU cache in shared memory (see the docstring):
    the receiver's cache is the file at `path`, which the sender maps in `open`."""
    import concurrent.futures

    from tandem.kv_transfer.base import KVDestination
    from tandem.kv_transfer.cuda_ipc import (
        MAX_SESSIONS,
        OpenedCache,
        check_block_ids,
        copy_runs,
        wait_event,
    )
    from tandem.kv_transfer.mover import KVMover, Run
    from tandem_kernels.block_copy import block_words, common_words
    from tandem_services.worker.kv_sessions import RemoteKVConnector

    class _Done:
        """A device event that has already completed (CPU copies are synchronous)."""

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    class SharedMemoryMover(KVMover[OpenedCache]):
        transport = "shm"

        def __init__(self) -> None:
            super().__init__(cache, engine, worker_id, MAX_SESSIONS)
            self._rows = block_words(cache)
            self._executor = concurrent.futures.ThreadPoolExecutor(1)

        async def handshake(self, prefill_worker_id: str) -> None:
            return None

        async def open(self, dst: KVDestination, handshake: object | None) -> OpenedCache:
            remote = torch.from_file(path, shared=True, size=cache.numel(), dtype=cache.dtype)
            remote = remote.view(cache.shape)
            return OpenedCache(remote, *common_words(block_words(remote), self._rows))

        async def write(self, peer: OpenedCache, src: list[int], runs: list[Run]) -> None:
            check_block_ids(src, runs, self.cache.num_blocks, peer.tensor.shape[0])
            copy_runs(peer.local_rows, peer.rows, src, runs)
            await wait_event(_Done(), self._executor)  # type: ignore[arg-type]

        async def close(self) -> None:
            self._executor.shutdown(wait=True)

    return RemoteKVConnector(SharedMemoryMover())


# ----------------------------------------------------------------------------- receiver


def receiver_main(
    conn: Connection,
    mode: str,
    shape: tuple[int, ...],
    dtype: str,
    names: tuple[str, ...] = CPU_CONNECTORS,
    shm_path: str = "",
) -> None:
    asyncio.run(_receiver(conn, mode, shape, dtype, names, shm_path))


async def _receiver(
    conn: Connection,
    mode: str,
    shape: tuple[int, ...],
    dtype: str,
    names: tuple[str, ...],
    shm_path: str,
) -> None:
    from tandem_services.worker.kv_standalone import start_receiver
    from tandem_services.worker.kv_transports import KVTransports

    torch.set_num_threads(1)
    device = _device(mode, receiver=True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if mode == "cpu" and "shm" in names:
        numel = math.prod(shape)
        cache = torch.from_file(shm_path, shared=True, size=numel, dtype=getattr(torch, dtype))
        cache = cache.view(shape).zero_()
    else:
        cache = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
    transports = KVTransports(_connectors(mode, cache, "bench-decode", names, shm_path))
    server, address, _ = await start_receiver(transports, None)
    conn.send(address)
    loop = asyncio.get_running_loop()
    # "cpu": answer this process's CPU seconds so far; anything else: stop.
    while await loop.run_in_executor(None, conn.recv) == "cpu":
        conn.send(time.process_time())
    await server.stop(0)
    await transports.close()


# ----------------------------------------------------------------------------- sender


def _device(mode: str, receiver: bool = False) -> torch.device:
    if mode == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", 1 if mode == "nccl" and receiver else 0)


def _ids(rng: random.Random, num_blocks: int, n: int, pattern: str) -> list[int]:
    if pattern == "scattered":
        return rng.sample(range(num_blocks), n)
    start = rng.randrange(0, num_blocks - n + 1)
    return list(range(start, start + n))


def _summary(prompt_bytes: int, seconds: list[float]) -> dict[str, float]:
    med = statistics.median(seconds)
    return {
        "median_ms": med * 1e3,
        "min_ms": min(seconds) * 1e3,
        "GBps_median": prompt_bytes / med / 1e9,
        "GBps_best": prompt_bytes / min(seconds) / 1e9,
    }


# Device cycles of spin queued ahead of each timed op (about 0.5 ms): the op is launched while
# the device spins, so its CUDA events time the device work alone, not the host's launch.
SPIN_CYCLES = 1_000_000


def _cuda_device_s(fn: Callable[[], object], iters: int) -> tuple[list[float], float]:
    """Device seconds per `fn()` (one op enqueued on the current stream), by CUDA events, after
    a warm-up; and the median host seconds `fn()` took to enqueue it."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times, host = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times, statistics.median(host)


def _cuda_copy_s(dst: torch.Tensor, src: torch.Tensor, iters: int) -> list[float]:
    """Device seconds per `dst.copy_(src)`."""
    return _cuda_device_s(lambda: dst.copy_(src), iters)[0]


def _cross_copy_s(dst: torch.Tensor, src: torch.Tensor, iters: int) -> list[float]:
    """Seconds per GPU-to-GPU `dst.copy_(src)` (wall clock, both devices synchronized)."""

    def sync() -> None:
        torch.cuda.synchronize(src.device)
        torch.cuda.synchronize(dst.device)

    for _ in range(3):
        dst.copy_(src)
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t0)
    return times


def _cpu_copy_s(dst: torch.Tensor, src: torch.Tensor, iters: int) -> list[float]:
    dst.copy_(src)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return times


async def _sender(
    address: str, ns: argparse.Namespace, conn: Connection | None = None
) -> dict[str, Any]:
    from tandem.kv_transfer.base import KVDestination

    torch.set_num_threads(1 if ns.mode == "cpu" else torch.get_num_threads())
    device = _device(ns.mode)
    shape = cache_shape(ns)
    gen = torch.Generator(device=device).manual_seed(0)
    cache = torch.randn(shape, generator=gen, device=device, dtype=getattr(torch, ns.dtype))
    n = -(-ns.tokens // ns.block_size)
    block_bytes = cache[0].numel() * cache.element_size()
    prompt_bytes = n * block_bytes
    rng = random.Random(1)
    out: dict[str, Any] = {"prompt_blocks": n, "prompt_bytes": prompt_bytes}

    # Local copy bandwidth, same bytes.
    rows = cache.view(shape[0], -1)
    if ns.mode == "cuda":
        local = _cuda_copy_s(rows[n : 2 * n], rows[:n], ns.iters)
        out["d2d_copy"] = _summary(prompt_bytes, local)
    elif ns.mode == "nccl":
        other = torch.empty_like(rows[:n], device=_device("nccl", receiver=True))
        local = _cross_copy_s(other, rows[:n], ns.iters)
        out["gpu_to_gpu_copy"] = _summary(prompt_bytes, local)
        del other
    else:
        local = _cpu_copy_s(rows[n : 2 * n], rows[:n], ns.iters)
        out["memcpy"] = _summary(prompt_bytes, local)
    reference = prompt_bytes / statistics.median(local) / 1e9
    ref_name = {
        "cuda": "fraction_of_d2d",
        "nccl": "fraction_of_gpu_to_gpu",
        "cpu": "fraction_of_memcpy",
    }[ns.mode]

    connectors = _connectors(ns.mode, cache, "bench-prefill", ns.connectors, ns.shm_path)
    for name, connector in connectors.items():

        def dest(dst: list[int], name: str = name) -> KVDestination:
            return KVDestination("bench-decode", address, tuple(dst), name)

        history = getattr(connector, "history", None)
        if ns.mode == "cuda":
            # A raw copy into the IPC-mapped cache (no session): the mapping's own rate.
            peer = await connector.peer(dest([0]))
            raw = _cuda_copy_s(peer.rows[:n], peer.local_rows[:n], ns.iters)
            out[f"{name}_raw_copy"] = _summary(prompt_bytes, raw)
            out[f"{name}_raw_copy"]["fraction_of_d2d"] = (
                out[f"{name}_raw_copy"]["GBps_median"] / reference
            )
            out.update(_kernel_figures(cache, peer.tensor, n, ns.iters, reference, rng))
        for pattern in ("contiguous", "scattered"):
            totals, datas = [], []
            for i in range(ns.warmup + ns.iters):
                src = _ids(rng, shape[0], n, pattern)
                dst = _ids(rng, shape[0], n, pattern)
                t0 = time.perf_counter()
                moved = await connector.send_blocks(f"{name}-{pattern}-{i}", src, dest(dst))
                total = time.perf_counter() - t0
                assert moved == prompt_bytes, (moved, prompt_bytes)
                if i >= ns.warmup:
                    totals.append(total)
                    datas.append(history[-1].data_s if history else total)
            key = f"{name}_{pattern}"
            out[key] = {"session": _summary(prompt_bytes, totals)}
            if history is not None:
                out[key]["data"] = _summary(prompt_bytes, datas)
            for part in out[key].values():
                part[ref_name] = part["GBps_median"] / reference
        levels = sorted(ns.concurrency)
        for c in levels:
            prompts = ns.prompts or max(64, 4 * c)
            key = f"{name}_throughput" if c == levels[-1] else f"{name}_throughput_c{c}"
            out[key] = await _throughput(connector, dest, shape[0], n, c, prompts, rng, conn)
            out[key][ref_name] = out[key]["GBps"] / reference
        await connector.close()
    return out


def _kernel_figures(
    cache: torch.Tensor,
    remote: torch.Tensor,
    n: int,
    iters: int,
    reference: float,
    rng: random.Random,
) -> dict[str, Any]:
    """`copy_blocks` alone (one launch, device time) into the IPC-mapped cache: n consecutive
    pairs, and n shuffled pairs (also at other chunk sizes)."""
    from tandem_kernels.block_copy import CHUNK_BYTES, copy_blocks

    out: dict[str, Any] = {}
    prompt_bytes = n * cache[0].numel() * cache.element_size()
    for pattern in ("contiguous", "scattered"):
        src = _ids(rng, cache.shape[0], n, pattern)
        dst = _ids(rng, remote.shape[0], n, pattern)
        mapping = torch.tensor(list(zip(src, dst, strict=True)), device=cache.device)

        def launch(mapping: torch.Tensor = mapping, chunk_bytes: int = CHUNK_BYTES) -> None:
            copy_blocks(cache, remote, mapping, chunk_bytes=chunk_bytes)

        times, host_s = _cuda_device_s(launch, iters)
        key = f"copy_blocks_kernel_{pattern}"
        out[key] = _summary(prompt_bytes, times)
        out[key]["fraction_of_d2d"] = out[key]["GBps_median"] / reference
        out[key]["host_launch_us"] = host_s * 1e6
        out[key]["chunk_bytes"] = CHUNK_BYTES
        if pattern != "scattered":
            continue
        by_chunk: dict[str, float] = {}
        for chunk_bytes in (16 * 1024, 64 * 1024, 128 * 1024):
            times, _ = _cuda_device_s(lambda c=chunk_bytes: launch(chunk_bytes=c), iters)
            by_chunk[str(chunk_bytes)] = prompt_bytes / statistics.median(times) / 1e9
        out[key]["GBps_median_by_chunk_bytes"] = by_chunk
    return out


async def _throughput(
    connector: Any,
    dest: Any,
    num_blocks: int,
    n: int,
    concurrency: int,
    prompts: int,
    rng: random.Random,
    conn: Connection | None = None,
) -> dict[str, Any]:
    """`prompts` prompts through `concurrency` closed-loop senders (one warm-up round first);
    sender j writes destination blocks [j*n, (j+1)*n). With `conn` (to the receiver process),
    also the CPU time per prompt of each process (every thread: the host cost, which a busy
    machine does not inflate as it does wall time)."""

    async def receiver_cpu_s() -> float:
        if conn is None:
            return 0.0
        conn.send("cpu")
        return float(await asyncio.get_running_loop().run_in_executor(None, conn.recv))

    prompt_bytes = n * connector.layout.bytes_per_block
    history = getattr(connector, "history", None)
    counter = iter(range(1 << 30))

    async def sender(j: int, count: int) -> None:
        for _ in range(count):
            src = _ids(rng, num_blocks, n, "contiguous")
            dst = list(range(j * n, (j + 1) * n))
            moved = await connector.send_blocks(f"tp-{j}-{next(counter)}", src, dest(dst))
            assert moved == prompt_bytes, (moved, prompt_bytes)

    per = [prompts // concurrency + (j < prompts % concurrency) for j in range(concurrency)]
    await asyncio.gather(*(sender(j, 1) for j in range(concurrency)))  # warm-up
    before = len(history) if history is not None else 0
    recv0 = await receiver_cpu_s()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    await asyncio.gather(*(sender(j, per[j]) for j in range(concurrency)))
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    recv_cpu = await receiver_cpu_s() - recv0
    result: dict[str, Any] = {
        "prompts": prompts,
        "concurrency": concurrency,
        "wall_ms": wall * 1e3,
        "GBps": prompts * prompt_bytes / wall / 1e9,
        "ms_per_prompt": wall * 1e3 / prompts,
        "sender_cpu_us_per_prompt": cpu * 1e6 / prompts,
    }
    if conn is not None:
        result["receiver_cpu_us_per_prompt"] = recv_cpu * 1e6 / prompts
    if history is not None:
        records = list(history)[before:]
        result["max_sessions"] = connector.max_sessions
        result["mean_requests_per_session"] = statistics.mean(r.batch_size for r in records)
        result["median_request_latency_ms"] = statistics.median(r.total_s for r in records) * 1e3
        result["median_session_data_ms"] = statistics.median(r.data_s for r in records) * 1e3
    return result


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["cuda", "nccl", "cpu"], default="cuda")
    p.add_argument("--tokens", type=int, default=2048, help="prompt length")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-blocks", type=int, default=0, help="cache blocks per process")
    p.add_argument("--iters", type=int, default=0, help="timed prompts per pattern")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--concurrency",
        type=_int_list,
        default=[8, 32],
        help="throughput: senders in flight, one run per comma-separated value",
    )
    p.add_argument(
        "--prompts",
        type=int,
        default=0,
        help="throughput: prompts per run (default: 4 per sender, at least 64)",
    )
    p.add_argument(
        "--connectors",
        default=",".join(CPU_CONNECTORS),
        help=f"cpu mode: the connectors to run, comma-separated, of {','.join(CPU_CONNECTORS)}",
    )
    p.add_argument("--out", default="", help="write the JSON here")
    ns = p.parse_args(argv)
    ns.connectors = tuple(c.strip() for c in ns.connectors.split(",") if c.strip())
    if not ns.connectors or any(c not in CPU_CONNECTORS for c in ns.connectors):
        p.error(f"--connectors takes names of {CPU_CONNECTORS}, got {ns.connectors}")
    ns.shm_path = f"/dev/shm/tandem-kv-bench-{os.getpid()}.bin"
    n = -(-ns.tokens // ns.block_size)
    most = max(ns.concurrency)
    ns.num_blocks = ns.num_blocks or max(4, most) * n
    ns.iters = ns.iters or (20 if ns.mode != "cpu" else 5)
    if ns.num_blocks < max(2, most) * n:
        p.error("--num-blocks must hold two prompts, and one per throughput sender")
    if ns.mode == "cuda" and not torch.cuda.is_available():
        p.error("--mode cuda needs a CUDA device")
    if ns.mode == "nccl" and torch.cuda.device_count() < 2:
        p.error("--mode nccl needs two CUDA devices")

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    receiver = ctx.Process(
        target=receiver_main,
        args=(child, ns.mode, cache_shape(ns), ns.dtype, ns.connectors, ns.shm_path),
        daemon=True,
    )
    receiver.start()
    try:
        if not conn.poll(120):
            raise SystemExit("the receiver process did not start")
        address = conn.recv()
        t0 = time.perf_counter()
        results = asyncio.run(_sender(address, ns, conn))
        elapsed = time.perf_counter() - t0
    finally:
        conn.send("stop")
        receiver.join(timeout=30)
        if receiver.is_alive():
            receiver.kill()
        if os.path.exists(ns.shm_path):
            os.unlink(ns.shm_path)

    report = {
        "benchmark": "kv_transfer",
        "mode": ns.mode,
        "device": (
            torch.cuda.get_device_name()
            if ns.mode != "cpu"
            else f"{platform.machine()} CPU, {os.cpu_count()} cores"
        ),
        "torch": torch.__version__,
        "shape": {
            "tokens": ns.tokens,
            "layers": ns.layers,
            "kv_heads": ns.kv_heads,
            "head_size": ns.head_size,
            "block_size": ns.block_size,
            "dtype": ns.dtype,
            "num_blocks": ns.num_blocks,
        },
        "iters": ns.iters,
        "connectors": list(ns.connectors) if ns.mode == "cpu" else [],
        "concurrency": ns.concurrency,
        "elapsed_s": elapsed,
        "results": results,
    }
    _print(report)
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {ns.out}")
    return 0


def _print(report: dict[str, Any]) -> None:
    r = report["results"]
    local = next(v for k, v in r.items() if k in ("d2d_copy", "gpu_to_gpu_copy", "memcpy"))
    reference = local["GBps_median"]
    mib = r["prompt_bytes"] / (1 << 20)
    print(
        f"KV transfer, {report['mode']} ({report['device']}): {report['shape']['tokens']} tokens "
        f"= {r['prompt_blocks']} blocks = {mib:.0f} MiB per prompt"
    )
    for key, value in r.items():
        if not isinstance(value, dict):
            continue
        if "GBps" in value:  # throughput
            frac = next((v for k, v in value.items() if k.startswith("fraction_of")), 0.0)
            sessions = value.get("max_sessions")
            print(
                f"  {key:<32} {value['GBps']:8.2f} GB/s aggregate "
                f"{value['ms_per_prompt']:8.3f} ms/prompt  ({frac:.0%} of the local copy; "
                f"{value['prompts']} prompts, {value['concurrency']} in flight, "
                f"{value.get('mean_requests_per_session', 1):.1f} per session"
                + (f", at most {sessions} sessions in flight" if sessions else "")
                + ")"
            )
            if "receiver_cpu_us_per_prompt" in value:
                print(
                    f"  {'':<32} CPU per prompt: sender "
                    f"{value['sender_cpu_us_per_prompt']:.0f} us, receiver "
                    f"{value['receiver_cpu_us_per_prompt']:.0f} us"
                )
            continue
        parts = value.items() if "session" in value else [("", value)]
        for part, s in parts:
            frac = next((v for k, v in s.items() if k.startswith("fraction_of")), None)
            extra = f"  ({frac:.0%} of the local copy)" if frac is not None else ""
            if "host_launch_us" in s:
                extra += f"  launch {s['host_launch_us']:.0f} us on the host"
            label = f"{key} {part}".strip()
            print(
                f"  {label:<32} {s['GBps_median']:8.2f} GB/s median  "
                f"{s['median_ms']:8.3f} ms{extra}"
            )
            for chunk, rate in s.get("GBps_median_by_chunk_bytes", {}).items():
                label = f"{key} chunk {int(chunk) // 1024} KiB"
                print(f"  {label:<32} {rate:8.2f} GB/s median  ({rate / reference:.0%})")


if __name__ == "__main__":
    raise SystemExit(main())
