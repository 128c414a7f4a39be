"""NCCL KV mover: block runs sent over a two-rank process group per prefill-decode pair.

The group is set up on first use. The prefill worker asks the decode worker (`ConnectKV` of
the session layer: the decode side's `handshake`), which starts a TCP store on its host (once)
and answers with the store's port and a fresh group name (an `NcclRendezvous`); both build
the group from the store (decode rank 0, prefill rank 1; the decode side starts building
before it answers) and exchange one small tensor, so the communicator exists before the first
request. Backend "nccl" for CUDA caches, "gloo" for CPU caches: the
same code path runs on either.

Per request (one WriteKV session; one session at a time per pair, so both ranks post their
operations in the same order):

    decode:  one receive per destination run, straight into the reserved blocks
             (a run of consecutive blocks is one contiguous span of the cache)
    prefill: one send per destination run: a slice of the cache where the held blocks are
             consecutive, else the blocks gathered into one buffer

Each side runs its group operations on the pair's own thread (they block) and, on CUDA, on the
pair's own stream, then waits for that stream once. A session that breaks retires the pair on
both sides (the receiver first waits until no receive can still land); the next request
connects again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime
import itertools
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tandem.kv_transfer.base import EngineHandle, KVDestination, KVTransferError
from tandem.kv_transfer.mover import DstRun, KVMover, Run, consecutive, run_to_end
from tandem.kv_transfer.placement import NCCL

logger = logging.getLogger(__name__)

DECODE_RANK = 0
PREFILL_RANK = 1
_HELLO = 0x7A4D  # first message of a pair: (hello, bytes per block)


def _as_bytes(blocks: torch.Tensor) -> torch.Tensor:
    """Contiguous cache blocks as a flat uint8 view (the same memory): NCCL and gloo move
    bytes whatever the cache's dtype (FP8 included), never a dtype-specific reduction type.
    A copy would receive into nothing: the blocks must be one contiguous span."""
    assert blocks.is_contiguous(), "KV blocks to move must be contiguous"
    return blocks.view(-1).view(torch.uint8)


def default_backend(kv_cache: torch.Tensor) -> str:
    return "nccl" if kv_cache.device.type == "cuda" else "gloo"


def split_address(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class NcclRendezvous:
    """Where a prefill worker joins the pair's process group: a TCP store on the decode
    worker's host (the host of its gRPC address); the decode worker is rank 0, the prefill
    worker rank 1 (carried as the `NcclRendezvous` message of ConnectKV, field for field)."""

    store_port: int
    # Key prefix of the pair's group in the store; names the pair in WriteKV.
    group_name: str
    # "nccl" (CUDA caches) or "gloo" (CPU caches).
    backend: str


@dataclass
class Pair:
    """One prefill-decode pair's process group, as one side holds it."""

    name: str
    rank: int
    executor: concurrent.futures.ThreadPoolExecutor
    # The group once built (the build runs first on the pair's thread).
    group: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)
    store: Any = None
    stream: Any = None
    broken: bool = False

    def retire(self) -> None:
        self.broken = True
        self.executor.shutdown(wait=False)


