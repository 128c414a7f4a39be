"""GPTQ, AWQ and compressed-tensors integer checkpoints (tandem/layers/quantization/
int_weight_only.py): the packings against words written out by hand from the formats, then a
tiny Llama whose linear layers are stored each way (random integers, zero points and group
scales; GPTQ with a `desc_act` channel order) against transformers on the same weights
dequantized, and the refusals. Then the CUDA form (kept quantized, int_linear.py): each
format's conversion to the kernel's layout against today's dequantization, the choice by
device and its log line, the layers a checkpoint leaves unquantized, and the shapes a rank
cannot hold. The kernel itself, these layers' products and a tiny Llama kept quantized run
under Triton's interpreter (tests/unit/test_kernels_interp.py, `int_w4a16*`)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.config import ConfigError
from tandem.layers.quantization import resolve_quant_config
from tandem.layers.quantization.int_weight_only import (
    AWQ_PACK_ORDER,
    awq_dequantize,
    gptq_dequantize,
    pack_quantized_dequantize,
    unpack_int32,
)
from tandem.loader import load_hf_config
from tests.int_checkpoints import awq_interleave, pack_int32, quantized_folder
from tests.parity.test_model_forward import (
    assert_logits_close,
    build_cpu_model,
    check_prefill_then_decode,
    hf_model,
    random_prompts,
)


def _word(values: list[int], bits: int) -> int:
    """One int32 (as Python's signed value) holding `values` low bits first."""
    word = sum(v << (i * bits) for i, v in enumerate(values))
    return word - (1 << 32) if word >= 1 << 31 else word


def test_words_unpack_as_the_formats_lay_them_out() -> None:
    # GPTQ: eight 4-bit values along K in one word, 2-bit: sixteen.
    packed = torch.tensor([[_word([1, 2, 3, 4, 5, 6, 7, 15], 4)]], dtype=torch.int32)
    assert unpack_int32(packed, 4, dim=0).flatten().tolist() == [1, 2, 3, 4, 5, 6, 7, 15]
    two = torch.tensor([[_word([3, 0, 1, 2] * 4, 2)]], dtype=torch.int32)
    assert unpack_int32(two, 2, dim=1).flatten().tolist() == [3, 0, 1, 2] * 4
    # AWQ: columns 0..7 of values 1..8 sit in the slots 0 2 4 6 1 3 5 7 of the word:
    # 0x86427531, written out.
    assert AWQ_PACK_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)
    word = torch.tensor([[0x86427531 - (1 << 32)]], dtype=torch.int32)
    zeros = torch.zeros(1, 1, dtype=torch.int32)
    scales = torch.ones(1, 8, dtype=torch.float16)
    weight = awq_dequantize(word, zeros, scales, group_size=-1)  # [N=8, K=1]
    assert weight.flatten().tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    # GPTQ's "gptq" format stores each zero one below: a stored 7 is 8.
    q = torch.tensor([[_word([8] * 8, 4)]], dtype=torch.int32).expand(1, 8).contiguous()
    z = torch.tensor([[_word([7] * 8, 4)]], dtype=torch.int32)
    w = gptq_dequantize(q, z, torch.full((1, 8), 0.5), None, 4, -1, zero_offset=1)
    assert torch.equal(w, torch.zeros(8, 8))
    # compressed-tensors pack-quantized: signed values -8..7 stored + 8, low bits first
    # along K; symmetric, so the zero is 8.
    word = torch.tensor([[_word([v + 8 for v in (-8, -1, 0, 1, 2, 3, 6, 7)], 4)]])
    w = pack_quantized_dequantize(
        word.to(torch.int32), torch.ones(1, 1), torch.tensor([1, 8]), 4, -1
    )
    assert w.flatten().tolist() == [-8, -1, 0, 1, 2, 3, 6, 7]


