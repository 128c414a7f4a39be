"""Piecewise CUDA graphs of mixed steps (prefill and decode tokens together), one set per
bucketed token count, split at the model's attention layers by the runner.

A mixed step cannot be one graph: its attention depends on how its tokens split into
requests (query lengths, prefill and decode rows), which only the host knows per step. Every
other op is per token row, so the forward between two attention calls is captured as one
graph for a fixed number of rows, and the attention (prefill/decode kernels) runs eagerly
between the replays on the step's real rows. No model knows of this: the runner sets
`AttentionMetadata.graph_splitter` and every `tandem.layers.attention.Attention` call goes to
the splitter, which ends the graph being captured there.

Capture of a bucket of S rows (one model forward, on a side stream)::

    begin(g0) embed ... qkv(0) [write_kv(0)] end(g0) | attention 0 -> out | begin(g1) o_proj
    ... qkv(1) [write_kv(1)] end(g1) | attention 1 -> out | begin(g2) ... norm end(g2)

Replay of a step of n <= S rows::

    g0 | attention 0 on (q0, k0, v0)[:n] -> out[:n] | g1 | attention 1 ... | g_last

At each attention call the splitter keeps the call's layer, its Q/K/V (outputs of the graph
just ended, at fixed addresses in the pool) and its KV cache view; the attention output is
copied into one static buffer per bucket (per output width), which the next graph reads.
Where the layer's backend can (`graph_kv_write`), the step's K/V writes go inside the graphs,
from a static slot mapping (padding -1), and the eager attention gets an empty slot mapping;
else the eager attention writes them. Rows n.. are padding: their ids and positions are
whatever the buffers hold; rows never mix, and neither the cache nor a real row sees them.
An eager forward of an 8B model costs the host about 17 ms (kernel launches: measured on an
H200 against 5.7 ms of device time); this leaves one graph launch per layer plus the
attention's. Collectives inside the pieces (TP all-reduces) are captured with them.

Invariants: every tensor a piece or an attention call reads is held from capture to
`clear`, at the address it was captured at; buckets share one memory pool, and one bucket's
pieces always replay in capture order, never interleaved with another bucket's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tandem.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from tandem.layers.attention.layer import Attention
    from tandem.models.interface import CausalLM

logger = logging.getLogger(__name__)


class GraphPiece(Protocol):
    """What the splitter needs of a graph (`torch.cuda.CUDAGraph`; a fake in CPU tests)."""

    def capture_begin(self, pool: Any = None) -> None: ...

    def capture_end(self) -> None: ...

    def replay(self) -> None: ...


@dataclass
class AttentionSite:
    """One attention call of a captured forward: what its replay runs on."""

    layer: Attention
    query: torch.Tensor  # [S, H, D], written by the graph before it
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    out: torch.Tensor  # [S, H * D] static buffer the graph after it reads


@dataclass
class _Bucket:
    """One token count's graphs and the static tensors they read and write."""

    size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    # The step's slots, padding -1: read by the K/V writes inside the pieces (backends with
    # `graph_kv_write`); unused otherwise.
    slot_mapping: torch.Tensor
    graphs: list[GraphPiece] = field(default_factory=list)
    sites: list[AttentionSite] = field(default_factory=list)
    # Static attention outputs by (width, dtype), shared by the bucket's sites.
    out_buffers: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)
    output: torch.Tensor | None = None

    def out_buffer(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.shape[-1], like.dtype)
        buf = self.out_buffers.get(key)
        if buf is None:
            buf = torch.zeros((self.size, like.shape[-1]), dtype=like.dtype, device=like.device)
            self.out_buffers[key] = buf
        return buf


class AttentionSplitter:
    """The runner's `AttentionMetadata.graph_splitter` while a bucket's forward runs.

    `attend(layer, q, k, v, kv_cache, metadata)` is called by every Attention layer in
    forward order. Warm-up (`capture` None): it runs the call as a capture would, eagerly
    (K/V write, attention on `attn_metadata`, copy into the static output). Capture: the K/V
    write goes into the graph being captured, which then ends; the attention runs outside any
    graph and the next graph begins before the model goes on.
    """

    def __init__(
        self,
        bucket: _Bucket,
        attn_metadata: AttentionMetadata,
        capture: _Capture | None = None,
    ) -> None:
        self.bucket = bucket
        self.attn_metadata = attn_metadata
        self.capture = capture
        self.sites: list[AttentionSite] = []

    def attend(
        self,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        bucket = self.bucket
        meta = self.attn_metadata
        if layer.backend.graph_kv_write:
            layer.backend.write_kv(
                key, value, kv_cache, bucket.slot_mapping, *layer.kv_scales(kv_cache)
            )
            meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping[:0])
        if self.capture is not None:
            self.capture.end()
        out = layer.attend(query, key, value, kv_cache, meta)
        buf = bucket.out_buffer(out)
        buf.copy_(out)
        self.sites.append(AttentionSite(layer, query, key, value, kv_cache, buf))
        if self.capture is not None:
            self.capture.begin()
        return buf


class _Capture:
    """The graphs of one bucket as they are captured, one after another, into `pool`."""

    def __init__(self, new_graph: Callable[[], GraphPiece], pool: Any) -> None:
        self.new_graph = new_graph
        self.pool = pool
        self.graphs: list[GraphPiece] = []
        self.open = False

    def begin(self) -> None:
        graph = self.new_graph()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)
        self.open = True

    def end(self) -> None:
        self.open = False
        self.graphs[-1].capture_end()


