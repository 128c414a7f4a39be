"""Mixture-of-experts: the router's top-k per family, loading experts by shard, and the MoE
models at 2 ranks over gloo (experts split by tensor parallel, and spread whole by expert
parallel with all-to-all dispatch and combine) equal to one rank (run inside
tests/unit/test_parallel_layers.py's gloo processes: `check_expert_parallel`)."""

from __future__ import annotations

import contextlib
import dataclasses
import unittest.mock
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.layers.attention import get_attention_backend
from tandem.layers.moe import FusedMoE, select_experts
from tandem.loader import build_model
from tandem.models.interface import ModelContext
from tandem_kernels.moe_ref import fused_moe_ref
from tests.conftest import build_attn_metadata
from tests.parallel_groups import CPU, fake_parallel_state

BLOCK_SIZE = 16
MOE_ARCHS = ("qwen3_moe", "mixtral")


def test_router_top_k_and_renormalisation() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 3.5, 0.0]])
    weights, ids = select_experts(logits, 2, renormalize=False)
    probs = logits.softmax(-1)
    assert ids.dtype == torch.int32 and ids.tolist() == [[0, 1], [2, 1]]
    torch.testing.assert_close(weights, probs.gather(1, ids.long()))
    # Renormalised (Mixtral; Qwen3-MoE's norm_topk_prob): the softmax over the chosen logits.
    weights, ids = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, logits.gather(1, ids.long()).softmax(-1))
    with pytest.raises(ValueError, match="top_k 5"):
        select_experts(logits, 5, renormalize=True)


@contextlib.contextmanager
def _checked_local_promise() -> Iterator[list[bool]]:
    """The layer's `run_experts` wrapped: each call's `all_experts_local` is listed, and
    checked true of its ids when set (the kernel then skips the zero fill that ids >= E
    need)."""
    from tandem.layers.moe import layer as moe_layer

    run_experts = moe_layer.run_experts
    promises: list[bool] = []

    def checked(
        hidden_states: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        all_experts_local: bool = False,
        **scales: torch.Tensor | None,
    ) -> torch.Tensor:
        assert not all_experts_local or bool((topk_ids < w13.shape[0]).all())
        promises.append(all_experts_local)
        return run_experts(
            hidden_states,
            w13,
            w2,
            topk_weights,
            topk_ids,
            all_experts_local=all_experts_local,
            **scales,
        )

    with unittest.mock.patch.object(moe_layer, "run_experts", checked):
        yield promises


