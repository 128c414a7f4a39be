"""FP8 on the CPU: the quantizers and `torch._scaled_mm` against their dequantize-then-matmul
reference, `Fp8LinearMethod` quantizing at load (per tensor; per channel with per-token
activations) and sharding its scales with its weights, FP8 checkpoints (compressed-tensors
per tensor / per channel, HF `fp8` with block scales) written here and loaded as stored,
matching the model quantized at load, and the start-up errors (FP8 on the CPU, schemes not
implemented)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from safetensors.torch import save_file

from tandem.config import ConfigError
from tandem.engine_args import EngineArgs
from tandem.layers.attention import get_attention_backend
from tandem.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tandem.layers.quantization import (
    FbgemmFp8Config,
    Fp8Config,
    Fp8LinearMethod,
    ModelOptFp8Config,
    PtpcFp8Config,
    resolve_quant_config,
)
from tandem.layers.quantization.fp8 import Fp8Scheme
from tandem.loader import build_model, iterate_weights
from tandem.models import ModelContext
from tandem_kernels import fp8 as fp8_ops
from tests.conftest import build_attn_metadata
from tests.parallel_groups import CPU, fake_parallel_state

BLOCK_SIZE = 16
# The projections an FP8 checkpoint of test_fp8's writer quantizes (w1, w2, w3: Mixtral's
# experts; its router, `gate`, stays unquantized as in real checkpoints).
LINEAR_NAMES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"
)  # fmt: skip


def context(quant: Any, tp_rank: int = 0, tp_size: int = 1) -> ModelContext:
    state = fake_parallel_state(tp_rank, tp_size)
    return ModelContext(torch.float32, CPU, get_attention_backend("torch"), state, quant)


# ----------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("rowwise", [False, True])
def test_scaled_mm_matches_reference(rowwise: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=gen)
    w = torch.randn(48, 64, generator=gen) * 0.05
    bias = torch.randn(48, generator=gen).to(torch.bfloat16)
    if rowwise:
        (xq, xs), (wq, ws) = fp8_ops.quantize_per_row(x), fp8_ops.quantize_per_row(w)
        assert xs.shape == (7, 1) and ws.shape == (48, 1)
    else:
        (xq, xs), (wq, ws) = fp8_ops.quantize_per_tensor(x), fp8_ops.quantize_per_tensor(w)
        assert xs.shape == () and ws.shape == ()
    got = fp8_ops.fp8_scaled_mm(xq, wq, xs, ws, bias).float()
    ref = fp8_ops.fp8_scaled_mm_ref(xq, wq, xs, ws, bias).float()
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    # And FP8 is close to the unquantized product (e4m3: ~3 mantissa bits per operand).
    exact = x @ w.t() + bias.float()
    assert (ref - exact).norm() / exact.norm() < 0.06


def test_scaled_mm_layout_rules_are_asserted() -> None:
    x = fp8_ops.quantize_per_tensor(torch.randn(4, 40))[0]  # K = 40: not a multiple of 16
    w = fp8_ops.quantize_per_tensor(torch.randn(16, 40))[0]
    one = torch.tensor(1.0)
    with pytest.raises(AssertionError, match="K, N % 16"):
        fp8_ops.fp8_scaled_mm(x, w, one, one)
    x = fp8_ops.quantize_per_tensor(torch.randn(4, 32))[0]
    w = fp8_ops.quantize_per_tensor(torch.randn(16, 32))[0]
    with pytest.raises(AssertionError):  # rowwise scales of the wrong shape
        fp8_ops.fp8_scaled_mm(x, w, torch.ones(4), torch.ones(16, 1))


def test_quantizers_round_trip_within_e4m3_precision() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 72, generator=gen) * torch.linspace(0.01, 3, 40).unsqueeze(1)
    for q, deq in [
        (lambda t: fp8_ops.quantize_per_tensor(t), lambda q, s: fp8_ops.dequantize(q, s)),
        (lambda t: fp8_ops.quantize_per_row(t), lambda q, s: fp8_ops.dequantize(q, s)),
        (
            lambda t: fp8_ops.quantize_per_block(t, (16, 32)),
            lambda q, s: fp8_ops.dequantize(q, s, (16, 32)),
        ),
    ]:
        wq, scale = q(w)
        assert wq.dtype == torch.float8_e4m3fn
        assert wq.float().abs().max() <= fp8_ops.FP8_MAX
        back = deq(wq, scale)
        # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 per normal value.
        big = back.abs() > scale.max() * 2**-6 if scale.dim() else back.abs() > scale * 2**-6
        assert ((back - w).abs()[big] <= w.abs()[big] * 2**-4 + 1e-7).all()
    _, tiles = fp8_ops.quantize_per_block(w, (16, 32))
    assert tiles.shape == (3, 3)  # ceil(40 / 16), ceil(72 / 32)
    assert fp8_ops.quantize_per_tensor(torch.zeros(16, 16))[0].float().abs().sum() == 0


# ----------------------------------------------------------------------------- layers


def _load_linear(layer: torch.nn.Module, parts: list[tuple[torch.Tensor, Any]]) -> None:
    for tensor, shard in parts:
        if shard is None:
            layer.weight.weight_loader(layer.weight, tensor)
        else:
            layer.weight.weight_loader(layer.weight, tensor, shard)
    layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("quant", [Fp8Config(), PtpcFp8Config()], ids=["fp8", "ptpc_fp8"])
def test_linear_quantized_at_load(quant: Fp8Config) -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, 64, generator=gen) * 0.05 for n in (64, 32, 32))
    layer = QKVParallelLinear(64, 16, 4, 2, False, context(quant), prefix="qkv")
    assert isinstance(layer.quant_method, Fp8LinearMethod)
    assert layer.weight.dtype == torch.float32  # quantized only after loading
    _load_linear(layer, [(q, "q"), (k, "k"), (v, "v")])
    assert layer.weight.dtype == torch.float8_e4m3fn
    per_channel = quant.scheme.weight_strategy == "channel"
    assert layer.weight_scale.shape == ((128, 1) if per_channel else ())
    x = torch.randn(5, 64, generator=gen)
    out = layer(x)
    full = torch.cat([q, k, v])
    if per_channel:
        xq, xs = fp8_ops.quantize_per_row(x)
        wq, ws = fp8_ops.quantize_per_row(full)
    else:
        xq, xs = fp8_ops.quantize_per_tensor(x)
        wq, ws = fp8_ops.quantize_per_tensor(full)
    torch.testing.assert_close(out, fp8_ops.fp8_scaled_mm_ref(xq, wq, xs, ws, None, torch.float32))
    exact = x @ full.t()
    assert (out - exact).norm() / exact.norm() < 0.06


def test_channel_scales_shard_with_their_weights() -> None:
    """Column parallel: rank r's output columns (and scales) are exactly the whole layer's;
    row parallel: every rank holds all output channels' scales."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 32, generator=gen)
    x = torch.randn(3, 32, generator=gen)
    quant = PtpcFp8Config()
    whole = ColumnParallelLinear(32, 64, False, context(quant), prefix="col")
    _load_linear(whole, [(w, None)])
    for rank in range(2):
        part = ColumnParallelLinear(32, 64, False, context(quant, rank, 2), prefix="col")
        _load_linear(part, [(w, None)])
        rows = slice(rank * 32, (rank + 1) * 32)
        assert torch.equal(part.weight_scale, whole.weight_scale[rows])
        assert torch.equal(part(x), whole(x)[:, rows])
        row = RowParallelLinear(64, 32, False, context(quant, rank, 2), prefix="row")
        _load_linear(row, [(w.t().contiguous(), None)])
        assert row.weight.shape == (32, 32) and row.weight_scale.shape == (32, 1)