@pytest.mark.parametrize(
    ("fmt", "method"),
    [
        ("gptq", "gptq"),
        ("awq", "awq"),
        ("ct", "compressed-tensors"),
        ("ct_asym", "compressed-tensors"),
    ],
)
def test_tiny_checkpoint_matches_transformers_on_its_dequantized_weights(
    fmt: str, method: str, tiny_model_path, tmp_path: Path
) -> None:
    quant, plain = quantized_folder(tiny_model_path("llama"), tmp_path, fmt, group=32)
    config = resolve_quant_config("auto", load_hf_config(quant), torch.device("cpu"))
    assert config is not None and config.name == method
    assert resolve_quant_config(method, load_hf_config(quant), torch.device("cpu")) is not None
    ours, ref = build_cpu_model(quant), hf_model(plain)
    for backend in ("torch", "cpu"):
        model = build_cpu_model(quant, backend) if backend == "cpu" else ours
        prompts = random_prompts(512, [3, 17, 40], seed=31)
        check_prefill_then_decode((model, ref), prompts, seed=32)
    # The dequantized weights differ from the tiny model's own: not a pass-through.
    other = hf_model(tiny_model_path("llama"))
    ids = random_prompts(512, [20], seed=33)[0]
    with torch.inference_mode():
        a = other(torch.tensor([ids])).logits[0]
        b = ref(torch.tensor([ids])).logits[0]
    with pytest.raises(AssertionError):
        assert_logits_close(a, b, "the tiny model against its quantized version")


def _ct_int(changes: dict) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    weights.update(group_size=128, **changes)
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"g": {"targets": ["Linear"], "weights": weights}},
    }


@pytest.mark.parametrize(
    ("stored", "message"),
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit weights"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "marlin"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version 'gemv'"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "without zero points"),
        (_ct_int({"num_bits": 3}), "int 3-bit weights"),
        (_ct_int({"strategy": "tensor"}), "int weight strategy 'tensor'"),
        (_ct_int({"actorder": "sideways"}), "actorder 'sideways'"),
    ],
)
def test_unimplemented_schemes_are_refused_by_name(stored: dict, message: str) -> None:
    class Config:
        quantization_config = stored

    for device in ("cpu", "cuda"):
        with pytest.raises(ConfigError, match=message):
            resolve_quant_config("auto", Config(), torch.device(device))