def _context(tp_rank: int = 0, tp_size: int = 1, ep: bool = False) -> ModelContext:
    state = fake_parallel_state(tp_rank, tp_size)
    return ModelContext(
        torch.float32, CPU, get_attention_backend("torch"), state, enable_expert_parallel=ep
    )


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_experts_load_by_shard(arch: str, tiny_model_path) -> None:
    """TP = 2: every expert, its half of the intermediate rows (gate, up) and columns (down).
    EP = 2: half the experts, whole."""
    path = tiny_model_path(arch)
    whole = build_model(path, _context())
    layer = "model.layers.0." + ("block_sparse_moe" if arch == "mixtral" else "mlp")
    full = whole.get_submodule(f"{layer}.experts")
    inter = full.intermediate_size
    gate, up = full.w13_weight[:, :inter], full.w13_weight[:, inter:]
    for rank in range(2):
        tp = build_model(path, _context(rank, 2)).get_submodule(f"{layer}.experts")
        half = slice(rank * inter // 2, (rank + 1) * inter // 2)
        assert torch.equal(tp.w13_weight, torch.cat([gate[:, half], up[:, half]], dim=1))
        assert torch.equal(tp.w2_weight, full.w2_weight[:, :, half])
        ep = build_model(path, _context(rank, 2, ep=True)).get_submodule(f"{layer}.experts")
        experts = slice(rank * full.num_experts // 2, (rank + 1) * full.num_experts // 2)
        assert ep.use_ep and ep.num_local_experts == full.num_experts // 2
        assert torch.equal(ep.w13_weight, full.w13_weight[experts])
        assert torch.equal(ep.w2_weight, full.w2_weight[experts])


def test_layer_without_expert_parallel_vouches_its_experts_are_all_local() -> None:
    """Every id the router picks names an expert this rank holds: the layer says so (the
    fused kernel then skips its zero fill); expert parallel is checked in the gloo ranks."""
    gen = torch.Generator().manual_seed(5)
    layer = FusedMoE(6, 2, 16, 12, True, _context())
    layer.w13_weight.data.copy_(torch.randn(6, 24, 16, generator=gen) * 0.3)
    layer.w2_weight.data.copy_(torch.randn(6, 16, 12, generator=gen) * 0.3)
    x, logits = torch.randn(9, 16, generator=gen), torch.randn(9, 6, generator=gen)
    with _checked_local_promise() as promises:
        out = layer(x, logits)
    assert promises == [True]
    weights, ids = select_experts(logits, 2, renormalize=True)
    expected = fused_moe_ref(x, layer.w13_weight, layer.w2_weight, weights, ids)
    torch.testing.assert_close(out, expected)


def test_fp8_experts_quantized_at_load(tiny_model_path) -> None:
    """`--quantization fp8` on a MoE checkpoint: every expert layer gets the weight-only FP8
    method; after loading its weights are e4m3 with a scale per expert and row (half the
    bytes), the router stays in the model's dtype, and the layer's output equals the
    reference on the dequantized weights and stays within FP8's error of the unquantized
    layer. A checkpoint storing static activation scales is refused for its experts (block
    scales or not), naming the layer."""
    from tandem.config import ConfigError
    from tandem.layers.quantization import Fp8Config, Fp8MoEMethod
    from tandem_kernels.moe_ref import dequantize_expert_rows

    path = tiny_model_path("qwen3_moe")
    plain = build_model(path, _context())
    ctx = dataclasses.replace(_context(), quant_config=Fp8Config())
    fp8 = build_model(path, ctx)
    layers = [m for m in fp8.modules() if isinstance(m, FusedMoE)]
    assert layers and all(isinstance(m.quant_method, Fp8MoEMethod) for m in layers)
    first = layers[0]
    base = next(m for m in plain.modules() if isinstance(m, FusedMoE))
    assert first.w13_weight.dtype == first.w2_weight.dtype == torch.float8_e4m3fn
    assert first.w13_scale.shape == first.w13_weight.shape[:2]
    assert first.w2_scale.shape == first.w2_weight.shape[:2]
    assert first.w13_weight.element_size() * 4 == base.w13_weight.element_size()
    router = fp8.get_submodule("model.layers.0.mlp.gate")
    assert router.weight.dtype == torch.float32
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(11, first.hidden_size, generator=gen)
    logits = torch.randn(11, first.num_experts, generator=gen)
    out = first(x, logits)
    weights, ids = select_experts(logits, first.top_k, first.renormalize)
    deq13 = dequantize_expert_rows(first.w13_weight, first.w13_scale, torch.float32)
    deq2 = dequantize_expert_rows(first.w2_weight, first.w2_scale, torch.float32)
    torch.testing.assert_close(out, fused_moe_ref(x, deq13, deq2, weights, ids))
    unquantized = base(x, logits)
    rel = (out - unquantized).norm() / unquantized.norm()
    assert 0 < rel < 0.05, rel
    assert "float8_e4m3fn" in repr(first)

    for stored in ({}, {"weight_block_size": [16, 16]}):
        quant = Fp8Config.from_config(
            {"quant_method": "fp8", "activation_scheme": "static", **stored}
        )
        with pytest.raises(ConfigError, match=r"mlp\.experts: static FP8 activation scales"):
            build_model(path, dataclasses.replace(_context(), quant_config=quant))


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("kind", ["ct_channel", "ct_tensor", "modelopt_pcpt"])
def test_fp8_moe_checkpoint_loads_as_stored(
    arch: str, kind: str, tiny_model_path, tmp_path: Path
) -> None:
    """A compressed-tensors FP8 checkpoint of a MoE model (experts per channel or per tensor,
    as written by test_fp8's helper: Qwen3-MoE's gate/up/down_proj, Mixtral's w1/w3/w2), or
    a ModelOpt FP8_PER_CHANNEL_PER_TOKEN one (its channel scales `[N]`)
    loads as stored: every expert e4m3 with a scale per row (a per-tensor scale on each row
    of its projection); the logits stay within FP8's error of the unquantized model's; per
    channel (both formats), the experts, scales and logits equal quantizing the bf16
    checkpoint at load (`ptpc_fp8`) bit for bit."""
    from tandem.layers.quantization import PtpcFp8Config, resolve_quant_config
    from tandem.loader import load_hf_config
    from tests.unit.test_fp8 import _logits, _write_fp8_checkpoint, context

    src = tiny_model_path(arch)
    folder = _write_fp8_checkpoint(src, tmp_path / kind, kind)
    hf_config = load_hf_config(folder)
    quant = resolve_quant_config("auto", hf_config, CPU, check_device=False)
    assert quant is not None and quant.scheme.is_checkpoint_fp8_serialized
    stored = build_model(folder, context(quant), hf_config=hf_config)
    experts = [m for m in stored.modules() if isinstance(m, FusedMoE)]
    assert experts
    for layer in experts:
        assert layer.w13_weight.dtype == layer.w2_weight.dtype == torch.float8_e4m3fn
        assert layer.w13_scale.shape == layer.w13_weight.shape[:2]
        assert layer.w2_scale.shape == layer.w2_weight.shape[:2]
        assert not hasattr(layer, "w13_weight_scale")
    if kind == "ct_tensor":  # gate and up keep their own scale, each on all its rows
        inter = experts[0].intermediate_per_rank
        gate, up = experts[0].w13_scale[0, :inter], experts[0].w13_scale[0, inter:]
        assert (gate == gate[0]).all() and (up == up[0]).all() and gate[0] != up[0]
    exact = _logits(build_model(src, context(None)))
    logits = _logits(stored)
    assert (logits - exact).norm() / exact.norm() < 0.15
    if kind == "ct_tensor":
        return
    at_load = build_model(src, context(PtpcFp8Config()))
    for mine, theirs in zip(
        experts, [m for m in at_load.modules() if isinstance(m, FusedMoE)], strict=True
    ):
        assert torch.equal(mine.w13_weight.view(torch.uint8), theirs.w13_weight.view(torch.uint8))
        assert torch.equal(mine.w2_weight.view(torch.uint8), theirs.w2_weight.view(torch.uint8))
        assert torch.equal(mine.w13_scale, theirs.w13_scale)
        assert torch.equal(mine.w2_scale, theirs.w2_scale)
    torch.testing.assert_close(logits, _logits(at_load), atol=0, rtol=0)


def test_block_fp8_moe_checkpoint_loads_as_stored(tiny_model_path, tmp_path: Path) -> None:
    """An HF `fp8` checkpoint with `weight_block_size` [16, 16] of the tiny Qwen3-MoE (every
    projection, experts included, e4m3 with its `weight_scale_inv` tiles, as written by
    test_fp8's helper) loads as stored: the experts e4m3 with their tiles' scales (gate's
    tile rows, then up's, as the checkpoint holds them), and the logits equal the same model
    loaded from the dequantized weights (float32) bit for bit: on the CPU the block-scaled
    layers run their torch references, which dequantize each weight to float32 first (the
    same products as the dequantized checkpoint's) and then the same matmuls. (On CUDA the
    kernels scale partial sums instead: tests/gpu. And within FP8's error of the unquantized
    model.)"""
    from safetensors.torch import load_file, save_file

    from tandem.layers.quantization import resolve_quant_config
    from tandem.loader import load_hf_config
    from tandem_kernels import fp8 as fp8_ops
    from tests.unit.test_fp8 import _logits, _write_fp8_checkpoint, context

    src = tiny_model_path("qwen3_moe")
    folder = _write_fp8_checkpoint(src, tmp_path / "stored", "fp8_block16")
    hf_config = load_hf_config(folder)
    quant = resolve_quant_config("auto", hf_config, CPU, check_device=False)
    assert quant is not None and quant.scheme.weight_block_size == (16, 16)
    stored = build_model(folder, context(quant), hf_config=hf_config)
    experts = stored.get_submodule("model.layers.0.mlp.experts")
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == torch.float8_e4m3fn
    assert experts.weight_block_size == (16, 16) and "block=[16, 16]" in repr(experts)
    assert experts.w13_scale.shape == (8, 2 * 48 // 16, 64 // 16)
    assert experts.w2_scale.shape == (8, 64 // 16, 48 // 16)
    assert not hasattr(experts, "w13_weight_scale_inv")
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.experts.5.{}.weight_scale_inv"
    gate, up = tensors[name.format("gate_proj")], tensors[name.format("up_proj")]
    assert torch.equal(experts.w13_scale[5], torch.cat([gate, up]))
    assert torch.equal(experts.w2_scale[5], tensors[name.format("down_proj")])

    dequantized = tmp_path / "dequantized"
    dequantized.mkdir()
    plain = {}
    for key, tensor in tensors.items():
        if key.endswith("weight_scale_inv"):
            continue
        scale = tensors.get(key + "_scale_inv")
        plain[key] = tensor if scale is None else fp8_ops.dequantize(tensor, scale, (16, 16))
    save_file(plain, str(dequantized / "model.safetensors"))
    (dequantized / "config.json").write_text((src / "config.json").read_text())
    logits = _logits(stored)
    reference = _logits(build_model(dequantized, context(None)))
    torch.testing.assert_close(logits, reference, atol=0, rtol=0)
    exact = _logits(build_model(src, context(None)))
    assert (logits - exact).norm() / exact.norm() < 0.15


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ((16, 16), "gate and up have 24 rows each .* not whole tiles of 16 rows"),
        ((8, 16), "down has 24 columns .* not whole tiles of 16 columns"),
    ],
    ids=["rows", "columns"],
)
def test_block_fp8_experts_refuse_a_shard_of_partial_tiles(
    block: tuple[int, int], message: str, tiny_model_path
) -> None:
    """Block-scaled FP8 experts at TP = 2 (the tiny Qwen3-MoE's moe intermediate 48: 24 rows
    of gate and of up, and 24 columns of down, a rank): tiles of 16 rows, or of 16 columns,
    would straddle the ranks; refused at build, naming the layer."""
    from tandem.config import ConfigError
    from tandem.layers.quantization import Fp8Config

    quant = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": list(block)})
    ctx = dataclasses.replace(_context(0, 2), quant_config=quant)
    with pytest.raises(
        ConfigError, match=r"layers\.0\.mlp\.experts: FP8 block scales .*" + message
    ):
        build_model(tiny_model_path("qwen3_moe"), ctx)


def test_block_fp8_experts_shard_whole_tiles() -> None:
    """Block-scaled FP8 experts ([16, 16] tiles; H 32, I 64) loaded through the layer's
    loaders at TP = 2: each rank keeps its tile rows of gate and of up and its tile columns
    of down, and the two ranks' outputs sum to one rank's (the reference on the dequantized
    experts); at EP = 2 each rank keeps its experts whole, weights and scales."""
    from tandem.layers.moe.layer import run_experts
    from tandem.layers.quantization import Fp8Config
    from tandem_kernels.fp8 import quantize_expert_blocks
    from tandem_kernels.moe_ref import dequantize_expert_blocks

    block = (16, 16)
    quant = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": list(block)})
    num_experts, hidden, inter = 4, 32, 64
    gen = torch.Generator().manual_seed(8)
    w1, w3 = torch.randn(2, num_experts, inter, hidden, generator=gen) * 0.3
    (q1, s1), (q3, s3) = quantize_expert_blocks(w1, block), quantize_expert_blocks(w3, block)
    q2, s2 = quantize_expert_blocks(torch.randn(num_experts, hidden, inter, generator=gen), block)

    def loaded(ctx: ModelContext) -> FusedMoE:
        layer = FusedMoE(num_experts, 2, hidden, inter, True, replace_quant(ctx))
        for e in range(num_experts):
            for shard, q, s in (("w1", q1, s1), ("w3", q3, s3)):
                layer.weight_loader(layer.w13_weight, q[e], shard, e)
                layer.scale_loader(layer.w13_weight_scale_inv, s[e], shard, e)
            layer.weight_loader(layer.w2_weight, q2[e], "w2", e)
            layer.scale_loader(layer.w2_weight_scale_inv, s2[e], "w2", e)
        layer.quant_method.process_weights_after_loading(layer)
        return layer

    def replace_quant(ctx: ModelContext) -> ModelContext:
        return dataclasses.replace(ctx, quant_config=quant)

    def run(layer: FusedMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        return run_experts(
            x, layer.w13_weight, layer.w2_weight, weights, ids,
            w13_scale=layer.w13_scale, w2_scale=layer.w2_scale,
            weight_block_size=layer.weight_block_size,
        )  # fmt: skip

    full = loaded(_context())
    assert torch.equal(full.w13_scale, torch.cat([s1, s3], dim=1))
    x = torch.randn(9, hidden, generator=gen)
    weights, ids = select_experts(torch.randn(9, num_experts, generator=gen), 2, True)
    expected = run(full, x, weights, ids)
    deq13 = dequantize_expert_blocks(torch.cat([q1, q3], 1), full.w13_scale, block, x.dtype)
    deq2 = dequantize_expert_blocks(q2, s2, block, x.dtype)
    torch.testing.assert_close(expected, fused_moe_ref(x, deq13, deq2, weights, ids))
    total = torch.zeros_like(expected)
    for rank in range(2):
        tp = loaded(_context(rank, 2))
        half = slice(rank * 2, rank * 2 + 2)  # 32 rows of gate / up, columns of down
        assert torch.equal(tp.w13_scale, torch.cat([s1[:, half], s3[:, half]], dim=1))
        assert torch.equal(tp.w2_scale, s2[:, :, half])
        total += run(tp, x, weights, ids)
        ep = loaded(_context(rank, 2, ep=True))
        mine = slice(rank * 2, rank * 2 + 2)  # experts
        assert torch.equal(ep.w13_scale, full.w13_scale[mine])
        assert torch.equal(ep.w2_scale, full.w2_scale[mine])
        assert torch.equal(ep.w13_weight.view(torch.uint8), full.w13_weight[mine].view(torch.uint8))
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)


def _fake_clock(monkeypatch: pytest.MonkeyPatch, clock: dict[Any, float]) -> list[Any]:
    """The fused MoE tuner's timer replaced by `clock` (a config's milliseconds; absent: the
    device cannot run it): returns the list the timed configs are appended to, in order."""
    import tandem_kernels.fused_moe as fm

    timed: list[Any] = []

    def fake_time_call(
        problem: tuple[torch.Tensor, ...], config: Any, in_graph: bool, iters: int
    ) -> float | None:
        timed.append(config)
        return clock.get(config)

    monkeypatch.setattr(fm, "_time_call", fake_time_call)
    return timed


def test_moe_tuner_times_both_silu_forms_then_down_tiles_on_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fused kernel's tuner under a fake clock (no kernel runs): every candidate of both
    SiLU forms is timed, then the fastest of each form again with each GEMM 2 tile set (not
    the one equal to its own, nor on the slower configs), and the fastest of all is kept,
    here an epilogue config with its own down tiles; configs the device cannot run (None)
    are left out."""
    import tandem_kernels.fused_moe as fm

    unfused = fm.MoEConfig(16, 64, 64, 1, 4, 3)
    fused = unfused._replace(silu_in_epilogue=True)
    slower_fused = fm.MoEConfig(16, 32, 64, 1, 4, 3, True)
    down = fm.GemmTiles(128, 64, 8, 4, 3)
    clock = {
        unfused: 2.0,
        fused: 1.5,
        slower_fused: 1.8,
        unfused._replace(down=down): 1.2,
        fused._replace(down=down): 1.0,
    }
    timed = _fake_clock(monkeypatch, clock)
    monkeypatch.setattr(fm, "_configs", {})
    monkeypatch.setattr(fm, "tuning_log", [])
    w13, w2 = torch.zeros(4, 16, 8), torch.zeros(4, 8, 8)
    tuned = fm.tune_fused_moe(
        w13,
        w2,
        2,
        max_tokens=4,
        candidates=(unfused, fused, slower_fused),
        decode_candidates=(),
        down_candidates=(down, unfused.gate_up_tiles, fm.GemmTiles(32, 32, 1, 4, 2)),
    )
    best = fused._replace(down=down)
    assert tuned == {1: best, 2: best, 4: best}
    per_bucket = [
        unfused,
        fused,
        slower_fused,
        unfused._replace(down=down),
        unfused._replace(down=fm.GemmTiles(32, 32, 1, 4, 2)),
        fused._replace(down=down),
        fused._replace(down=fm.GemmTiles(32, 32, 1, 4, 2)),
    ]
    # Then the three fastest again, in two interleaved rounds.
    finals = [best, unfused._replace(down=down), fused]
    assert timed == (per_bucket + finals * 2) * 3
    assert [e["best"] for e in fm.tuning_log] == [fm.config_name(best)] * 3
    assert fm.config_name(best) == "silu-epilogue:16x64x64x1x4x3/down:128x64x8x4x3"
    assert len(fm.tuning_log[0]["ms"]) == len(clock)


def test_moe_tuner_keeps_the_fastest_finalist_by_its_retimes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bucket's three fastest configs are timed again in two interleaved rounds and the
    one with the best retime is kept, not the one whose first timing was fastest (a burst's
    clocks); the log holds the retimes under `final_ms`. With `finalists=0`, the fastest
    first timing is kept and nothing is timed again."""
    import tandem_kernels.fused_moe as fm

    lucky = fm.MoEConfig(16, 64, 64, 1, 4, 3)
    steady = fm.MoEConfig(16, 32, 64, 1, 4, 3)
    third = fm.MoEConfig(16, 128, 64, 1, 4, 3)
    slowest = fm.MoEConfig(16, 16, 64, 1, 4, 3)
    # Each config's timings in the order they are asked for.
    clocks = {lucky: [1.0, 1.4, 1.3], steady: [1.1, 1.2, 1.15], third: [1.2, 1.25, 1.3]}
    clocks[slowest] = [2.0]
    timed: list[Any] = []

    def fake_time_call(problem: Any, config: Any, in_graph: bool, iters: int) -> float:
        timed.append(config)
        return clocks[config][sum(c == config for c in timed) - 1]

    monkeypatch.setattr(fm, "_time_call", fake_time_call)
    w13, w2 = torch.zeros(4, 16, 8), torch.zeros(4, 8, 8)
    kwargs = {
        "candidates": (lucky, steady, third, slowest),
        "decode_candidates": (),
        "down_candidates": (),
    }
    for finalists, best in ((3, steady), (0, lucky)):
        monkeypatch.setattr(fm, "_configs", {})
        monkeypatch.setattr(fm, "tuning_log", [])
        timed.clear()
        assert fm.tune_fused_moe(w13, w2, 2, 1, finalists=finalists, **kwargs) == {1: best}
        finals = [lucky, steady, third] * 2 if finalists else []
        assert timed == [lucky, steady, third, slowest, *finals]
        entry = fm.tuning_log[0]
        assert entry["best"] == fm.config_name(best)
        want = {lucky: 1.3, steady: 1.15, third: 1.25} if finalists else {}
        assert entry["final_ms"] == {fm.config_name(c): ms for c, ms in want.items()}


def test_moe_tuner_times_the_fastest_of_each_form_again_through_tma(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With `b_tma`, after the down tiles the fastest config of each SiLU form (its down
    tiles included) is timed once more with the weights through TMA, and kept when fastest;
    without it (as on the CPU), nothing through TMA is timed."""
    import tandem_kernels.fused_moe as fm

    unfused = fm.MoEConfig(16, 64, 64, 1, 4, 3)
    fused = unfused._replace(silu_in_epilogue=True)
    down = fm.GemmTiles(128, 64, 8, 4, 3)
    clock = {
        unfused: 2.0,
        fused: 1.5,
        unfused._replace(down=down): 1.2,
        fused._replace(down=down): 1.8,
    }
    clock[unfused._replace(down=down, b_tma=True)] = 1.1
    clock[fused._replace(b_tma=True)] = 1.6
    timed = _fake_clock(monkeypatch, clock)
    w13, w2 = torch.zeros(4, 16, 8), torch.zeros(4, 8, 8)
    assert not fm.b_tma_usable(w13, w2)
    kwargs = {
        "candidates": (unfused, fused),
        "decode_candidates": (),
        "down_candidates": (down,),
        "finalists": 0,
    }
    for b_tma, best in (
        (True, unfused._replace(down=down, b_tma=True)),
        (None, unfused._replace(down=down)),
    ):
        monkeypatch.setattr(fm, "_configs", {})
        monkeypatch.setattr(fm, "tuning_log", [])
        timed.clear()
        tuned = fm.tune_fused_moe(w13, w2, 2, max_tokens=1, b_tma=b_tma, **kwargs)
        assert tuned == {1: best}
        through_tma = [c for c in timed if isinstance(c, fm.MoEConfig) and c.b_tma]
        if b_tma:
            assert through_tma == [
                unfused._replace(down=down, b_tma=True),
                fused._replace(b_tma=True),
            ]
            assert fm.tuning_log[0]["best"] == "16x64x64x1x4x3/down:128x64x8x4x3+tma"
        else:
            assert through_tma == []
        assert not any(isinstance(c, fm.MoEConfig) and c.fp8_act for c in timed)
    # FP8 weights (`fp8_act` on): the fastest of each form is timed once more with FP8
    # activations, after the TMA twins.
    monkeypatch.setattr(fm, "_configs", {})
    timed.clear()
    fm.tune_fused_moe(w13, w2, 2, max_tokens=1, b_tma=True, fp8_act=True, **kwargs)
    a8 = [c for c in timed if isinstance(c, fm.MoEConfig) and c.fp8_act]
    assert a8 == [
        unfused._replace(down=down, b_tma=True, fp8_act=True),
        fused._replace(fp8_act=True),
    ]


def test_expert_load_is_counted_per_layer_and_reset(tiny_model_path) -> None:
    from tandem.layers.moe import take_expert_load

    model = build_model(tiny_model_path("qwen3_moe"), _context())
    assert take_expert_load(model).sum() == 0
    _prefill_logits(model)  # 33 tokens; layer 0 sparse (top 2 of 8), layer 1 dense
    load = take_expert_load(model)
    assert load.shape == (1, 8) and load.dtype == torch.int64
    assert load.sum() == 33 * 2 and (load > 0).sum() > 1
    assert take_expert_load(model).sum() == 0
    assert take_expert_load(build_model(tiny_model_path("qwen3"), _context())) is None


def test_a_missing_expert_is_reported(tiny_model_path) -> None:
    from tandem.loader import iterate_weight_slices, load_hf_config
    from tandem.models import get_model_class

    path = tiny_model_path("mixtral")
    config = load_hf_config(path)
    model = get_model_class(config)(config, _context())
    weights = [
        (n, t)
        for n, t in iterate_weight_slices(path)
        if "layers.1.block_sparse_moe.experts.2.w3" not in n
    ]
    with pytest.raises(ValueError, match=r"missing 1 parameters: .*layers\.1\.block_sparse_moe"):
        model.load_weights(weights)


# ---------------------------------------------------------------------------------------------
# Two ranks over gloo


def _check_layer_ep(rank: int, world: int, ep_ctx: ModelContext) -> None:
    """The FusedMoE layer alone, expert parallel (both dispatches) vs the reference on all
    experts, for token counts below, at and above the number of ranks (some ranks route no
    token)."""
    gen = torch.Generator().manual_seed(4)
    num_experts, hidden, inter = 6, 16, 12
    w1, w3 = torch.randn(2, num_experts, inter, hidden, generator=gen) * 0.3
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * 0.3
    layer = FusedMoE(num_experts, 2, hidden, inter, True, ep_ctx)
    for e in range(num_experts):
        for shard, tensor in (("w1", w1[e]), ("w3", w3[e])):
            layer.weight_loader(layer.w13_weight, tensor, shard, e)
        layer.weight_loader(layer.w2_weight, w2[e], "w2", e)
    w13 = torch.cat([w1, w3], dim=1)
    for num_tokens in (1, 2, 9):
        x = torch.randn(num_tokens, hidden, generator=gen)
        logits = torch.randn(num_tokens, num_experts, generator=gen)
        weights, ids = select_experts(logits, 2, renormalize=True)
        expected = fused_moe_ref(x, w13, w2, weights, ids)
        for sync_free in (False, True):  # exact splits; fixed capacity (CUDA graphs)
            layer.ep_sync_free = sync_free
            with _checked_local_promise() as promises:
                out = layer(x, logits)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
            # Only the exact dispatch vouches (the fixed capacity pads with id E_local).
            assert promises == [not sync_free]
    # FP8 experts (`--quantization fp8`): each rank quantizes the experts it holds, a scale
    # a row, as one rank quantizes them all; their scales travel with them to the kernel.
    from tandem.layers.quantization import Fp8Config
    from tandem_kernels.fp8 import quantize_expert_rows

    fp8_layer = FusedMoE(
        num_experts, 2, hidden, inter, True, dataclasses.replace(ep_ctx, quant_config=Fp8Config())
    )
    for e in range(num_experts):
        for shard, tensor in (("w1", w1[e]), ("w3", w3[e])):
            fp8_layer.weight_loader(fp8_layer.w13_weight, tensor, shard, e)
        fp8_layer.weight_loader(fp8_layer.w2_weight, w2[e], "w2", e)
    fp8_layer.quant_method.process_weights_after_loading(fp8_layer)
    assert fp8_layer.w13_scale.shape[0] == num_experts // world
    (q13, s13), (q2, s2) = quantize_expert_rows(w13), quantize_expert_rows(w2)
    x = torch.randn(9, hidden, generator=gen)
    logits = torch.randn(9, num_experts, generator=gen)
    weights, ids = select_experts(logits, 2, renormalize=True)
    expected = fused_moe_ref(x, q13, q2, weights, ids, s13, s2)
    for sync_free in (False, True):
        fp8_layer.ep_sync_free = sync_free
        torch.testing.assert_close(fp8_layer(x, logits), expected, rtol=1e-5, atol=1e-6)


def _prefill_logits(model: Any) -> torch.Tensor:
    lens = [9, 23, 1]
    md = build_attn_metadata(lens, lens, [[2, 0], [3, 5], [1]], BLOCK_SIZE)
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(3, model.vocab_size, (sum(lens),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lens])
    kv = torch.zeros(6, 2, 2, BLOCK_SIZE, model.num_kv_heads, model.head_size)
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, [kv[:, i] for i in range(2)], md))


def check_expert_parallel(rank: int, world: int, tp: ModelContext, path: Path) -> None:
    """Run in each rank of tests/unit/test_parallel_layers.py's gloo TP group (which also runs
    the MoE model at TP): the FusedMoE layer alone, and the tiny Qwen3-MoE (a sparse and a
    dense layer; Mixtral's blocks are the same layer under another name), expert parallel over
    the group, against one rank."""
    ep = dataclasses.replace(tp, enable_expert_parallel=True)
    _check_layer_ep(rank, world, ep)
    one = ModelContext.single(torch.float32, CPU, tp.attn_backend)
    reference = _prefill_logits(build_model(path, one))
    model = build_model(path, ep)
    assert model.model.layers[0].mlp.experts.use_ep
    torch.testing.assert_close(_prefill_logits(model), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_random_weights_equal_in_transformers(arch: str, tiny_model_path, tmp_path: Path) -> None:
    """A random-weight MoE folder: `load_transformers_model` puts the experts `random_weights`
    makes into transformers' stacked expert parameters, so both run the same model (the
    parity path of the benchmarks)."""
    import shutil

    from tandem.models.presets import load_transformers_model

    folder = tmp_path / "random-moe"
    folder.mkdir()
    shutil.copy(tiny_model_path(arch) / "config.json", folder / "config.json")
    (folder / "RANDOM_WEIGHTS").write_text("tiny\n")
    ours = build_model(folder, _context())
    hf = load_transformers_model(folder, torch.float32, "cpu", seed=0)
    ids = torch.randint(3, ours.vocab_size, (13,), generator=torch.Generator().manual_seed(1))
    md = build_attn_metadata([13], [13], [[0]], BLOCK_SIZE)
    kv = torch.zeros(2, 2, 2, BLOCK_SIZE, ours.num_kv_heads, ours.head_size)
    with torch.inference_mode():
        logits = ours.compute_logits(ours(ids, torch.arange(13), [kv[:, 0], kv[:, 1]], md))
        ref = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_grouped_mm_path_matches_reference_with_other_ranks_experts() -> None:
    """The torch grouped-GEMM path of the fused MoE (torch._grouped_mm, here its CPU kernel)
    against the reference, bf16: every id local, and pairs naming another rank's experts
    (ids >= E), whose rows add nothing."""
    import tandem_kernels.fused_moe as fm

    gen = torch.Generator().manual_seed(7)
    num_experts, top_k, hidden, inter, num_tokens = 8, 2, 64, 32, 37
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5).bfloat16()
    x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    assert fm.grouped_mm_supported(w13, w2)
    assert not fm.grouped_mm_supported(w13.float(), w2.float())
    ep_ids = ids.clone()
    ep_ids[::3, -1] = num_experts
    ep_ids[-1] = num_experts + 3
    for route, local in ((ids, True), (ids, False), (ep_ids, False)):
        out = fm.fused_moe(
            x, w13, w2, weights, route, fm.GroupedMMConfig(), all_experts_local=local
        )
        ref = fused_moe_ref(x, w13, w2, weights, route)
        assert not out.isnan().any()
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < 0.01, rel
    # Another rank's pairs change the result (the test above is not vacuous).
    assert not torch.equal(fused_moe_ref(x, w13, w2, weights, ep_ids), ref.new_zeros(ref.shape))
    assert fm.config_from_name(fm.config_name(fm.GroupedMMConfig())) == fm.GroupedMMConfig()


def test_moe_tuner_times_the_grouped_mm_path_only_past_the_decode_buckets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under a fake clock: buckets that time the decode path leave the grouped-GEMM path out;
    the larger ones time it and keep it where it is fastest; `grouped_mm=False` never times
    it."""
    import tandem_kernels.fused_moe as fm

    tiles = fm.MoEConfig(16, 64, 64, 1, 4, 3)
    decode = fm.DecodeConfig(16, 256, 1, 8, 1024, 1, 4)
    clock = {tiles: 2.0, decode: 1.0, fm.GroupedMMConfig(): 1.5}
    timed: list[tuple[int, fm.FusedMoEConfig]] = []

    def fake_time_call(
        problem: tuple[torch.Tensor, ...], config: fm.FusedMoEConfig, in_graph: bool, iters: int
    ) -> float | None:
        timed.append((problem[0].shape[0], config))
        return clock.get(config)

    monkeypatch.setattr(fm, "_time_call", fake_time_call)
    monkeypatch.setattr(fm, "tuning_log", [])
    w13, w2 = (
        torch.zeros(4, 16, 8, dtype=torch.bfloat16),
        torch.zeros(4, 8, 8, dtype=torch.bfloat16),
    )
    for grouped_mm in (True, False):
        monkeypatch.setattr(fm, "_configs", {})
        timed.clear()
        # E = 4, top 2: the decode path is timed up to 8 rows an expert, 16 tokens.
        tuned = fm.tune_fused_moe(
            w13,
            w2,
            2,
            max_tokens=64,
            candidates=(tiles,),
            decode_candidates=(decode,),
            down_candidates=(),
            grouped_mm=grouped_mm,
        )
        grouped = {n for n, config in timed if isinstance(config, fm.GroupedMMConfig)}
        assert grouped == ({32, 64} if grouped_mm else set())
        assert tuned[16] == decode
        assert tuned[64] == (fm.GroupedMMConfig() if grouped_mm else tiles)


def test_moe_tuner_offers_block_scaled_weights_only_configs_that_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Block-scaled FP8 experts (`weight_block_size` [128, 128]) under a fake clock: every
    config timed, decode and grouped buckets alike, fits the blocks (each BLOCK_K divides
    bk: the default candidates lowered `for_block_size`, each once; down tiles and TMA twins
    too); the fastest config of each SiLU form is timed again with FP8 activations (W8A8,
    per token group), after the TMA twins, and kept where fastest; with `fp8_act=False`
    none is; no torch grouped-GEMM path is timed. The configs are kept under the block's own
    shape key (a row-scaled layer of the same shape tunes apart), its log key naming the
    block."""
    import tandem_kernels.fused_moe as fm

    block = (128, 128)
    timed: list[tuple[int, fm.FusedMoEConfig]] = []

    def fake_time_call(
        problem: Any, config: fm.FusedMoEConfig, in_graph: bool, iters: int
    ) -> float | None:
        assert problem.weight_block_size == block
        timed.append((problem.x.shape[0], config))
        # Later configs slower, but W8A8 twins at half the time.
        ms = 1.0 + 1e-3 * len(timed)
        return ms / 2 if isinstance(config, fm.MoEConfig) and config.fp8_act else ms

    monkeypatch.setattr(fm, "_time_call", fake_time_call)
    monkeypatch.setattr(fm, "_configs", {})
    monkeypatch.setattr(fm, "tuning_log", [])
    fp8 = torch.float8_e4m3fn
    w13, w2 = torch.zeros(4, 256, 256, dtype=fp8), torch.zeros(4, 256, 128, dtype=fp8)
    scales = {"w13_scale": torch.ones(4, 2, 2), "w2_scale": torch.ones(4, 2, 1)}
    # E = 4, top 2: the decode path is timed up to 16 tokens, the grouped path at 32.
    tuned = fm.tune_fused_moe(
        w13, w2, 2, 32, b_tma=True, weight_block_size=block, finalists=0, **scales
    )
    assert set(tuned) == {1, 2, 4, 8, 16, 32}
    assert all(fm.fits_block(config, block) for _, config in timed)
    assert not any(isinstance(c, fm.GroupedMMConfig) for _, c in timed)
    # The W8A8 twins: last of a bucket, of each form's fastest (under this clock its first
    # timed), kept at half the time.
    grouped = [(n, c) for n, c in timed if isinstance(c, fm.MoEConfig)]
    for bucket in (1, 32):
        bucket_timed = [c for n, c in grouped if n == bucket]
        firsts = [next(c for c in bucket_timed if c.silu_in_epilogue == f) for f in (0, 1)]
        a8 = [c._replace(fp8_act=True) for c in firsts]
        assert bucket_timed[-2:] == a8 and not any(c.fp8_act for c in bucket_timed[:-2])
        assert tuned[bucket] == a8[0] and fm.config_name(a8[0]).endswith("+a8"), bucket
    assert fm.tuning_log[-1]["best"] == fm.config_name(tuned[32])
    decode = [c for n, c in timed if n == 1 and isinstance(c, fm.DecodeConfig)]
    assert decode == [fm.for_block_size(c, 128) for c in fm._DECODE_CANDIDATES]
    assert any(c != fm.for_block_size(c, 128) for c in fm._DECODE_CANDIDATES)
    plain = [c for n, c in timed if n == 32 and isinstance(c, fm.MoEConfig) and c.down is None]
    lowered = fm._unique(fm.for_block_size(c, 128) for c in fm._CANDIDATES if c.block_m <= 32)
    assert [c for c in plain if not c.b_tma and not c.fp8_act] == list(lowered)
    assert any(isinstance(c, fm.MoEConfig) and c.b_tma for n, c in timed if n == 32)
    key = fm._shape_key(w13, 2, block)
    assert key != fm._shape_key(w13, 2) and (key, 32) in fm._configs
    assert (fm._shape_key(w13, 2), 32) not in fm._configs
    assert all(e["key"] == [4, 256, 256, 2, str(fp8), "block:128x128"] for e in fm.tuning_log)
    # Weight-only, asked for: no W8A8 twin.
    monkeypatch.setattr(fm, "_configs", {})
    timed.clear()
    tuned = fm.tune_fused_moe(
        w13, w2, 2, 32, fp8_act=False, weight_block_size=block, finalists=0, **scales
    )
    assert timed and not any(isinstance(c, fm.MoEConfig) and c.fp8_act for _, c in timed)
    assert not any(isinstance(c, fm.MoEConfig) and c.fp8_act for c in tuned.values())