def test_lm_head_and_ignored_layers_stay_unquantized(tiny_model_path) -> None:
    model = build_model(tiny_model_path("llama"), context(Fp8Config()))
    quantized = {n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert len(quantized) == 4 * 2  # qkv, o, gate_up, down in each of the 2 layers
    assert model.lm_head.weight.dtype == torch.float32
    ignored = Fp8Config(ignored_layers=("model.layers.0.self_attn.q_proj", "re:.*down_proj"))
    assert ignored.is_ignored("model.layers.0.self_attn.qkv_proj")
    assert ignored.is_ignored("model.layers.1.mlp.down_proj")
    assert not ignored.is_ignored("model.layers.1.self_attn.qkv_proj")


# ----------------------------------------------------------------------------- checkpoints


def _write_fp8_checkpoint(src: Path, dst: Path, kind: str) -> Path:
    """`src`'s weights quantized here into an FP8 checkpoint of `kind` in `dst`."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in iterate_weights(src):
        proj = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if proj not in LINEAR_NAMES or (kind == "modelopt_fp8" and ".layers.1.mlp." in name):
            tensors[name] = tensor.contiguous()  # (ModelOpt's: excluded by a wildcard)
            continue
        base = name[: -len("weight")]
        if kind == "ct_tensor":
            q, s = fp8_ops.quantize_per_tensor(tensor)
            tensors[base + "weight_scale"] = s.reshape(1)
        elif kind in ("ct_static", "modelopt_fp8"):
            q, s = fp8_ops.quantize_per_tensor(tensor)
            shape = () if kind == "modelopt_fp8" else (1,)  # ModelOpt's scalars are 0-d
            tensors[base + "weight_scale"] = s.reshape(shape)
            tensors[base + "input_scale"] = torch.tensor(0.02).reshape(shape)
        elif kind in ("ct_channel", "modelopt_pcpt", "fbgemm"):
            q, s = fp8_ops.quantize_per_row(tensor)
            tensors[base + "weight_scale"] = s.reshape(-1) if kind == "modelopt_pcpt" else s
        elif kind == "modelopt_pb_wo":  # ModelOpt stores 128 x 128 tiles as [N/128, 1, K/128, 1]
            q, s = fp8_ops.quantize_per_block(tensor, (128, 128))
            tensors[base + "weight_scale"] = s[:, None, :, None].contiguous()
        else:
            q, s = fp8_ops.quantize_per_block(tensor, _BLOCKS[kind])
            tensors[base + "weight_scale_inv"] = s
        tensors[name] = q
    config = json.loads((src / "config.json").read_text())
    if kind == "modelopt_fp8":  # the scheme in hf_quant_config.json, with the KV scales
        for i in range(config["num_hidden_layers"]):
            attn = f"model.layers.{i}.self_attn"
            tensors[f"{attn}.k_proj.k_scale"] = torch.tensor(0.03 + i / 100)
            tensors[f"{attn}.v_proj.v_scale"] = torch.tensor(0.05 + i / 100)
        (dst / "hf_quant_config.json").write_text(json.dumps(_QUANT_CONFIGS[kind]))
    else:
        config["quantization_config"] = _QUANT_CONFIGS[kind]
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


_BLOCKS = {"fp8_block128": (128, 128), "fp8_block16": (16, 16)}


def _ct_config(weights: str, acts: str, dynamic: bool) -> dict[str, Any]:
    def args(strategy: str, dyn: bool) -> dict[str, Any]:
        return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
                "dynamic": dyn}  # fmt: skip

    group = {"targets": ["Linear"], "weights": args(weights, False)}
    group["input_activations"] = args(acts, dynamic)
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
    }


_QUANT_CONFIGS: dict[str, dict[str, Any]] = {
    "ct_tensor": _ct_config("tensor", "tensor", True),
    "ct_static": _ct_config("tensor", "tensor", False),
    "ct_channel": _ct_config("channel", "token", True),
    **{
        k: {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(b)}
        for k, b in _BLOCKS.items()
    },
    # ModelOpt: hf_quant_config.json's layout, then the config's own (lower-case algorithm).
    "modelopt_fp8": {
        "producer": {"name": "modelopt", "version": "0.19.0"},
        "quantization": {
            "quant_algo": "FP8",
            "kv_cache_quant_algo": "FP8",
            "exclude_modules": ["lm_head", "model.layers.1.mlp*"],
        },
    },
    "modelopt_pcpt": {
        "quant_method": "modelopt",
        "quant_algo": "fp8_per_channel_per_token",
        "ignore": ["lm_head"],
    },
    "modelopt_pb_wo": {"quant_method": "modelopt", "quant_algo": "FP8_PB_WO"},
    "fbgemm": {
        "quant_method": "fbgemm_fp8",
        "activation_scale_ub": 1200.0,
        "modules_to_not_convert": ["lm_head"],
    },
}
# The config that quantizes the unquantized model at load the same way.
_AT_LOAD: dict[str, Fp8Config | None] = {
    "ct_tensor": Fp8Config(),
    "ct_static": None,
    "ct_channel": PtpcFp8Config(),
    "fp8_block128": Fp8Config(Fp8Scheme(weight_strategy="block", weight_block_size=(128, 128))),
    "fp8_block16": Fp8Config(Fp8Scheme(weight_strategy="block", weight_block_size=(16, 16))),
    "modelopt_fp8": None,
    "modelopt_pcpt": PtpcFp8Config(),
    "modelopt_pb_wo": Fp8Config(Fp8Scheme(weight_strategy="block", weight_block_size=(128, 128))),
    "fbgemm": PtpcFp8Config(),  # (the tiny model's activations stay far under the bound)
}
# Kinds whose stored scales equal quantizing at load exactly (no fused parts requantized).
_SAME_BYTES = ("ct_channel", "fp8_block16", "modelopt_pcpt", "fbgemm")


def _logits(model: Any, device: torch.device = CPU) -> torch.Tensor:
    """Logits of one paged prefill of two requests (5 and 9 tokens) through `model`."""
    lens = [5, 9]
    md = build_attn_metadata(lens, lens, [[1], [2]], BLOCK_SIZE)
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        setattr(md, name, getattr(md, name).to(device))
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(3, model.vocab_size, (sum(lens),), generator=gen).to(device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    shape = (4, 2, BLOCK_SIZE, model.num_kv_heads, model.head_size)
    kv = [torch.zeros(shape, dtype=model.dtype, device=device) for _ in range(model.num_layers)]
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, kv, md))


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_path) -> tuple[Path, torch.Tensor]:
    path = tiny_model_path("llama")
    return path, _logits(build_model(path, context(None)))


@pytest.mark.parametrize("kind", list(_QUANT_CONFIGS))
def test_fp8_checkpoint_loads_as_stored(kind: str, tiny_llama, tmp_path: Path) -> None:
    src, exact = tiny_llama
    folder = _write_fp8_checkpoint(src, tmp_path / kind, kind)
    from tandem.loader import load_hf_config

    hf_config = load_hf_config(folder)
    quant = resolve_quant_config("auto", hf_config, CPU, check_device=False)
    assert quant is not None and quant.scheme.is_checkpoint_fp8_serialized
    stored = build_model(folder, context(quant), hf_config=hf_config)
    logits = _logits(stored)
    # e4m3 rounds each operand by up to 2^-4 (about 5% per product, RMS): through the tiny
    # model's 2 layers its logits move by about 10%.
    assert (logits - exact).norm() / exact.norm() < 0.15, kind
    at_load = _AT_LOAD[kind]
    if at_load is None:
        return
    quantized = build_model(src, context(at_load))
    for name, param in quantized.named_parameters():
        mine = stored.get_parameter(name)
        fused = ".qkv_proj." in name or ".gate_up_proj." in name
        if kind in _SAME_BYTES or not fused:  # same scales: same bytes
            assert torch.equal(param, mine), (kind, name)
        elif name.endswith(".weight"):  # parts requantized to one scale / tiles over parts
            prefix = name[: -len("weight")]
            a, b = _dequantized(quantized, prefix), _dequantized(stored, prefix)
            assert ((a - b).abs() <= a.abs() * 2**-3 + 1e-3).all(), (kind, name)
    if kind in _SAME_BYTES:
        torch.testing.assert_close(logits, _logits(quantized), atol=0, rtol=0)


def test_modelopt_checkpoint_names_its_scheme_excludes_and_kv_scales(
    tiny_llama, tmp_path: Path
) -> None:
    """A ModelOpt export whose scheme lives in hf_quant_config.json: read as `modelopt`
    (static per-tensor FP8), its wildcard exclusion leaves layer 1's MLP in the model's
    dtype, the KV cache scales stored under k_proj / v_proj reach the attention layers;
    `--quantization fp8` over it is its scheme, `modelopt` over a plain checkpoint an error."""
    src, _ = tiny_llama
    folder = _write_fp8_checkpoint(src, tmp_path / "modelopt", "modelopt_fp8")
    hf_config = _hf(folder)
    assert hf_config.quantization_config["quant_method"] == "modelopt"
    quant = resolve_quant_config("auto", hf_config, CPU, check_device=False)
    assert isinstance(quant, ModelOptFp8Config) and quant.quant_algo == "FP8"
    assert quant.scheme.activation_scheme == "static"
    assert isinstance(resolve_quant_config("fp8", hf_config, CPU, check_device=False), type(quant))
    model = build_model(folder, context(quant), hf_config=hf_config)
    layers = model.model.layers
    assert layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert layers[0].mlp.down_proj.input_scale.item() == pytest.approx(0.02)
    assert layers[1].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    for name in ("gate_up_proj", "down_proj"):
        assert getattr(layers[1].mlp, name).weight.dtype == torch.float32
    for i, layer in enumerate(layers):
        attn = layer.self_attn.attn
        assert (attn.k_scale, attn.v_scale) == pytest.approx((0.03 + i / 100, 0.05 + i / 100))
    with pytest.raises(ConfigError, match="--quantization modelopt loads modelopt checkpoints"):
        resolve_quant_config("modelopt", _hf(src), CPU, check_device=False)
    with pytest.raises(ConfigError, match="quantization must be one of"):
        EngineArgs(quantization="nvfp4").create_engine_config(resolve=False)
    assert EngineArgs(quantization="modelopt").create_engine_config(resolve=False)


def test_fbgemm_activation_bound_caps_each_tokens_scale(tiny_llama, tmp_path: Path) -> None:
    """An fbgemm_fp8 checkpoint with a low `activation_scale_ub`: every linear quantizes its
    own input (no fused producer) per token with the amax capped, so a large token saturates;
    its output equals that quantization's reference product, and differs from the unbounded
    one (ptpc_fp8's) where the bound binds. Its experts are refused."""
    src, _ = tiny_llama
    folder = _write_fp8_checkpoint(src, tmp_path / "fbgemm", "fbgemm")
    hf_config = _hf(folder)
    hf_config.quantization_config = {**_QUANT_CONFIGS["fbgemm"], "activation_scale_ub": 5.0}
    quant = resolve_quant_config("auto", hf_config, CPU, check_device=False)
    assert isinstance(quant, FbgemmFp8Config) and quant.scheme.activation_scale_ub == 5.0
    model = build_model(folder, context(quant), hf_config=hf_config)
    layer = model.model.layers[0].mlp.gate_up_proj
    assert layer.quant_method.input_quantizer(layer) is None
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, layer.input_size_per_partition, generator=gen)
    x[2] *= 40  # amax far over the bound: this token saturates
    with torch.inference_mode():
        got = layer(x)
    xq, xs = fp8_ops.quantize_per_row(x, 5.0)
    assert xs[2].item() == pytest.approx(5.0 / fp8_ops.FP8_MAX, rel=1e-6) and xs[0] < xs[2]
    want = fp8_ops.fp8_scaled_mm_ref(xq, layer.weight, xs, layer.weight_scale, None, x.dtype)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    xq_free, xs_free = fp8_ops.quantize_per_row(x)
    free = fp8_ops.fp8_scaled_mm_ref(
        xq_free, layer.weight, xs_free, layer.weight_scale, None, x.dtype
    )
    assert not torch.allclose(got[2], free[2], rtol=0.1) and torch.equal(got[0], free[0])
    with pytest.raises(ConfigError, match="activation scale bound"):
        quant.get_experts_method(layer, "model.layers.0.mlp.experts")


def _dequantized(model: Any, prefix: str) -> torch.Tensor:
    """A layer's FP8 weight times its scale (a block scale held per row: `(1, bk)` tiles)."""
    weight = model.get_parameter(prefix + "weight")
    names = dict(model.named_parameters())
    if prefix + "weight_scale_inv" in names:
        scale = names[prefix + "weight_scale_inv"]
        bk = -(-weight.shape[1] // scale.shape[1])
        return fp8_ops.dequantize(weight, scale, (1, bk))
    return fp8_ops.dequantize(weight, names[prefix + "weight_scale"])


def test_stored_scales_shard_with_their_weights(tiny_llama, tmp_path: Path) -> None:
    src, _ = tiny_llama
    for kind in ("ct_channel", "fp8_block16"):
        folder = _write_fp8_checkpoint(src, tmp_path / kind, kind)
        quant = Fp8Config.from_config(_QUANT_CONFIGS[kind]) if "block" in kind else None
        quant = quant or resolve_quant_config("auto", _hf(folder), CPU, check_device=False)
        whole = dict(build_model(folder, context(quant)).named_parameters())
        for rank in range(2):
            part = dict(build_model(folder, context(quant, rank, 2)).named_parameters())
            for name in ("model.layers.1.mlp.gate_up_proj", "model.layers.1.self_attn.qkv_proj"):
                scale = "weight_scale" if kind == "ct_channel" else "weight_scale_inv"
                for suffix in ("weight", scale):
                    full, mine = whole[f"{name}.{suffix}"], part[f"{name}.{suffix}"]
                    halves = [p.chunk(2)[rank] for p in _parts(name, full)]
                    assert torch.equal(mine.float(), torch.cat(halves).float()), (name, suffix)
            down = "model.layers.1.mlp.down_proj"
            cols = whole[f"{down}.weight"].shape[1] // 2
            assert torch.equal(
                part[f"{down}.weight"].float(),
                whole[f"{down}.weight"][:, rank * cols : (rank + 1) * cols].float(),
            )
            if kind == "fp8_block16":
                tiles = whole[f"{down}.weight_scale_inv"].chunk(2, dim=1)[rank]
                assert torch.equal(part[f"{down}.weight_scale_inv"], tiles)


def _parts(name: str, full: torch.Tensor) -> list[torch.Tensor]:
    return list(full.split([64, 32, 32])) if "qkv" in name else list(full.chunk(2))


def _hf(folder: Path) -> Any:
    from tandem.loader import load_hf_config

    return load_hf_config(folder)


# ----------------------------------------------------------------------------- errors


def test_fp8_refused_where_it_cannot_run(tiny_model_path, tmp_path: Path) -> None:
    hf = _hf(tiny_model_path("llama"))
    with pytest.raises(ConfigError, match=r"--quantization fp8 needs a CUDA GPU .* not cpu"):
        resolve_quant_config("fp8", hf, CPU)
    with pytest.raises(ConfigError, match=r"compute capability >= 8\.9"):
        from tandem.layers.quantization.fp8 import check_fp8_device

        check_fp8_device(torch.device("cuda"), "fp8", capability=(8, 0), name="A100")
    assert resolve_quant_config("auto", hf, CPU) is None
    args = EngineArgs(model=str(tiny_model_path("llama")), quantization="fp8", device="cpu")
    assert args.create_engine_config(resolve=False).quantization.quantization == "fp8"
    assert EngineArgs(quantization=None).create_engine_config(resolve=False).quantization
    with pytest.raises(ConfigError, match="quantization must be"):
        EngineArgs(quantization="int4").create_engine_config(resolve=False)


@pytest.mark.parametrize(
    ("stored", "message"),
    [
        ({"quant_method": "bitsandbytes"}, "quantization method 'bitsandbytes' is not implemented"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_algo 'NVFP4'"),
        (
            {"quant_method": "modelopt", "quantization": {"kv_cache_quant_algo": "NVFP4"}},
            "no quant_algo",
        ),
        (
            {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_scheme": {"num_bits": 4}},
            "kv_cache_quant_algo",
        ),
        ({"quant_method": "modelopt"}, "no quant_algo"),
        ({"quant_method": "fbgemm_fp8"}, "activation_scale_ub None is not a number"),
        ({"quant_method": "fbgemm_fp8", "activation_scale_ub": -1}, "must be > 0"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2' is not implemented"),
        (
            {**_ct_config("group", "tensor", True), "format": "float-quantized"},
            "weight strategy 'group'",
        ),
        ({**_ct_config("tensor", "tensor", True), "format": "pack-quantized"}, "needs int weights"),
        (
            {
                **_ct_config("tensor", "tensor", True),
                "config_groups": {
                    "g": {"targets": ["Linear"], "weights": {"type": "int", "num_bits": 4}}
                },
            },
            "weights int 4-bit is not implemented",
        ),
    ],
)
def test_checkpoint_schemes_not_implemented_are_named(stored: dict, message: str) -> None:
    class HF:
        quantization_config = stored

    with pytest.raises(ConfigError, match=message):
        resolve_quant_config("auto", HF(), CPU, check_device=False)


def test_quantization_flag_must_match_the_checkpoint() -> None:
    class HF:
        quantization_config: ClassVar[dict[str, Any]] = {"quant_method": "fp8"}

    with pytest.raises(ConfigError, match="does not match the checkpoint"):
        resolve_quant_config("ptpc_fp8", HF(), CPU, check_device=False)


def test_engine_refuses_fp8_on_the_cpu(tiny_model_path) -> None:
    from tandem.engine.llm import LLM

    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        LLM(
            model=str(tiny_model_path("llama")),
            quantization="fp8",
            device="cpu",
            attention_backend="torch",
        )


# ----------------------------------------------------------------------------- FP8 KV cache


def _step(model: Any, kv: list[torch.Tensor], lens: list[int], new: list[int], seed: int):
    """One step: request r computes its last `new[r]` of `lens[r]` tokens (blocks r+1, r+3)."""
    tables = [[1 + r, 3 + r] for r in range(len(lens))]
    md = build_attn_metadata(new, lens, tables, BLOCK_SIZE)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.vocab_size, (sum(new),), generator=gen)
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(lens, new, strict=True)])
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, kv, md))


