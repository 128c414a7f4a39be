"""Integer-weight checkpoints written out from their formats for tests (GPTQ, AWQ,
compressed-tensors pack-quantized): random integers, zero points and group scales in place of
a tiny model's linear weights, beside the same weights dequantized as a plain folder. Shared by
tests/unit/test_int_weight_only.py and the interpreter cases of test_kernels_interp.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tandem.layers.quantization.int_weight_only import AWQ_PACK_ORDER

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """`values` (ints < 2**bits) packed into int32 words along `dim`, low bits first."""
    per = 32 // bits
    v = values.to(torch.int64)
    if dim == 1:
        v = v.t()
    v = v.reshape(v.shape[0] // per, per, v.shape[1])
    words = sum(v[:, i, :] << (i * bits) for i in range(per))
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.t().contiguous() if dim == 1 else words.contiguous()


def awq_interleave(t: torch.Tensor) -> torch.Tensor:
    """Columns in AWQ's word order: slot i of each eight holds column AWQ_PACK_ORDER[i]."""
    slot = torch.tensor(AWQ_PACK_ORDER)
    return t.view(t.shape[0], -1, 8)[:, :, slot].reshape(t.shape)


def quantized_folder(
    src: Path, out: Path, fmt: str, group: int, unquantized: str | None = None
) -> tuple[Path, Path]:
    """(the quantized checkpoint, the same weights dequantized as a plain folder). `fmt`:
    gptq (desc_act), gptq_runs (groups in runs, a g_idx of runs stored all the same), awq,
    ct (compressed-tensors pack-quantized, symmetric groups) or ct_asym (zero points,
    actorder "group"). `unquantized`: the layers whose name ends so stay 16-bit, listed as
    such in the config (AWQ's `modules_to_not_convert`, compressed-tensors' `ignore`). An act
    order (gptq, ct_asym) is one random order per layer input, shared by the projections that
    read it (q, k, v; gate, up), as GPTQ's come from their input's statistics."""
    gen = torch.Generator().manual_seed(5)
    tensors = load_file(str(src / "model.safetensors"))
    quant, plain = dict(tensors), dict(tensors)
    orders: dict[tuple[str, str], torch.Tensor] = {}
    for name, weight in tensors.items():
        if name.split(".")[-2] not in LINEARS:
            continue
        if unquantized is not None and name.endswith(f"{unquantized}.weight"):
            continue
        n, k = weight.shape
        prefix = name[: -len(".weight")]
        groups = k // group
        layer, proj = prefix.rsplit(".", 1)
        reader = (
            layer,
            {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(proj, proj),
        )
        if fmt in ("gptq", "ct_asym") and reader not in orders:
            orders[reader] = torch.randperm(k, generator=gen) % groups
        act_order = orders.get(reader)
        q = torch.randint(0, 16, (k, n), generator=gen)
        zeros = torch.randint(3, 13, (groups, n), generator=gen)
        scales = (0.004 + 0.02 * torch.rand(groups, n, generator=gen)).to(torch.float16)
        del quant[name]
        if fmt.startswith("ct"):
            order = fmt == "ct_asym"
            g = act_order if order else torch.arange(k) // group
            zp = zeros.t() if order else torch.full((n, groups), 8)  # [N, G]
            dense = (q.t() - zp[:, g]).float() * scales.t()[:, g].float()
            quant[f"{prefix}.weight_packed"] = pack_int32(q.t(), 4, dim=1)
            quant[f"{prefix}.weight_scale"] = scales.t().contiguous()
            quant[f"{prefix}.weight_shape"] = torch.tensor([n, k])
            if order:
                quant[f"{prefix}.weight_zero_point"] = pack_int32(zp, 4, dim=0)
                quant[f"{prefix}.weight_g_idx"] = g.to(torch.int32)
            plain[name] = dense.contiguous()
            continue
        if fmt.startswith("gptq"):
            runs = torch.arange(k) // group
            g_idx = runs if fmt == "gptq_runs" else act_order
            dense = (q - zeros[g_idx]).float() * scales[g_idx].float()
            quant[f"{prefix}.qweight"] = pack_int32(q, 4, dim=0)
            quant[f"{prefix}.qzeros"] = pack_int32(zeros - 1, 4, dim=1)  # stored one below
            quant[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
        else:
            g = torch.arange(k) // group
            dense = (q - zeros[g]).float() * scales[g].float()
            quant[f"{prefix}.qweight"] = pack_int32(awq_interleave(q), 4, dim=1)
            quant[f"{prefix}.qzeros"] = pack_int32(awq_interleave(zeros), 4, dim=1)
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
            "ignore": ["lm_head", *([f"re:.*{unquantized}$"] if unquantized else [])],
        }  # fmt: skip
    elif fmt.startswith("gptq"):
        assert unquantized is None, "GPTQ's lists of quantized modules are not written"
        config["quantization_config"] = {
            "quant_method": "gptq", "bits": 4, "group_size": group,
            "desc_act": fmt == "gptq", "sym": False, "checkpoint_format": "gptq",
        }  # fmt: skip
    else:
        config["quantization_config"] = {
            "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": [unquantized] if unquantized else None,
        }  # fmt: skip
    (folders[0] / "config.json").write_text(json.dumps(config))
    return folders[0], folders[1]
