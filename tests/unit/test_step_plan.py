"""The Triton backend's prefill path is chosen once per step, where the runner builds the
step's attention metadata, and every layer reads it from there (`AttentionBackend.plan_step`).

A ModelRunner with the Triton backend on the CPU runs a tiny two-layer model through real
scheduler steps (prefill chunks beside decodes). The Triton kernels are stood in for by fakes
that record which path each layer took (this process runs no Triton), and the host chooser
(`planned_prefill_path`) is made to answer "triton" (the cascade with our dense kernel, which
the CPU would never pick by itself): a layer choosing on its own would take another path or
call the per-call chooser, and the counts below would differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.engine_args import EngineArgs
from tandem.request import Request
from tandem.sampling_params import SamplingParams


def _runner(path: Path) -> Any:
    from tandem.worker.model_runner import ModelRunner

    config = EngineArgs(
        model=str(path),
        device="cpu",
        dtype="float32",
        attention_backend="triton",
        max_num_batched_tokens=16,
        max_num_seqs=4,
        num_gpu_blocks=64,
        block_size=16,
        max_model_len=128,
    ).create_engine_config()
    m = config.model
    runner = ModelRunner(
        config, torch.device("cpu"), m.model_path, m.hf_config, m.max_model_len, None
    )
    runner.initialize_kv_cache(torch.zeros(runner.kv_cache_shape(config.cache.num_gpu_blocks)))
    return config, runner


class _Fakes:
    """Stand-ins for the kernels the backend calls; each records what ran."""

    def __init__(self) -> None:
        self.planned = 0  # calls of the host chooser (once per step and KV cache group)
        self.per_call = 0  # calls of the per-call chooser (a layer choosing by itself)
        self.paths: list[str] = []  # per prefill-path layer call: "paged" or the dense impl
        self.context_calls = 0  # the cascade's context part, launched

    def planned_prefill_path(
        self, device: torch.device, shape: Any, num_tokens: int, max_query_len: int
    ) -> str:
        assert isinstance(num_tokens, int) and isinstance(max_query_len, int)
        assert device.type == "cpu"
        self.planned += 1
        return "triton"

    def prefill_path(self, *args: Any, **kwargs: Any) -> str:
        self.per_call += 1
        return "paged"

    def dense_causal_attention(
        self, query: torch.Tensor, *args: Any, impl: str, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.paths.append(impl)
        lse = torch.zeros(query.shape[1], query.shape[0])
        return torch.zeros_like(query), lse

    def paged_prefill_attention(self, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.paths.append("paged")
        return kwargs["out"]

    @staticmethod
    def passthrough_out(*args: Any, **kwargs: Any) -> Any:
        return kwargs.get("out")

    def context(self, query: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = args[5]  # kv_cache, qsl, lens, table, scale, out, lse
        self.context_calls += 1
        return out


@pytest.mark.parametrize(("arch", "full_layers"), [("llama", 2), ("qwen2_swa", 1)])
def test_prefill_path_is_planned_once_per_step(
    arch: str, full_layers: int, tiny_model_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama: one KV cache group of two full layers; qwen2_swa: layer 0 full (group 0),
    layer 1 sliding (group 1). Per step with prefill rows: one host choice per group, none
    per layer; every layer, the sliding one included (the cascade masks its window), runs the
    planned path and reads it from the metadata."""
    import tandem.layers.attention.triton_backend as tb
    from tandem.core.scheduler import Scheduler

    monkeypatch.delenv("TANDEM_PREFILL_CASCADE", raising=False)
    fakes = _Fakes()
    monkeypatch.setattr(tb, "planned_prefill_path", fakes.planned_prefill_path)
    monkeypatch.setattr(tb, "prefill_path", fakes.prefill_path)
    monkeypatch.setattr(tb, "dense_causal_attention", fakes.dense_causal_attention)
    monkeypatch.setattr(tb, "paged_prefill_attention", fakes.paged_prefill_attention)
    monkeypatch.setattr(tb, "paged_context_attention", fakes.context)
    monkeypatch.setattr(tb, "paged_decode_attention", fakes.passthrough_out)
    monkeypatch.setattr(tb, "reshape_and_cache", fakes.passthrough_out)

    config, runner = _runner(tiny_model_path(arch))
    backend = runner.attn_backend
    assert isinstance(backend, tb.TritonAttentionBackend) and backend.prefill_cascade is None
    # What each layer call found in its metadata before attending.
    seen: list[tuple[bool, str | None, int | None]] = []
    has_context: list[bool] = []  # per prefill step, as planned
    forward = backend.forward

    def recording_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        meta = args[4]
        seen.append((meta.is_decode_only, meta.prefill_path, kwargs.get("sliding_window")))
        if not meta.is_decode_only:
            has_context.append(meta.prefill_has_context)
        return forward(*args, **kwargs)

    monkeypatch.setattr(backend, "forward", recording_forward)

    sched = Scheduler(
        config.scheduler,
        config.cache,
        config.cache.num_gpu_blocks,
        config.model.max_model_len,
        kv_cache_spec=runner.kv_cache_spec,
    )
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i, prompt in enumerate([list(range(5, 40)), [7, 8, 9, 10, 11]]):
        sched.add_request(Request(f"r{i}", prompt, params))
    prefill_steps = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        calls = len(seen)
        out = runner.execute(so)
        sched.update_from_output(so, out)
        step = seen[calls:]
        assert len(step) == 2  # one call per layer
        if not step[0][0]:
            prefill_steps += 1
    runner.shutdown()

    assert prefill_steps >= 3  # a 35-token prompt in 16-token chunks
    assert fakes.per_call == 0
    groups = 1 if full_layers == 2 else 2
    assert fakes.planned == groups * prefill_steps
    prefill_calls = [(path, window) for decode, path, window in seen if not decode]
    assert len(prefill_calls) == 2 * prefill_steps
    full = [path for path, window in prefill_calls if window is None]
    sliding = [path for path, window in prefill_calls if window is not None]
    assert full == ["triton"] * full_layers * prefill_steps
    assert sliding == ["triton"] * (2 - full_layers) * prefill_steps
    # The kernels run: the planned cascade, for full and sliding layers alike.
    assert fakes.paths == ["triton"] * 2 * prefill_steps
    # The first step's prompts have nothing cached: the cascade runs its dense part alone.
    # Each later chunk of the long prompt attends to its earlier chunks: the context part
    # runs, once per layer.
    per_step = has_context[::2]
    assert has_context[1::2] == per_step  # one plan per step, both layers
    assert per_step[0] is False and all(per_step[1:]), per_step
    assert fakes.context_calls == 2 * (prefill_steps - 1)