def test_model_over_an_fp8_kv_cache(tiny_llama, tmp_path: Path) -> None:
    """Prefill then decode through the torch backend with an e4m3 cache (the checkpoint's
    per-layer `k_scale` / `v_scale` loaded into the attention layers): close to the same
    model over an fp32 cache, and the cache holds FP8 values."""
    src, _ = tiny_llama
    folder = tmp_path / "kv_scales"
    folder.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    scales = {
        f"model.layers.{i}.self_attn.{w}_scale": torch.tensor(0.02 * (i + 1) + (w == "v") * 0.01)
        for i in range(2)
        for w in "kv"
    }
    save_file(scales, str(folder / "model-kv-scales.safetensors"))
    model = build_model(folder, context(None))
    attn = model.model.layers[1].self_attn.attn
    assert (attn.k_scale, attn.v_scale) == pytest.approx((0.04, 0.05))
    shape = (6, 2, BLOCK_SIZE, model.num_kv_heads, model.head_size)
    fp8 = [torch.zeros(shape).to(torch.float8_e4m3fn) for _ in range(2)]
    exact = [torch.zeros(shape) for _ in range(2)]
    assert attn.kv_scales(fp8[0]) == (attn.k_scale, attn.v_scale)
    assert attn.kv_scales(exact[0]) == (1.0, 1.0)
    for lens, new, seed in (([20, 7], [20, 7], 5), ([21, 8], [1, 1], 6)):
        got, want = _step(model, fp8, lens, new, seed), _step(model, exact, lens, new, seed)
        assert (got - want).norm() / want.norm() < 0.08
    # The cache holds each K as k / k_scale in e4m3: dequantized, it is the fp32 cache's
    # (layer 0, whose inputs the cache's rounding has not touched).
    first = model.model.layers[0].self_attn.attn
    k8, k32 = fp8[0][1, 0].float() * first.k_scale, exact[0][1, 0]
    assert ((k8 - k32).abs() <= k32.abs() * 2**-4 + first.k_scale * 2**-9).all()
    assert k32.abs().sum() > 0


