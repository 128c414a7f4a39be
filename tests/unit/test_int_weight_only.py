"""GPTQ and AWQ checkpoints (tandem/layers/quantization/int_weight_only.py): the packings
against words written out by hand from the formats, then a tiny Llama whose linear layers are
stored each way (random integers, zero points and group scales; GPTQ with a `desc_act`
channel order) against transformers on the same weights dequantized, and the refusals."""

from __future__ import annotations

import json
import shutil
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
from tests.parity.test_model_forward import (
    assert_logits_close,
    build_cpu_model,
    check_prefill_then_decode,
    hf_model,
    random_prompts,
)

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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


def _pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """`values` (ints < 2**bits) packed into int32 words along `dim`, low bits first."""
    per = 32 // bits
    v = values.to(torch.int64)
    if dim == 1:
        v = v.t()
    v = v.reshape(v.shape[0] // per, per, v.shape[1])
    words = sum(v[:, i, :] << (i * bits) for i in range(per))
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.t().contiguous() if dim == 1 else words.contiguous()


def _awq_interleave(t: torch.Tensor) -> torch.Tensor:
    """Columns in AWQ's word order: slot i of each eight holds column AWQ_PACK_ORDER[i]."""
    slot = torch.tensor(AWQ_PACK_ORDER)
    return t.view(t.shape[0], -1, 8)[:, :, slot].reshape(t.shape)


def _quantized_folder(src: Path, out: Path, fmt: str, group: int) -> tuple[Path, Path]:
    """(the quantized checkpoint, the same weights dequantized as a plain folder). `fmt`:
    gptq (desc_act), awq, ct (compressed-tensors pack-quantized, symmetric groups) or
    ct_asym (zero points, actorder "group")."""
    gen = torch.Generator().manual_seed(5)
    tensors = load_file(str(src / "model.safetensors"))
    quant, plain = dict(tensors), dict(tensors)
    for name, weight in tensors.items():
        if name.split(".")[-2] not in LINEARS:
            continue
        n, k = weight.shape
        prefix = name[: -len(".weight")]
        groups = k // group
        q = torch.randint(0, 16, (k, n), generator=gen)
        zeros = torch.randint(3, 13, (groups, n), generator=gen)
        scales = (0.004 + 0.02 * torch.rand(groups, n, generator=gen)).to(torch.float16)
        del quant[name]
        if fmt.startswith("ct"):
            order = fmt == "ct_asym"
            g = torch.randperm(k, generator=gen) % groups if order else torch.arange(k) // group
            zp = zeros.t() if order else torch.full((n, groups), 8)  # [N, G]
            dense = (q.t() - zp[:, g]).float() * scales.t()[:, g].float()
            quant[f"{prefix}.weight_packed"] = _pack(q.t(), 4, dim=1)
            quant[f"{prefix}.weight_scale"] = scales.t().contiguous()
            quant[f"{prefix}.weight_shape"] = torch.tensor([n, k])
            if order:
                quant[f"{prefix}.weight_zero_point"] = _pack(zp, 4, dim=0)
                quant[f"{prefix}.weight_g_idx"] = g.to(torch.int32)
            plain[name] = dense.contiguous()
            continue
        if fmt == "gptq":
            g_idx = torch.randperm(k, generator=gen) % groups  # a desc_act order
            dense = (q - zeros[g_idx]).float() * scales[g_idx].float()
            quant[f"{prefix}.qweight"] = _pack(q, 4, dim=0)
            quant[f"{prefix}.qzeros"] = _pack(zeros - 1, 4, dim=1)  # stored one below
            quant[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
        else:
            g = torch.arange(k) // group
            dense = (q - zeros[g]).float() * scales[g].float()
            quant[f"{prefix}.qweight"] = _pack(_awq_interleave(q), 4, dim=1)
            quant[f"{prefix}.qzeros"] = _pack(_awq_interleave(zeros), 4, dim=1)
        quant[f"{prefix}.scales"] = scales
        plain[name] = dense.t().contiguous()
    folders = []
    for kind, weights in (("quant", quant), ("plain", plain)):
        folder = out / f"{fmt}-{kind}"
        shutil.copytree(src, folder)
        save_file(weights, str(folder / "model.safetensors"))
        folders.append(folder)
    config = json.loads((folders[0] / "config.json").read_text())
    if fmt.startswith("ct"):
        asym = fmt == "ct_asym"
        weights = {
            "num_bits": 4, "type": "int", "symmetric": not asym, "strategy": "group",
            "group_size": group, "actorder": "group" if asym else None,
        }  # fmt: skip
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": ["lm_head"],
        }  # fmt: skip
    elif fmt == "gptq":
        config["quantization_config"] = {
            "quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": True,
            "sym": False, "checkpoint_format": "gptq",
        }  # fmt: skip
    else:
        config["quantization_config"] = {
            "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
            "version": "gemm",
        }  # fmt: skip
    (folders[0] / "config.json").write_text(json.dumps(config))
    return folders[0], folders[1]


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
    quant, plain = _quantized_folder(tiny_model_path("llama"), tmp_path, fmt, group=32)
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

    with pytest.raises(ConfigError, match=message):
        resolve_quant_config("auto", Config(), torch.device("cpu"))


def test_a_layer_missing_its_scales_is_named(tiny_model_path, tmp_path: Path) -> None:
    quant, _ = _quantized_folder(tiny_model_path("llama"), tmp_path, "awq", group=32)
    tensors = load_file(str(quant / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.scales"]
    save_file(tensors, str(quant / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"model.layers.1.mlp.down_proj has only"):
        build_cpu_model(quant)


def test_quantization_flag_over_a_plain_checkpoint_is_refused(tiny_model_path) -> None:
    hf = load_hf_config(tiny_model_path("llama"))
    with pytest.raises(ConfigError, match="--quantization awq loads awq checkpoints"):
        resolve_quant_config("awq", hf, torch.device("cpu"))