def test_fp8_caches_and_sliding_windows_plan_the_cascade(monkeypatch: pytest.MonkeyPatch) -> None:
    """An FP8 cache or a sliding-window group no longer forces the all-paged kernel: the step
    plans as any other (here: the cascade forced, with either dense kernel), and a layer that
    FlashAttention-2 cannot serve (FP8 cache, window) runs our dense kernel in its place;
    `prefill_cascade=False` (TANDEM_PREFILL_CASCADE=0) still forces the all-paged kernel."""
    from tandem.layers.attention.backend import AttentionMetadata, AttentionShape
    from tandem.layers.attention.triton_backend import TritonAttentionBackend
    from tandem_kernels.cascade_attention import layer_prefill_path

    shape = AttentionShape(
        num_heads=4,
        num_kv_heads=2,
        head_size=32,
        block_size=16,
        dtype=torch.bfloat16,
        kv_cache_dtype=torch.float8_e4m3fn,
        device=torch.device("cpu"),
    )
    ints = torch.zeros(2, dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=5,
        num_reqs=1,
        max_query_len=5,
        max_seq_len=9,
        query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
        seq_lens=ints[:1],
        block_table=ints.view(1, 2),
        slot_mapping=torch.zeros(5, dtype=torch.int64),
        query_start_loc_cpu=[0, 5],
        seq_lens_cpu=[9],
    )
    backend = TritonAttentionBackend()
    for dense in ("triton", "flash"):
        monkeypatch.setenv("TANDEM_PREFILL_DENSE", dense)
        backend.prefill_cascade = True
        assert backend.plan_step(meta, shape, sliding_window=64).prefill_path == dense
        backend.prefill_cascade = False
        assert backend.plan_step(meta, shape, sliding_window=64).prefill_path == "paged"
    assert layer_prefill_path("flash", True, None) == "triton"
    assert layer_prefill_path("flash", False, 64) == "triton"
    assert layer_prefill_path("flash", False, None) == "flash"
    assert layer_prefill_path("triton", True, 64) == "triton"
    assert layer_prefill_path("paged", True, 64) == "paged"


def test_whole_step_graph_plans_the_all_paged_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole-step graph's metadata (`graph_padded`, as the mixed graphs capture it) plans
    the all-paged kernel where an eager step of the same shape plans the cascade: the graph's
    one-token requests would otherwise run through the cascade's prefix tiles. A forced
    cascade (`TANDEM_PREFILL_CASCADE=1`) still forces it."""
    import dataclasses

    from tandem.layers.attention import triton_backend as tb
    from tandem.layers.attention.backend import AttentionMetadata, AttentionShape

    fakes = _Fakes()
    monkeypatch.setattr(tb, "planned_prefill_path", fakes.planned_prefill_path)
    backend = tb.TritonAttentionBackend()
    backend.prefill_cascade = None
    shape = AttentionShape(4, 2, 16, 16, torch.float32, torch.float32, torch.device("cpu"))
    meta = AttentionMetadata(
        num_actual_tokens=8,
        num_reqs=2,
        max_query_len=8,
        max_seq_len=64,
        query_start_loc=torch.tensor([0, 7, 8], dtype=torch.int32),
        seq_lens=torch.tensor([7, 30], dtype=torch.int32),
        block_table=torch.zeros(2, 4, dtype=torch.int32),
        slot_mapping=torch.zeros(8, dtype=torch.long),
        query_start_loc_cpu=[],
        seq_lens_cpu=[],
    )
    assert backend.plan_step(meta, shape).prefill_path == "triton"
    graph = dataclasses.replace(meta, graph_padded=True)
    assert backend.plan_step(graph, shape).prefill_path == "paged"
    backend.prefill_cascade = True
    assert backend.plan_step(graph, shape).prefill_path == tb.default_dense_impl()