def test_fp8_kv_cache_dtype_is_refused_where_it_cannot_run() -> None:
    from tandem.worker.model_runner import resolve_kv_cache_dtype

    assert resolve_kv_cache_dtype("auto", torch.bfloat16, CPU, "torch") == torch.bfloat16
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8 needs a CUDA GPU"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, CPU, "torch")
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8_e4m3 needs a CUDA GPU"):
        resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, CPU, "cpu")
    # The optional backends have none, whatever the device: said before the device check.
    for backend, shown in (("FLASHINFER", "FLASHINFER"), ("flash_attn", "FLASH_ATTN")):
        with pytest.raises(ConfigError, match=f"backend {shown} has no FP8 KV cache"):
            resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda"), backend)


# ----------------------------------------------------------------------------- fused input


def _producers(model: torch.nn.Module) -> dict[str, Any]:
    """Each norm / activation of the decoder layers -> its input quantizer (or None)."""
    from tandem.layers.activation import SiluAndMul
    from tandem.layers.norm import RMSNorm

    return {
        name: module.input_quant
        for name, module in model.named_modules()
        if isinstance(module, (RMSNorm, SiluAndMul))
    }


def _fused_inputs(
    model: torch.nn.Module, device: torch.device = CPU
) -> tuple[torch.Tensor, dict[str, str]]:
    """`_logits(model, device)`, and each linear layer's input kind in that forward."""
    from tandem.layers.linear import LinearBase
    from tandem.layers.quantization.input_quant import QuantizedActivation

    kinds: dict[str, str] = {}
    hooks = [
        module.register_forward_pre_hook(
            lambda mod, args, name=name: kinds.__setitem__(
                name, "quantized" if isinstance(args[0], QuantizedActivation) else "plain"
            )
        )
        for name, module in model.named_modules()
        if isinstance(module, LinearBase)
    ]
    try:
        return _logits(model, device), kinds
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("kind", ["fp8", "ptpc_fp8", "ct_static", "fp8_block16"])
def test_norm_and_activation_hand_fp8_linears_quantized_input(
    kind: str, tiny_llama, tmp_path: Path
) -> None:
    """The norm before qkv / gate_up and the activation before down write the FP8 input the
    linear's scheme wants (per tensor, per token, the checkpoint's static scale), and the
    logits are those of the same model with every linear quantizing its own input, bit for
    bit; block-scaled (weight-only) linears take plain input; the final norm (before the
    unquantized LM head) stays plain."""
    src, _ = tiny_llama
    if kind in ("fp8", "ptpc_fp8"):
        model = build_model(src, context(Fp8Config() if kind == "fp8" else PtpcFp8Config()))
    else:
        folder = _write_fp8_checkpoint(src, tmp_path / kind, kind)
        quant = resolve_quant_config("auto", _hf(folder), CPU, check_device=False)
        model = build_model(folder, context(quant))
    producers = _producers(model)
    fused, kinds = _fused_inputs(model)
    weight_only = kind == "fp8_block16"
    for layer in range(2):
        p = f"model.layers.{layer}."
        for name in ("input_layernorm", "post_attention_layernorm", "mlp.act_fn"):
            assert (producers[p + name] is None) == weight_only, (kind, name)
        for name in ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            assert kinds[p + name] == ("plain" if weight_only else "quantized"), (kind, name)
        assert kinds[p + "self_attn.o_proj"] == "plain"
    assert producers["model.norm"] is None
    if kind == "ct_static":
        strategies = {q.strategy for q in producers.values() if q is not None}
        assert strategies == {"static"}
    for name in producers:  # the same model, each linear quantizing its own input
        model.get_submodule(name).input_quant = None
    unfused, kinds = _fused_inputs(model)
    assert set(kinds.values()) == {"plain"}
    torch.testing.assert_close(fused, unfused, atol=0, rtol=0)


