"""The CPU decoder stack (tandem.models.cpu_stack): a Llama model's layers in one C++ call give
the bits the layer modules give, over chunked prefill, prefix hits and decode, and it is taken
only where every layer is the plain form it knows."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.layers.attention import get_attention_backend
from tandem.loader import build_model
from tandem.models.cpu_stack import CpuDecoderStack
from tandem.models.interface import ModelContext
from tandem_kernels import cpu
from tests.conftest import build_attn_metadata
from tests.parallel_groups import CPU

BLOCK_SIZE = 4

pytestmark = pytest.mark.skipif(
    not cpu.available() or not cpu.has_panel_gemm(), reason="needs the AVX-512 CPU extension"
)


def _model(path: Path, cpu_gemm: str = "auto") -> Any:
    backend = get_attention_backend("cpu")
    ctx = ModelContext.single(torch.float32, CPU, backend)
    return build_model(path, dataclasses.replace(ctx, cpu_gemm=cpu_gemm))


def _steps(model: Any, stacked: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Three steps over one KV cache: two prompts prefilled in chunks (the second reusing the
    first's first block, a prefix hit), then a mixed step (one decode, one chunk), then two
    decodes. The hidden states of each step and the cache afterwards."""
    model.model.use_cpu_decoder_stack = stacked
    layers = len(model.model.layers)
    kv = torch.zeros(16, layers, 2, BLOCK_SIZE, model.num_kv_heads, model.head_size)
    tables = [[0, 1, 2, 3], [0, 4, 5, 6]]
    gen = torch.Generator().manual_seed(3)
    prompt = [torch.randint(3, model.vocab_size, (13,), generator=gen) for _ in range(2)]
    prompt[1][:BLOCK_SIZE] = prompt[0][:BLOCK_SIZE]  # request 1 hits request 0's first block
    steps = [  # (query tokens of each request, its context length after the step)
        ([prompt[0][:6], prompt[1][BLOCK_SIZE:9]], [6, 9]),
        ([prompt[0][6:13], prompt[1][9:13]], [13, 13]),
        ([torch.tensor([7]), torch.tensor([11])], [14, 14]),
    ]
    outs = []
    with torch.inference_mode():
        for ids, seq_lens in steps:
            lens = [len(t) for t in ids]
            md = build_attn_metadata(lens, seq_lens, tables, BLOCK_SIZE)
            positions = torch.cat(
                [torch.arange(s - n, s) for n, s in zip(lens, seq_lens, strict=True)]
            )
            caches = [kv[:, i] for i in range(layers)]
            outs.append(model(torch.cat(ids), positions, caches, md).clone())
    return outs, kv


def test_stack_gives_the_modules_bits(tiny_model_path) -> None:
    model = _model(tiny_model_path("llama"))
    with_stack, kv_stack = _steps(model, stacked=True)
    assert isinstance(model.model._cpu_stack, CpuDecoderStack), "the stack was not taken"
    modules, kv_modules = _steps(model, stacked=False)
    for a, b in zip(with_stack, modules, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(kv_stack, kv_modules)
    assert kv_stack.abs().sum() > 0  # the steps wrote the cache


def test_stack_runs_instead_of_the_modules(tiny_model_path, monkeypatch) -> None:
    """With the stack, no layer module's forward runs; the tokens' hidden states still move."""
    model = _model(tiny_model_path("llama"))
    calls: list[str] = []
    for layer in model.model.layers:
        original = layer.forward

        def spy(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            calls.append("layer")
            return _original(*args, **kwargs)

        monkeypatch.setattr(layer, "forward", spy)
    _steps(model, stacked=True)
    assert calls == []
    _steps(model, stacked=False)
    assert len(calls) == 3 * len(model.model.layers)


@pytest.mark.parametrize("arch", ["qwen3", "mixtral"])
def test_other_layer_forms_keep_the_modules(arch: str, tiny_model_path) -> None:
    """Qwen3's q/k norms and Mixtral's MoE block are not the stack's form."""
    model = _model(tiny_model_path(arch))
    _steps(model, stacked=True)
    assert model.model._cpu_stack is False


def test_a_forced_non_panel_gemm_keeps_the_modules(tiny_model_path) -> None:
    model = _model(tiny_model_path("llama"), cpu_gemm="onednn")
    _steps(model, stacked=True)
    assert model.model._cpu_stack is False