class NcclMover(KVMover[Pair]):
    transport = NCCL

    def __init__(
        self,
        kv_cache: torch.Tensor,
        engine: EngineHandle,
        worker_id: str = "",
        backend: str = "",
        group_timeout_s: float = 30.0,
    ) -> None:
        # One session at a time per pair: both ranks must post their operations in one order.
        super().__init__(kv_cache, engine, worker_id, max_sessions=1)
        self.backend = backend or default_backend(kv_cache)
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be nccl or gloo, got {self.backend!r}")
        if self.backend == "nccl" and kv_cache.device.type != "cuda":
            raise ValueError("the nccl backend needs a KV cache on a CUDA device")
        if self.backend == "gloo" and kv_cache.device.type != "cpu":
            raise ValueError("the gloo backend here moves CPU KV caches only")
        self.device = kv_cache.device
        self.group_timeout_s = group_timeout_s
        self._store: Any = None  # the decode side's TCP store (rank 0 of every pair)
        self._pairs: dict[str, Pair] = {}  # decode side: group name -> pair
        self._latest: dict[str, str] = {}  # decode side: prefill worker id -> group name
        self._names = itertools.count()

    # ------------------------------------------------------------------ group plumbing

    def _new_pair(self, name: str, rank: int, store: Any) -> Pair:
        pair = Pair(
            name,
            rank,
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kv-nccl-{rank}"),
            store=store,
        )
        build = pair.executor.submit(self._build_group, pair)

        def done(f: concurrent.futures.Future[Any]) -> None:
            if f.exception() is not None:
                pair.broken = True
                pair.group.set_exception(f.exception())  # type: ignore[arg-type]
            else:
                pair.group.set_result(f.result())

        build.add_done_callback(done)
        return pair

    def _build_group(self, pair: Pair) -> Any:
        """Runs on the pair's thread; blocks until both ranks joined and said hello."""
        timeout = datetime.timedelta(seconds=self.group_timeout_s)
        prefix = dist.PrefixStore(pair.name, pair.store)
        if self.backend == "gloo":
            group: Any = dist.ProcessGroupGloo(prefix, pair.rank, 2, timeout)
        else:
            torch.cuda.set_device(self.device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(prefix, pair.rank, 2, options)
            pair.stream = torch.cuda.Stream(device=self.device)
        hello = torch.tensor([_HELLO, self.layout.bytes_per_block], dtype=torch.int64)
        with self._on_stream(pair):
            buf = (
                hello.to(self.device)
                if pair.rank == PREFILL_RANK
                else torch.zeros(2, dtype=torch.int64, device=self.device)
            )
            if pair.rank == PREFILL_RANK:
                group.send([buf], DECODE_RANK, 0).wait()
            else:
                group.recv([buf], PREFILL_RANK, 0).wait()
            self._sync(pair)
        if pair.rank == DECODE_RANK and not torch.equal(buf.cpu(), hello):
            raise KVTransferError(f"pair {pair.name}: unexpected hello {buf.tolist()}")
        return group

    def _on_stream(self, pair: Pair) -> Any:
        if pair.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(pair.stream)

    def _sync(self, pair: Pair) -> None:
        if pair.stream is not None:
            pair.stream.synchronize()

    def _pair_group(self, pair: Pair) -> Any:
        if pair.broken and not pair.group.done():
            raise KVTransferError(f"pair {pair.name} was retired")
        return pair.group.result(timeout=self.group_timeout_s)

    # ------------------------------------------------------------------ receiver

    async def handshake(self, prefill_worker_id: str) -> NcclRendezvous:
        if self._store is None:
            self._store = dist.TCPStore(
                "127.0.0.1",
                0,
                None,
                True,
                timeout=datetime.timedelta(seconds=self.group_timeout_s),
                wait_for_workers=False,
            )
        sender = prefill_worker_id or "prefill"
        receiver = self.worker_id or "decode"
        name = f"tandem-kv/{receiver}/{sender}/{next(self._names)}-{uuid.uuid4().hex[:8]}"
        old = self._latest.get(sender)
        if old is not None and old in self._pairs:
            # The sender connected again (restarted, or a session broke): its old group is dead.
            self._pairs.pop(old).retire()
        self._pairs[name] = self._new_pair(name, DECODE_RANK, self._store)
        self._latest[sender] = name
        return NcclRendezvous(store_port=self._store.port, group_name=name, backend=self.backend)

    async def begin_receive(
        self, group_name: str, runs: list[DstRun]
    ) -> tuple[Pair, concurrent.futures.Future[None]]:
        pair = self._pairs.get(group_name)
        if pair is None or pair.broken:
            raise KVTransferError(
                f"no live KV pair group {group_name!r} here; the sender must connect again"
            )
        for first_block, n in runs:
            if first_block + n > self.cache.num_blocks:
                raise KVTransferError(
                    f"blocks {first_block}..{first_block + n - 1} are outside the cache"
                )
        # Posted now, waited for at DONE: the sender may start sending as soon as it reads READY.
        return pair, pair.executor.submit(self._receive_runs, pair, runs)

    def _receive_runs(self, pair: Pair, runs: list[DstRun]) -> None:
        group = self._pair_group(pair)
        cache = self.cache.kv_cache
        with self._on_stream(pair):
            # Raw bytes: any cache dtype (an FP8 cache too) travels as uint8. A run that is not
            # one span of the cache (a layer-major CPU cache) lands in a buffer first and is
            # scattered into its blocks once received.
            dsts = [cache[first : first + n] for first, n in runs]
            bufs = [
                d
                if d.is_contiguous()
                else torch.empty_like(d, memory_format=torch.contiguous_format)
                for d in dsts
            ]
            works = [group.recv([_as_bytes(b)], PREFILL_RANK, 0) for b in bufs]
            for work in works:
                work.wait()
            for d, b in zip(dsts, bufs, strict=True):
                if b is not d:
                    d.copy_(b)
            self._sync(pair)

    async def end_receive(self, receipt: tuple[Pair, concurrent.futures.Future[None]]) -> None:
        pair, future = receipt
        try:
            await asyncio.wrap_future(future)
        except Exception as exc:
            self._retire(pair)
            raise KVTransferError(f"receiving KV over pair {pair.name} failed: {exc}") from exc

    async def abandon_receive(self, receipt: tuple[Pair, concurrent.futures.Future[None]]) -> None:
        pair, future = receipt
        self._retire(pair)
        # A receive still posted may yet land: wait until it finished or failed (the group's
        # timeout bounds it) before the blocks can be freed.
        try:
            await asyncio.wrap_future(future)
        except Exception as exc:
            logger.info("abandoned KV receive over %s ended: %s", pair.name, exc)

    def _retire(self, pair: Pair) -> None:
        if self._pairs.get(pair.name) is pair:
            del self._pairs[pair.name]
        pair.retire()

    # ------------------------------------------------------------------ sender

    async def open(self, dst: KVDestination, handshake: object | None) -> Pair:
        if not isinstance(handshake, NcclRendezvous):
            raise KVTransferError(f"{dst.worker_id} sent no NCCL rendezvous")
        rendezvous = handshake
        if rendezvous.backend != self.backend:
            raise KVTransferError(
                f"{dst.worker_id} uses backend {rendezvous.backend}, this worker {self.backend}"
            )
        host, _ = split_address(dst.address)
        timeout = datetime.timedelta(seconds=self.group_timeout_s)
        pair = Pair(
            rendezvous.group_name,
            PREFILL_RANK,
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-nccl-1"),
        )

        def join() -> Any:
            pair.store = dist.TCPStore(host, rendezvous.store_port, None, False, timeout=timeout)
            return self._build_group(pair)

        try:
            group = await run_to_end(pair.executor, join)
        except Exception as exc:
            pair.retire()
            raise KVTransferError(
                f"joining the KV pair group of {dst.worker_id} failed: {exc}"
            ) from exc
        pair.group.set_result(group)
        return pair

    def group_name(self, peer: Pair) -> str:
        return peer.name

    async def write(self, peer: Pair, src: list[int], runs: list[Run]) -> None:
        if any(b < 0 or b >= self.cache.num_blocks for b in src):
            raise KVTransferError("source block ids out of range")
        await run_to_end(peer.executor, self._send_runs, peer, src, runs)

    def _send_runs(self, pair: Pair, src: list[int], runs: list[Run]) -> None:
        group = self._pair_group(pair)
        cache = self.cache.kv_cache
        with self._on_stream(pair):
            tensors = []
            for pos, _first, n in runs:
                ids = src[pos : pos + n]
                if consecutive(ids):  # one span of a block-major cache: sent in place
                    tensors.append(cache[ids[0] : ids[0] + n].contiguous())
                else:
                    tensors.append(cache.index_select(0, torch.tensor(ids, device=self.device)))
            works = [group.send([_as_bytes(t)], DECODE_RANK, 0) for t in tensors]
            for work in works:
                work.wait()
            self._sync(pair)

    def close_peer(self, peer: Pair) -> None:
        peer.retire()

    async def close(self) -> None:
        for pair in self._pairs.values():
            pair.retire()
        self._pairs.clear()