def test_unquantized_models_keep_plain_inputs(tiny_model_path) -> None:
    """No quantizer on any norm or activation of an unquantized dense or MoE model, nor on
    an MoE block's norm in an FP8 one (its experts are not FP8 linears)."""
    for arch in ("llama", "qwen3_moe"):
        model = build_model(tiny_model_path(arch), context(None))
        assert set(_producers(model).values()) == {None}, arch
    # The router (8 experts: no multiple of 16) stays unquantized without being named.
    moe = build_model(tiny_model_path("qwen3_moe"), context(PtpcFp8Config()))
    assert type(moe.model.layers[0].mlp.gate.quant_method).__name__ == "UnquantizedLinearMethod"
    producers = _producers(moe)
    assert producers["model.layers.0.input_layernorm"] is not None
    assert producers["model.layers.0.post_attention_layernorm"] is None


def test_row_parallel_input_split_here_stays_plain() -> None:
    """A row-parallel FP8 layer takes a quantized input only when it is already this rank's
    columns (`input_is_parallel`); one that splits a whole input takes it plain. Each rank's
    per-token scales come from its own columns, as its own quantization would."""
    from tandem.layers.activation import SiluAndMul
    from tandem.layers.quantization.input_quant import input_quantizer

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(32, 64, generator=gen) * 0.1
    x = torch.randn(3, 128, generator=gen)
    quant = PtpcFp8Config()
    for rank in range(2):
        split_here = RowParallelLinear(
            64, 32, False, context(quant, rank, 2), input_is_parallel=False, prefix="down"
        )
        assert split_here.splits_input and input_quantizer(split_here) is None
        down = RowParallelLinear(
            64, 32, False, context(quant, rank, 2), reduce_results=False, prefix="down"
        )
        _load_linear(down, [(w, None)])
        act = SiluAndMul(quant_consumer=down)
        assert act.input_quant is not None
        part = torch.cat([c.chunk(2, dim=1)[rank] for c in x.chunk(2, dim=1)], dim=1)
        quantized = act(part)
        assert quantized.scale.shape == (3, 1)
        assert torch.equal(down(quantized), down(SiluAndMul()(part)))