class PiecewiseCudaGraphs:
    """Captured mixed-step pieces for one model and KV cache, by token bucket.

    `new_graph` makes the graph objects (default `torch.cuda.CUDAGraph`); `pool` and the
    capture stream are CUDA's unless `device` is not a CUDA device (the CPU tests' fakes).
    """

    def __init__(
        self,
        sizes: Sequence[int],
        max_num_tokens: int,
        device: torch.device,
        new_graph: Callable[[], GraphPiece] | None = None,
    ) -> None:
        # Buckets past the step token budget could never be used.
        self.sizes: list[int] = sorted({s for s in sizes if s <= max_num_tokens})
        self.device = device
        self.new_graph: Callable[[], GraphPiece] = new_graph or torch.cuda.CUDAGraph
        self.buckets: dict[int, _Bucket] = {}
        self.num_replays = 0

    def size_for(self, num_tokens: int) -> int | None:
        """The bucket a mixed step of `num_tokens` tokens replays; None: run it eagerly."""
        if not self.buckets:
            return None
        for size in self.sizes:
            if size >= num_tokens:
                return size
        return None

    def capture(self, model: CausalLM, kv_caches: list[torch.Tensor]) -> None:
        """Capture every bucket's pieces, largest first, after two warm-up forwards each
        (Triton compiles, the allocator settles). The attention between pieces runs on a
        dummy one-request step whose slots are all -1 (nothing is written to the cache)."""
        if not self.sizes:
            return
        cuda = self.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if cuda else None
        with torch.inference_mode(), self._capture_stream():
            for size in reversed(self.sizes):
                self.buckets[size] = self._capture_bucket(model, kv_caches, size, pool)
        if cuda:
            torch.cuda.synchronize(self.device)
        logger.info(
            "captured piecewise CUDA graphs of mixed steps for %s tokens (%d pieces each)",
            self.sizes,
            len(self.buckets[self.sizes[0]].graphs),
        )

    @contextlib.contextmanager
    def _capture_stream(self) -> Iterator[None]:
        """CUDA captures on a side stream (never the legacy default stream)."""
        if self.device.type != "cuda":
            yield
            return
        torch.cuda.synchronize(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def _capture_bucket(
        self, model: CausalLM, kv_caches: list[torch.Tensor], size: int, pool: Any
    ) -> _Bucket:
        dev = self.device
        bucket = _Bucket(
            size=size,
            input_ids=torch.zeros(size, dtype=torch.long, device=dev),
            positions=torch.arange(size, dtype=torch.long, device=dev),
            slot_mapping=torch.full((size,), -1, dtype=torch.long, device=dev),
        )
        dummy = self._dummy_metadata(size, kv_caches[0].shape[2])
        for _ in range(2):  # warm-up
            splitter = AttentionSplitter(bucket, dummy)
            meta = dataclasses.replace(dummy, graph_splitter=splitter)
            model(bucket.input_ids, bucket.positions, kv_caches, meta)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        capture = _Capture(self.new_graph, pool)
        splitter = AttentionSplitter(bucket, dummy, capture)
        meta = dataclasses.replace(dummy, graph_splitter=splitter)
        capture.begin()
        try:
            output = model(bucket.input_ids, bucket.positions, kv_caches, meta)
        finally:
            if capture.open:
                capture.end()
        if not isinstance(output, torch.Tensor):
            raise TypeError("piecewise graphs capture a last pipeline stage (hidden states)")
        bucket.graphs = capture.graphs
        bucket.sites = splitter.sites
        bucket.output = output
        if len(bucket.graphs) != len(bucket.sites) + 1:
            raise RuntimeError(
                f"{len(bucket.sites)} attention calls gave {len(bucket.graphs)} pieces"
            )
        # Padding rows start from zeros, not from the dummy attention's output.
        for buf in bucket.out_buffers.values():
            buf.zero_()
        return bucket

    def _dummy_metadata(self, size: int, block_size: int) -> AttentionMetadata:
        dev = self.device
        num_blocks = -(-size // block_size)
        return AttentionMetadata(
            num_actual_tokens=size,
            num_reqs=1,
            max_query_len=size,
            max_seq_len=size,
            query_start_loc=torch.tensor([0, size], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([size], dtype=torch.int32, device=dev),
            block_table=torch.zeros((1, num_blocks), dtype=torch.int32, device=dev),
            slot_mapping=torch.full((size,), -1, dtype=torch.long, device=dev),
            query_start_loc_cpu=[0, size],
            seq_lens_cpu=[size],
        )

    def replay(
        self,
        size: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The step's forward through bucket `size`: `[n, hidden]` for its n real tokens.

        `input_ids`, `positions`: the step's n tokens on the device; `attn_metadata`: its
        attention metadata (n tokens)."""
        bucket = self.buckets[size]
        self.num_replays += 1
        n = input_ids.shape[0]
        bucket.input_ids[:n].copy_(input_ids)
        bucket.positions[:n].copy_(positions)
        in_graph_meta = attn_metadata
        if any(site.layer.backend.graph_kv_write for site in bucket.sites):
            # The pieces write the K/V: attention gets nothing left to write.
            bucket.slot_mapping[:n].copy_(attn_metadata.slot_mapping[:n])
            bucket.slot_mapping[n:].fill_(-1)
            in_graph_meta = dataclasses.replace(
                attn_metadata, slot_mapping=attn_metadata.slot_mapping[:0]
            )
        graphs = bucket.graphs
        graphs[0].replay()
        for site, graph in zip(bucket.sites, graphs[1:], strict=True):
            meta = in_graph_meta if site.layer.backend.graph_kv_write else attn_metadata
            out = site.layer.attend(
                site.query[:n], site.key[:n], site.value[:n], site.kv_cache, meta
            )
            site.out[:n].copy_(out)
            graph.replay()
        assert bucket.output is not None
        return bucket.output[:n]

    def clear(self) -> None:
        """Drop the graphs (their pool is freed with the last one) and static tensors."""
        self.buckets.clear()
