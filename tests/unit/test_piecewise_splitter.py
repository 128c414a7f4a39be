"""The runner's piecewise graph splitting on the CPU: a fake graph object stands in for
`torch.cuda.CUDAGraph` (the CPU cannot capture), so these tests pin where the forward is split
(at every Attention layer, nowhere else), the order of captures, K/V writes and attention
calls, and what each replayed attention reads. The real captures run in tests/gpu.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, ClassVar

import pytest
import torch

from tandem.layers.attention import torch_backend
from tandem.layers.attention.backend import AttentionMetadata
from tandem.layers.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from tandem.loader import build_model
from tandem.models.interface import ModelContext
from tandem.worker.piecewise_graph import AttentionSplitter, PiecewiseCudaGraphs
from tests.conftest import build_attn_metadata

BLOCK_SIZE = 16


@pytest.fixture(autouse=True)
def _kv_write_skips_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch backend's K/V write, skipping slots < 0 (padding) as graph backends do, and
    writing nothing for an empty slot mapping (K/V written inside the pieces)."""

    def write(
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slots: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        n = slots.numel()
        keep = slots >= 0
        write_kv_cache(key[:n][keep], value[:n][keep], kv_cache, slots[keep], k_scale, v_scale)

    monkeypatch.setattr(torch_backend, "write_kv_cache", write)


class EventLog:
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []


class FakeGraph:
    """Records capture_begin / capture_end / replay into the shared log."""

    count = 0

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.id = FakeGraph.count
        FakeGraph.count += 1
        self.captured = False

    def capture_begin(self, pool: Any = None) -> None:
        assert not self.captured
        self.log.events.append(("begin", self.id))

    def capture_end(self) -> None:
        self.captured = True
        self.log.events.append(("end", self.id))

    def replay(self) -> None:
        assert self.captured
        self.log.events.append(("replay", self.id))


class RecordingBackend(TorchAttentionBackend):
    """The torch backend, logging its K/V writes and attention calls."""

    name: ClassVar[str] = "recording"

    def __init__(self, log: EventLog, kv_write_in_graph: bool) -> None:
        super().__init__()
        self.log = log
        self.kv_write_in_graph = kv_write_in_graph

    @property  # type: ignore[override]
    def graph_kv_write(self) -> bool:
        return self.kv_write_in_graph

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        self.log.events.append(("write_kv", key.shape[0]))
        torch_backend.write_kv_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        self.log.events.append(
            ("attend", query.shape[0], metadata.slot_mapping.numel(), query.data_ptr())
        )
        return super().forward(
            query, key, value, kv_cache, metadata, scale, k_scale, v_scale, sliding_window
        )


def _model(path: Any, backend: RecordingBackend) -> Any:
    ctx = ModelContext.single(torch.float32, torch.device("cpu"), backend)
    return build_model(path, ctx)


def _kv(model: Any, num_blocks: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    kv = torch.zeros(num_blocks, model.num_layers, 2, BLOCK_SIZE, model.num_kv_heads, 16)
    return kv, [kv[:, i] for i in range(model.num_layers)]


def _mixed_step(vocab: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """A decode over 11 cached tokens, a chunk of 20 over 7 cached, a new prompt of 5."""
    rng = random.Random(5)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = [ids[0:1], ids[1:3], ids[3:4]]
    query_lens, seq_lens = [1, 20, 5], [12, 27, 5]
    md = build_attn_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)
    md.num_decodes = 1
    input_ids = torch.tensor([rng.randrange(3, vocab) for _ in range(sum(query_lens))])
    positions = torch.cat(
        [torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)]
    )
    return input_ids, positions, md


@pytest.mark.parametrize("kv_write_in_graph", [True, False])
@torch.inference_mode()
def test_capture_splits_at_every_attention_and_replay_interleaves(
    kv_write_in_graph: bool, tiny_model_path
) -> None:
    """Capture: one piece more than attention layers; each piece ends right after its K/V
    write (graph_kv_write backends) and the attention runs between two pieces. Replay: the
    pieces in capture order with each layer's attention between them, on the step's n rows
    of the very Q the capture kept, with the step's slots in the static slot mapping."""
    log = EventLog()
    backend = RecordingBackend(log, kv_write_in_graph)
    model = _model(tiny_model_path("llama"), backend)
    kv, views = _kv(model, 8)
    graphs = PiecewiseCudaGraphs([32, 48, 4096], 64, torch.device("cpu"), lambda: FakeGraph(log))
    assert graphs.sizes == [32, 48]
    graphs.capture(model, views)
    assert set(graphs.buckets) == {32, 48}
    layers = model.num_layers
    for size, bucket in graphs.buckets.items():
        assert len(bucket.graphs) == layers + 1 and len(bucket.sites) == layers
        assert [s.query.shape[0] for s in bucket.sites] == [size] * layers
        assert all(buf.abs().sum() == 0 for buf in bucket.out_buffers.values())
    # The last capture (bucket 32, captured after 48): from its first begin on.
    g0 = graphs.buckets[32].graphs[0].id  # type: ignore[attr-defined]
    start = log.events.index(("begin", g0))
    capture = [e[:3] if e[0] == "attend" else e for e in log.events[start:]]
    expected: list[tuple[Any, ...]] = []
    for i in range(layers):
        expected.append(("begin", g0 + i))
        if kv_write_in_graph:
            expected.append(("write_kv", 32))
        expected += [("end", g0 + i), ("attend", 32, 0 if kv_write_in_graph else 32)]
    expected += [("begin", g0 + layers), ("end", g0 + layers)]
    assert capture == expected
    assert not kv.any()  # the capture's slots are all -1

    input_ids, positions, md = _mixed_step(model.vocab_size, 8)
    n = input_ids.shape[0]
    assert graphs.size_for(n) == 32 and graphs.size_for(49) is None
    del log.events[:]
    graphs.replay(32, input_ids, positions, md)
    bucket = graphs.buckets[32]
    replay = log.events
    assert [e[0] for e in replay] == ["replay", "attend"] * layers + ["replay"]
    assert [e[1] for e in replay if e[0] == "replay"] == [g.id for g in bucket.graphs]  # type: ignore[attr-defined]
    for event, site in zip([e for e in replay if e[0] == "attend"], bucket.sites, strict=True):
        assert event[1] == n and event[3] == site.query.data_ptr()
        assert event[2] == (0 if kv_write_in_graph else n)
    assert bucket.input_ids[:n].tolist() == input_ids.tolist()
    assert bucket.positions[:n].tolist() == positions.tolist()
    if kv_write_in_graph:
        assert bucket.slot_mapping[:n].tolist() == md.slot_mapping.tolist()
        assert (bucket.slot_mapping[n:] == -1).all()
    assert graphs.num_replays == 1
    graphs.clear()
    assert not graphs.buckets and graphs.size_for(1) is None


@pytest.mark.parametrize("kv_write_in_graph", [True, False])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.inference_mode()
def test_split_forward_equals_the_forward(arch: str, kv_write_in_graph: bool, tiny_model_path):
    """The forward through the splitter (what a bucket runs, here eagerly on a real mixed
    step: K/V written from the static slot mapping, attention into the static buffer) equals
    the plain forward bit for bit and writes the same KV cache."""
    log = EventLog()
    model = _model(tiny_model_path(arch), RecordingBackend(log, kv_write_in_graph))
    input_ids, positions, md = _mixed_step(model.vocab_size, 8)
    n = input_ids.shape[0]
    kv, views = _kv(model, 8)
    kv.normal_()  # the cached context
    kv_split = kv.clone()
    whole = model(input_ids, positions, views, md)
    graphs = PiecewiseCudaGraphs([n], n, torch.device("cpu"), lambda: FakeGraph(log))
    split_views = [kv_split[:, i] for i in range(model.num_layers)]
    graphs.capture(model, split_views)
    bucket = graphs.buckets[n]
    bucket.slot_mapping.copy_(md.slot_mapping)
    splitter = AttentionSplitter(bucket, md)
    split = model(
        input_ids, positions, split_views, dataclasses.replace(md, graph_splitter=splitter)
    )
    assert len(splitter.sites) == model.num_layers
    assert all(site.out is bucket.sites[i].out for i, site in enumerate(splitter.sites))
    assert torch.equal(whole, split)
    assert torch.equal(kv, kv_split)