def test_a_layer_missing_its_scales_is_named(tiny_model_path, tmp_path: Path) -> None:
    quant, _ = quantized_folder(tiny_model_path("llama"), tmp_path, "awq", group=32)
    tensors = load_file(str(quant / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.scales"]
    save_file(tensors, str(quant / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"model.layers.1.mlp.down_proj has only"):
        build_cpu_model(quant)


def test_quantization_flag_over_a_plain_checkpoint_is_refused(tiny_model_path) -> None:
    hf = load_hf_config(tiny_model_path("llama"))
    with pytest.raises(ConfigError, match="--quantization awq loads awq checkpoints"):
        resolve_quant_config("awq", hf, torch.device("cpu"))


# --- the kernel's layout (kept quantized on CUDA) ---------------------------------------------

CUDA = torch.device("cuda")  # a device named, never touched: the configs only read its type


def _layer_tensors(fmt: str, n: int, k: int, bits: int, group: int) -> tuple[dict, dict]:
    """(one layer's tensors as `fmt` stores them, under `layer.`; its quantization_config):
    random values, zero points (gptq: stored one below, as the "gptq" format does) and
    scales. fmt: gptq, gptq_v2, awq, ct (symmetric), ct_zp (zero points); gptq_act and
    ct_act: an act order (`desc_act`, actorder "group"), each group's channels a random
    `group` of the K."""
    gen = torch.Generator().manual_seed(sum(map(ord, fmt)) + bits + group)
    groups = 1 if group == -1 else k // group
    top = 1 << bits
    q = torch.randint(0, top, (n, k), generator=gen)
    zeros = torch.randint(1, top, (n, groups), generator=gen)
    scales = (0.004 + 0.02 * torch.rand(n, groups, generator=gen)).to(torch.float16)
    act = fmt.endswith("_act")
    g_idx = (torch.arange(k) // (k if group == -1 else group)).to(torch.int32)
    if act:
        g_idx = (torch.randperm(k, generator=gen) % groups).to(torch.int32)
    if fmt.startswith("gptq"):
        offset = 0 if fmt == "gptq_v2" else 1
        tensors = {
            "qweight": pack_int32(q.t(), bits, dim=0),
            "qzeros": pack_int32(zeros.t() - offset, bits, dim=1),
            "scales": scales.t().contiguous(),
            "g_idx": g_idx,
        }
        config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act}
        config["checkpoint_format"] = "gptq_v2" if fmt == "gptq_v2" else "gptq"
    elif fmt == "awq":
        tensors = {
            "qweight": pack_int32(awq_interleave(q.t()), 4, dim=1),
            "qzeros": pack_int32(awq_interleave(zeros.t()), 4, dim=1),
            "scales": scales.t().contiguous(),
        }
        config = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm"}
    else:
        tensors = {
            "weight_packed": pack_int32(q, bits, dim=1),
            "weight_scale": scales,
            "weight_shape": torch.tensor([n, k]),
        }
        if fmt in ("ct_zp", "ct_act"):
            tensors["weight_zero_point"] = pack_int32(zeros, bits, dim=0)
        if act:
            tensors["weight_g_idx"] = g_idx
        strategy = {"strategy": "channel"} if group == -1 else {"strategy": "group"}
        weights = {"num_bits": bits, "type": "int", "symmetric": fmt == "ct", **strategy}
        weights["group_size"] = None if group == -1 else group
        weights["actorder"] = "group" if act else None
        config = {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"g": {"targets": ["Linear"], "weights": weights}},
        }  # fmt: skip
    return {f"layer.{name}": t for name, t in tensors.items()}, config


class _HF:
    def __init__(self, stored: dict) -> None:
        self.quantization_config = stored


@pytest.mark.parametrize(
    ("fmt", "bits", "group"),
    [
        ("gptq", 4, 32),
        ("gptq_v2", 8, 64),
        ("gptq", 4, -1),
        ("awq", 4, 64),
        ("ct", 4, 32),
        ("ct_zp", 8, -1),
        ("ct_zp", 4, 128),
        ("gptq_act", 4, 32),
        ("gptq_act", 8, 64),
        ("ct_act", 4, 64),
    ],
)
def test_each_format_converts_to_the_kernel_layout_exactly(fmt: str, bits: int, group: int) -> None:
    """On CUDA the layer's tensors stream out as `weight` (uint8, packed along K), its scales
    and its zero points; dequantized by the kernel's reference they are, bit for bit, the
    weight today's dequantization gives (which the CPU still loads). With an act order, also
    `input_perm`: the weight's columns in that order, each group a run."""
    from tandem_kernels.int_w4a16 import dequantize_int_weight

    n, k = 48, 256
    tensors, stored = _layer_tensors(fmt, n, k, bits, group)
    dequantized = resolve_quant_config("auto", _HF(stored), torch.device("cpu"))
    kept = resolve_quant_config("auto", _HF(stored), CUDA)
    assert not dequantized.keep_quantized and kept.keep_quantized
    other = torch.randn(3, 4)
    stream = [*tensors.items(), ("model.norm.weight", other)]
    plain = dict(dequantized.map_checkpoint(stream))
    assert set(plain) == {"layer.weight", "model.norm.weight"}
    converted = dict(kept.map_checkpoint(stream))
    act = fmt.endswith("_act")
    assert set(converted) == {
        "layer.weight", "layer.weight_scale", "layer.weight_zero_point", "model.norm.weight",
        *(["layer.input_perm"] if act else []),
    }  # fmt: skip
    assert converted["model.norm.weight"] is other
    qweight = converted["layer.weight"]
    assert qweight.dtype == torch.uint8 and qweight.shape == (n, k * bits // 8)
    groups = 1 if group == -1 else k // group
    scale, zero = converted["layer.weight_scale"], converted["layer.weight_zero_point"]
    assert scale.shape == zero.shape == (n, groups)
    assert zero.min() >= 0 and zero.max() <= 1 << bits and torch.equal(zero, zero.round())
    weight = dequantize_int_weight(qweight, scale, zero, bits, group)
    expected = plain["layer.weight"]
    if act:
        assert converted["layer.input_perm"].dtype == torch.int32
        perm = converted["layer.input_perm"].long()
        assert torch.equal(perm.sort().values, torch.arange(k))  # a permutation
        assert not torch.equal(perm, torch.arange(k))
        expected = expected[:, perm]
    assert torch.equal(weight, expected)
    assert weight.abs().max() > 0.05  # not all zeros: the values, zeros and scales arrived


@pytest.mark.parametrize("expert", ["model.layers.0.mlp.experts.3.gate_proj", "lm_head"])
def test_experts_and_a_quantized_lm_head_stay_dequantized_on_cuda(expert: str) -> None:
    """A mixture-of-experts layer's experts have no integer kernel, and the LM head is a
    vocabulary layer: kept quantized, the config still streams them out dequantized, and the
    dense layers beside them packed."""
    tensors, stored = _layer_tensors("gptq", 48, 256, 4, 32)
    kept = resolve_quant_config("auto", _HF(stored), CUDA)
    stream = [(name.replace("layer.", f"{expert}."), t) for name, t in tensors.items()]
    stream += list(tensors.items())
    out = dict(kept.map_checkpoint(stream))
    assert set(out) == {
        f"{expert}.weight", "layer.weight", "layer.weight_scale", "layer.weight_zero_point",
    }  # fmt: skip
    assert (
        out[f"{expert}.weight"].dtype == torch.float32 and out["layer.weight"].dtype == torch.uint8
    )
    plain = resolve_quant_config("auto", _HF(stored), torch.device("cpu"))
    assert torch.equal(
        out[f"{expert}.weight"], dict(plain.map_checkpoint(tensors.items()))["layer.weight"]
    )


def test_the_device_decides_the_form_and_says_why_it_cannot_keep_some(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """CPU: dequantized at load, every layer's default method. CUDA: kept quantized where the
    kernel serves the scheme; else dequantized there too, with a log line naming why."""
    from tandem.layers.attention import get_attention_backend
    from tandem.layers.linear import ReplicatedLinear
    from tandem.layers.quantization.int_linear import IntWeightLinearMethod
    from tandem.models.interface import ModelContext

    _, stored = _layer_tensors("gptq", 48, 256, 4, 32)
    for device in (torch.device("cpu"), CUDA):
        config = resolve_quant_config("auto", _HF(stored), device)
        assert config.keep_quantized == (device.type == "cuda")
    kept = resolve_quant_config("auto", _HF(stored), CUDA)
    ctx = ModelContext.single(torch.float16, torch.device("cpu"), get_attention_backend("torch"))
    layer = ReplicatedLinear(256, 48, False, dataclasses.replace(ctx, quant_config=kept), "l")
    assert isinstance(layer.quant_method, IntWeightLinearMethod)
    shapes = {name: (tuple(p.shape), p.dtype) for name, p in layer.named_parameters()}
    assert shapes == {
        "weight": ((48, 128), torch.uint8),
        "weight_scale": ((48, 8), torch.float16),
        "weight_zero_point": ((48, 8), torch.float16),
    }
    for act_order in (
        _layer_tensors("gptq_act", 48, 256, 4, 32)[1],
        _layer_tensors("ct_act", 48, 256, 4, 32)[1],
    ):
        assert resolve_quant_config("auto", _HF(act_order), CUDA).keep_quantized
    refused = {
        "2-bit": {**stored, "bits": 2},
        "group size 48": {**stored, "group_size": 48},
        "modules_in_block_to_quantize": {**stored, "modules_in_block_to_quantize": [["q_proj"]]},
    }
    for why, scheme in refused.items():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tandem.layers.quantization.int_weight_only"):
            config = resolve_quant_config("auto", _HF(scheme), CUDA)
        assert not config.keep_quantized, why
        assert why in caplog.text and "dequantized at load" in caplog.text, caplog.text


def test_layers_the_checkpoint_leaves_unquantized_keep_the_default_method() -> None:
    _, awq = _layer_tensors("awq", 48, 256, 4, 64)
    awq["modules_to_not_convert"] = ["visual", "mlp.down_proj"]
    config = resolve_quant_config("auto", _HF(awq), CUDA)
    assert config.is_ignored("model.visual.blocks.0.qkv")
    assert config.is_ignored("model.layers.3.mlp.down_proj")
    assert not config.is_ignored("model.layers.3.mlp.gate_up_proj")
    _, ct = _layer_tensors("ct", 48, 256, 4, 32)
    ct["ignore"] = ["lm_head", "re:.*layers\\.1\\.self_attn\\.q_proj$"]
    config = resolve_quant_config("auto", _HF(ct), CUDA)
    assert config.is_ignored("model.layers.1.self_attn.qkv_proj")  # as its first part
    assert not config.is_ignored("model.layers.11.self_attn.qkv_proj")


def test_a_rank_must_hold_whole_groups_and_whole_bytes() -> None:
    from tandem.layers.attention import get_attention_backend
    from tandem.layers.linear import ColumnParallelLinear, RowParallelLinear
    from tandem.models.interface import ModelContext
    from tests.parallel_groups import fake_parallel_state

    _, stored = _layer_tensors("gptq", 48, 256, 4, 32)
    kept = resolve_quant_config("auto", _HF(stored), CUDA)
    backend = get_attention_backend("torch")
    tp2 = ModelContext(torch.float16, torch.device("cpu"), backend, fake_parallel_state(1, 2))
    tp2 = dataclasses.replace(tp2, quant_config=kept)
    RowParallelLinear(128, 48, False, tp2, prefix="ok")  # 64 columns a rank: two groups
    with pytest.raises(ConfigError, match=r"o_proj: this rank's 48 input columns"):
        RowParallelLinear(96, 48, False, tp2, prefix="o_proj")
    cpu = torch.device("cpu")
    one = dataclasses.replace(ModelContext.single(torch.float16, cpu, backend), quant_config=kept)
    with pytest.raises(ConfigError, match="4-bit weights pack two a byte"):
        ColumnParallelLinear(33, 48, False, one, prefix="odd")


def test_act_order_layers_gather_their_input_and_row_ranks_dequantize() -> None:
    """An act-order checkpoint kept quantized: every layer takes `input_perm` (whole on each
    rank of a column-parallel one), a fused layer's parts must bring the same order, and a
    row-parallel layer under tensor parallelism is left to the default method, its tensors
    streamed out dequantized (a rank's slice of the original order holds no whole group);
    at TP = 1 it stays quantized. A g_idx whose groups are not `group_size` channels each is
    refused by name."""
    from tandem.layers.attention import get_attention_backend
    from tandem.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from tandem.layers.quantization import UnquantizedLinearMethod
    from tandem.layers.quantization.int_linear import IntWeightLinearMethod
    from tandem.models.interface import ModelContext
    from tests.parallel_groups import fake_parallel_state

    tensors, stored = _layer_tensors("gptq_act", 64, 256, 4, 32)
    backend = get_attention_backend("torch")
    cpu = torch.device("cpu")
    kept = resolve_quant_config("auto", _HF(stored), CUDA)
    tp2 = dataclasses.replace(
        ModelContext(torch.float16, cpu, backend, fake_parallel_state(1, 2)), quant_config=kept
    )
    down = RowParallelLinear(256, 64, False, tp2, prefix="model.layers.0.mlp.down_proj")
    assert isinstance(down.quant_method, UnquantizedLinearMethod)
    assert kept.dequantized_prefixes == {"model.layers.0.mlp.down_proj"}
    gate_up = MergedColumnParallelLinear(256, [64, 64], False, tp2, prefix="mlp.gate_up_proj")
    assert isinstance(gate_up.quant_method, IntWeightLinearMethod)
    assert gate_up.input_perm.shape == (256,)  # whole on a column rank
    stream = [
        (name.replace("layer.", "model.layers.0.mlp.down_proj."), t) for name, t in tensors.items()
    ]
    out = dict(kept.map_checkpoint(stream))
    assert set(out) == {"model.layers.0.mlp.down_proj.weight"}
    plain = resolve_quant_config("auto", _HF(stored), cpu)
    assert torch.equal(
        out["model.layers.0.mlp.down_proj.weight"],
        dict(plain.map_checkpoint(tensors.items()))["layer.weight"],
    )

    one = dataclasses.replace(ModelContext.single(torch.float16, cpu, backend), quant_config=kept)
    assert isinstance(
        RowParallelLinear(256, 64, False, one, prefix="o").quant_method, IntWeightLinearMethod
    )

    # the parts of a fused layer: the same order loads, another is named
    params = dict(gate_up.named_parameters())
    perm = dict(kept.map_checkpoint(tensors.items()))["layer.input_perm"]
    params["input_perm"].weight_loader(params["input_perm"], perm, 0)
    params["input_perm"].weight_loader(params["input_perm"], perm.clone(), 1)
    with pytest.raises(ConfigError, match=r"mlp.gate_up_proj: part 1 has another act order"):
        params["input_perm"].weight_loader(params["input_perm"], perm.flip(0), 1)

    uneven = dict(tensors)
    uneven["layer.g_idx"] = torch.zeros(256, dtype=torch.int32)  # one group of 256, groups of 32
    with pytest.raises(ConfigError, match=r"layer layer: its g_idx does not give every group 32"):
        dict(kept.map_checkpoint(uneven.items()))