def test_activation_hands_a_gating_consumer_its_input_ungated() -> None:
    """SiLU-and-mul hands its input untouched (`GatedActivation`) where the consumer asks for
    it (`takes_gated`, asked first), and runs as before where not; an FP8 consumer asks only
    on CUDA (its W8A16 GEMM computes the activation as it reads; tests/gpu)."""
    from tandem.layers.activation import SiluAndMul, silu_and_mul
    from tandem.layers.quantization.input_quant import ActivationQuantizer, GatedActivation

    class Gating(ActivationQuantizer):
        def __init__(self, gated: bool) -> None:
            self.gated = gated

        def takes_gated(self, gate_up: torch.Tensor) -> bool:
            return self.gated

        def takes_quantized(self, x: torch.Tensor) -> bool:
            return False

        def rms_norm(self, x, residual, weight, eps):  # type: ignore[no-untyped-def]
            raise AssertionError("not a norm's consumer")

        def silu_and_mul(self, x):  # type: ignore[no-untyped-def]
            raise AssertionError("never asked for quantized input")

    x = torch.randn(3, 16)
    act = SiluAndMul()
    act.input_quant = Gating(True)
    out = act(x)
    assert isinstance(out, GatedActivation) and out.gate_up is x
    assert out.shape == (3, 8) and out.dtype == x.dtype
    act.input_quant = Gating(False)
    assert torch.equal(act(x), silu_and_mul(x))
    down = RowParallelLinear(64, 32, False, context(PtpcFp8Config()), prefix="down")
    _load_linear(down, [(torch.randn(32, 64) * 0.1, None)])
    fp8_act = SiluAndMul(quant_consumer=down)
    assert not fp8_act.input_quant.takes_gated(torch.randn(1, 128))  # CPU: no W8A16
    assert not isinstance(fp8_act(torch.randn(1, 128)), GatedActivation)
