"""FP8 (e4m3) linear layers: weights in float8 with scales, activations quantized on the fly,
the product through `torch._scaled_mm` (tandem_kernels.fp8).

Two ways in, one method:

- quantized at load (`--quantization fp8` / `ptpc_fp8` on a bf16 or fp32 checkpoint): the
  layer is created with a `weight` in the model's dtype, loaded as usual, and
  `process_weights_after_loading` replaces it with float8 plus its scale;
- loaded as stored (a checkpoint whose `quantization_config` is `fp8` or compressed-tensors
  float-quantized): the layer is created with float8 `weight` and the scale parameters under
  the checkpoint's names, each with a `weight_loader`, so `load_weights` needs no change.

Schemes (`Fp8Config` fields, named as vLLM and compressed-tensors name them):

    weight_strategy     tensor   weight_scale []        (a fused layer's parts requantized to
                                                          the largest part scale after loading)
                        channel  weight_scale [N, 1]    (shards with the weight: output_dim 0)
                        block    weight_scale_inv, one per bn x bk tile (`weight_block_size`)
    activation_scheme   dynamic  scale from each step's activations: per tensor, or per token
                                 (`activation_strategy` token, with channel weights: "PTPC")
                        static   the checkpoint's `input_scale` (per tensor)

The norm or activation before a linear (RMSNorm before qkv / gate_up, SiLU-and-mul before down)
writes the e4m3 input with its scale in its own kernel when the method asks for it
(`input_quantizer`, fp8_input.py): `apply` then takes that `QuantizedActivation` as is.

Block-scaled checkpoints run as weight-only FP8 (W8A16): the weight stays e4m3 with its tile
scales, and a Triton GEMM (tandem_kernels.fp8_block_gemm) widens each tile in registers and
scales its products; its torch reference (dequantize, then matmul) on the CPU. Their MoE experts
load as stored the same way (`Fp8MoEMethod`: the fused MoE kernel's block form). The LM head and
embeddings stay in the model's dtype (as vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from tandem.config import ConfigError
from tandem.layers.quantization.base import (
    ExpertsMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    is_ignored_layer,
    register_quantization_config,
    set_weight_attrs,
)
from tandem.layers.quantization.input_quant import (
    ActivationQuantizer,
    GatedActivation,
    QuantizedActivation,
)
from tandem.layers.weight_utils import LoadedWeight, full_weight

WeightStrategy = Literal["tensor", "channel", "block"]
ActivationStrategy = Literal["tensor", "token"]


# `torch._scaled_mm` with e4m3 runs on compute capability 8.9 (Ada) and above.
def _fp8_ops() -> Any:
    """tandem_kernels.fp8, imported when first used: its module loads Triton, which a CPU
    image does not have (the FP8 methods never run there, but this module is imported)."""
    from tandem_kernels import fp8

    return fp8


MIN_CAPABILITY = (8, 9)


def _w8a16() -> Any:
    """tandem_kernels.fp8_w8a16, imported where it runs (it needs Triton)."""
    from tandem_kernels import fp8_w8a16

    return fp8_w8a16


def check_fp8_device(
    device: torch.device,
    what: str,
    capability: tuple[int, int] | None = None,
    name: str | None = None,
) -> None:
    """ConfigError unless `device` can run FP8 (a CUDA GPU of compute capability >= 8.9).
    `capability` / `name`: the GPU's, when the caller knows them (else asked of CUDA)."""
    if device.type != "cuda":
        raise ConfigError(f"{what} needs a CUDA GPU of compute capability >= 8.9, not {device}")
    capability = capability or torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = name or torch.cuda.get_device_name(device)
        raise ConfigError(
            f"{what} needs compute capability >= 8.9; {name} has {capability[0]}.{capability[1]}"
        )


@dataclass(frozen=True)
class Fp8Scheme:
    """How one layer's weights and activations are quantized (see the module docstring)."""

    is_checkpoint_fp8_serialized: bool = False
    weight_strategy: WeightStrategy = "tensor"
    activation_scheme: Literal["dynamic", "static"] = "dynamic"
    activation_strategy: ActivationStrategy = "tensor"
    weight_block_size: tuple[int, int] | None = None
    # FBGEMM's `activation_scale_ub`: each token's amax capped at it before its dynamic scale
    # (per-token activations only).
    activation_scale_ub: float | None = None

    def __post_init__(self) -> None:
        if (self.weight_strategy == "block") != (self.weight_block_size is not None):
            raise ConfigError("an FP8 block scheme needs weight_block_size [bn, bk], and only it")
        if self.activation_strategy == "token" and self.weight_strategy != "channel":
            raise ConfigError("per-token FP8 activations need per-channel weights")
        if self.activation_scheme == "static" and self.activation_strategy != "tensor":
            raise ConfigError("static FP8 activation scales are per tensor")
        if self.activation_scheme == "static" and not self.is_checkpoint_fp8_serialized:
            raise ConfigError("static FP8 activation scales come from an FP8 checkpoint")
        if self.activation_scale_ub is not None and (
            self.activation_scheme != "dynamic" or self.activation_strategy != "token"
        ):
            raise ConfigError("an FP8 activation scale bound needs dynamic per-token scales")


@register_quantization_config
class Fp8Config(QuantizationConfig):
    """`--quantization fp8`: per-tensor weights and dynamic per-tensor activations quantized at
    load, or an HF checkpoint's `{"quant_method": "fp8", "activation_scheme": ...,
    "weight_block_size": [128, 128]}` loaded as stored."""

    name = "fp8"

    def __init__(self, scheme: Fp8Scheme | None = None, ignored_layers: tuple[str, ...] = ()):
        self.scheme = scheme if scheme is not None else Fp8Scheme()
        self.ignored_layers = tuple(ignored_layers)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        activation_scheme = config.get("activation_scheme", "dynamic")
        if activation_scheme not in ("dynamic", "static"):
            raise ConfigError(f"FP8 checkpoint: activation_scheme {activation_scheme!r}")
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ConfigError(f"FP8 checkpoint: fmt {fmt!r} is not implemented (e4m3)")
        block = config.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or min(block) < 1:
                raise ConfigError(f"FP8 checkpoint: weight_block_size {block!r} is not [bn, bk]")
            block = (int(block[0]), int(block[1]))
        scheme = Fp8Scheme(
            is_checkpoint_fp8_serialized=True,
            weight_strategy="block" if block else "tensor",
            activation_scheme=activation_scheme,
            weight_block_size=block,
        )
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or ()
        return cls(scheme, tuple(ignored))

    def is_ignored(self, prefix: str) -> bool:
        """Whether the checkpoint leaves layer `prefix` unquantized (a fused layer counts as
        ignored when its first part is: `q_proj` for `qkv_proj`)."""
        return is_ignored_layer(prefix, self.ignored_layers)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from tandem.layers.linear import LinearBase

        if not isinstance(layer, LinearBase) or self.is_ignored(prefix):
            return None  # the LM head, embeddings and ignored layers stay unquantized
        return Fp8LinearMethod(self.scheme)

    def get_experts_method(self, layer: nn.Module, prefix: str) -> ExpertsMethodBase | None:
        """`Fp8MoEMethod`, whatever the scheme of the linear layers: experts quantized at
        load with a scale per expert and row, or loaded as stored from a per-tensor,
        per-channel or block-scaled checkpoint with dynamic activations; a stored static
        scheme is refused, naming the layer."""
        if self.is_ignored(prefix):
            return None
        scheme = self.scheme
        if scheme.activation_scale_ub is not None:
            raise ConfigError(
                f"{prefix or 'a mixture-of-experts layer'}: FP8 experts with an activation "
                "scale bound (fbgemm_fp8) are not implemented"
            )
        if not scheme.is_checkpoint_fp8_serialized:
            return Fp8MoEMethod()
        if scheme.activation_scheme == "static":
            raise ConfigError(
                f"{prefix or 'a mixture-of-experts layer'}: static FP8 activation scales for "
                "experts are not implemented (dynamic ones are)"
            )
        block = scheme.weight_block_size if scheme.weight_strategy == "block" else None
        return Fp8MoEMethod(stored=True, weight_block_size=block)

    def verify_device(self, device: torch.device) -> None:
        check_fp8_device(device, f"--quantization {self.name}")


@register_quantization_config
class PtpcFp8Config(Fp8Config):
    """`--quantization ptpc_fp8` (vLLM's name): per-channel weights quantized at load and
    dynamic per-token activation scales."""

    name = "ptpc_fp8"

    def __init__(self, scheme: Fp8Scheme | None = None, ignored_layers: tuple[str, ...] = ()):
        scheme = scheme or Fp8Scheme(weight_strategy="channel", activation_strategy="token")
        super().__init__(scheme, ignored_layers)


def _part_index(layer: nn.Module, shard_id: Any) -> int | None:
    """The fused part a checkpoint tensor fills (None: all of them, a fused tensor)."""
    if shard_id is None:
        return 0 if len(layer.output_partition_sizes) == 1 else None
    if isinstance(shard_id, str):
        return ("q", "k", "v").index(shard_id)
    return int(shard_id)


def _part_full_rows(layer: nn.Module, shard_id: Any) -> int:
    """Rows of the checkpoint tensor of part `shard_id` (all ranks' rows)."""
    if shard_id is None:
        return layer.output_size
    if isinstance(shard_id, str):  # QKVParallelLinear
        heads = layer.total_num_heads if shard_id == "q" else layer.total_num_kv_heads
        return heads * layer.head_size
    return layer.output_sizes[int(shard_id)]


class Fp8LinearMethod(LinearMethodBase):
    """One linear layer in FP8 under `scheme`. After `process_weights_after_loading` the layer
    holds `weight` float8 `[N, K]` and `weight_scale` (float32, `[]` or `[N, 1]`), plus
    `input_scale` `[]` for static activations; a block scheme holds `weight_scale_inv`
    `[N, ceil(K/bk)]` instead (each tile's scale repeated over its rows)."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        *,
        device: torch.device | None = None,
        **extra_weight_attrs: Any,
    ) -> None:
        scheme = self.scheme
        rows, cols = sum(output_partition_sizes), input_size_per_partition
        layer.fp8_scheme = scheme
        # Split-K W8A16 calls' lock buffer (fp8_w8a16.w8a16_locks), made after loading on CUDA.
        layer.w8a16_locks = None
        if scheme.weight_strategy != "block" and (rows % 16 or cols % 16):
            raise ConfigError(
                f"{layer.prefix}: FP8 GEMMs need both dims multiples of 16, this rank's "
                f"weight is [{rows}, {cols}]"
            )
        dtype = _fp8_ops().FP8_DTYPE if scheme.is_checkpoint_fp8_serialized else params_dtype
        loader = extra_weight_attrs["weight_loader"]
        weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device), False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)
        if not scheme.is_checkpoint_fp8_serialized:
            return

        def f32(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=torch.float32, device=device), False)

        def load_part_scale(param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None):
            index = _part_index(layer, shard_id)
            value = full_weight(loaded).to(torch.float32).reshape(-1)
            if value.numel() != 1:
                raise ValueError(f"{layer.prefix}: a per-tensor scale has {value.numel()} values")
            if index is None:
                param.data.fill_(value.item())
            else:
                param.data[index] = value[0]

        parts = len(output_partition_sizes)
        if scheme.weight_strategy == "tensor":
            scale = f32(parts)
            set_weight_attrs(scale, {"weight_loader": load_part_scale})
            layer.register_parameter("weight_scale", scale)
        elif scheme.weight_strategy == "channel":
            scale = f32(rows, 1)
            set_weight_attrs(scale, {"output_dim": 0, **extra_weight_attrs})
            layer.register_parameter("weight_scale", scale)
        else:
            bn, bk = scheme.weight_block_size  # type: ignore[misc]
            if layer.tp_size > 1 and (
                any(size % bn for size in output_partition_sizes) or cols % bk
            ):
                raise ConfigError(
                    f"{layer.prefix}: FP8 block scales [{bn}, {bk}] do not divide this rank's "
                    f"weight {output_partition_sizes} x {cols} under tensor parallel"
                )

            def load_block_scale(param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None):
                # Repeat each tile row over its rows, so the layer's own loader shards the
                # scale exactly as it shards the weight (QKV replicas included).
                tiles = full_weight(loaded).to(torch.float32)
                full_rows = _part_full_rows(layer, shard_id)
                if tiles.dim() != 2 or tiles.shape[0] != -(-full_rows // bn):
                    raise ValueError(
                        f"{layer.prefix}: block scale shape {tuple(tiles.shape)} does not "
                        f"tile {full_rows} rows by {bn}"
                    )
                loader(param, tiles.repeat_interleave(bn, 0)[:full_rows], shard_id)

            scale = f32(rows, -(-cols // bk))
            set_weight_attrs(scale, {"output_dim": 0, "input_dim": 1})
            set_weight_attrs(scale, {"weight_loader": load_block_scale})
            layer.register_parameter("weight_scale_inv", scale)
        if scheme.activation_scheme == "static":
            input_scale = f32(parts)
            set_weight_attrs(input_scale, {"weight_loader": load_part_scale})
            layer.register_parameter("input_scale", input_scale)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scheme = self.scheme
        weight = layer.weight.data
        if scheme.weight_strategy == "block":
            block = scheme.weight_block_size
            if not scheme.is_checkpoint_fp8_serialized:
                q, tiles = _fp8_ops().quantize_per_block(weight, block)  # type: ignore[arg-type]
                scale = tiles.repeat_interleave(block[0], 0)[: weight.shape[0]]  # type: ignore[index]
            else:
                q, scale = weight, layer.weight_scale_inv.data
            _replace(layer, "weight", q)
            _replace(layer, "weight_scale_inv", scale)
            return
        if not scheme.is_checkpoint_fp8_serialized:
            if scheme.weight_strategy == "tensor":
                q, scale = _fp8_ops().quantize_per_tensor(weight)
            else:
                q, scale = _fp8_ops().quantize_per_row(weight)
        elif scheme.weight_strategy == "tensor":
            q, scale = _requantize_to_max(weight, layer.weight_scale.data, layer)
        else:
            q, scale = weight, layer.weight_scale.data
        _replace(layer, "weight", q.contiguous())
        _replace(layer, "weight_scale", scale.to(torch.float32))
        if scheme.activation_scheme == "static":
            _replace(layer, "input_scale", layer.input_scale.data.max())
        if layer.weight.is_cuda:
            layer.w8a16_locks = _w8a16().w8a16_locks(layer.weight.shape[0], layer.weight.device)
            # Small batches: weight-only FP8 where it beats this scheme's own path, measured.
            _w8a16().tune_w8a16(
                layer.weight.data,
                layer.weight_scale.data,
                layer.params_dtype,
                self._baseline_name,
                lambda x, w: self._scaled(layer, x, None, x.dtype, w),
                gated_input=getattr(layer, "gated_input", False),
            )

    @property
    def _baseline_name(self) -> str:
        s = self.scheme
        return f"{s.activation_scheme}/{s.activation_strategy}/{s.weight_strategy}"

    def w8a16_config(self, layer: nn.Module, x: torch.Tensor) -> tuple[int, ...] | None:
        """The W8A16 GEMM's config where it serves `x`'s batch on CUDA (measured at load), else
        None: this scheme's own path (activation quantization + scaled GEMM)."""
        if not x.is_cuda or self.scheme.weight_strategy == "block":
            return None
        n, k = layer.weight.shape
        return _w8a16().choose(x.shape[0], n, k, x.dtype, self._baseline_name)

    def input_quantizer(self, layer: nn.Module) -> ActivationQuantizer | None:
        """e4m3 input with this scheme's activation scale, from the op before (fp8_input.py);
        None for the weight-only block scheme (bf16 input) and for a bounded activation
        scale (the fused producers do not cap the amax: this layer quantizes its input)."""
        if self.scheme.weight_strategy == "block" or self.scheme.activation_scale_ub is not None:
            return None
        from tandem.layers.quantization.fp8_input import Fp8ActivationQuantizer

        return Fp8ActivationQuantizer(layer, self.scheme)

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor | QuantizedActivation | GatedActivation,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        scheme = self.scheme
        if isinstance(x, QuantizedActivation):  # quantized by the op before (input_quantizer)
            assert scheme.weight_strategy != "block" and x.data.dim() == 2, x.shape
            return fp8_linear(x.data, layer.weight, x.scale, layer.weight_scale, bias, x.dtype)
        if isinstance(x, GatedActivation):  # SiLU-and-mul left to the W8A16 GEMM (takes_gated)
            config = self.w8a16_config(layer, x.gate_up)
            assert config is not None, "a gated input only where the W8A16 GEMM serves it"
            out = _w8a16().w8a16_gemm(
                x.gate_up, layer.weight, layer.weight_scale, config, layer.w8a16_locks, gated=True
            )
            return out if bias is None else out + bias
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if scheme.weight_strategy == "block":  # weight-only
            bk = scheme.weight_block_size[1]  # type: ignore[index]
            from tandem_kernels.fp8_block_gemm import fp8_block_gemm, fp8_block_gemm_ref

            gemm = fp8_block_gemm if x2.is_cuda else fp8_block_gemm_ref
            out = gemm(x2, layer.weight, layer.weight_scale_inv, bk)
            if bias is not None:
                out = out + bias
            return out.reshape(*shape[:-1], out.shape[-1])
        config = self.w8a16_config(layer, x2)
        if config is not None:
            out = _w8a16().w8a16_gemm(
                x2, layer.weight, layer.weight_scale, config, layer.w8a16_locks
            )
            if bias is not None:
                out = out + bias
            return out.reshape(*shape[:-1], out.shape[-1])
        out = self._scaled(layer, x2, bias, x.dtype)
        return out.reshape(*shape[:-1], out.shape[-1])

    def _scaled(
        self,
        layer: nn.Module,
        x2: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
        weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Activations quantized (one Triton kernel per token scale, two per tensor scale, on
        CUDA; the torch references elsewhere), then the scaled GEMM (with `weight` in place of
        the layer's: a copy, when tuning times it)."""
        scheme = self.scheme
        if scheme.activation_scheme == "static":
            xq, x_scale = _fp8_ops().quantize_per_tensor(x2, layer.input_scale)
        elif scheme.activation_strategy == "token":
            quant = (
                _fp8_ops().dynamic_quant_per_token if x2.is_cuda else _fp8_ops().quantize_per_row
            )
            xq, x_scale = quant(x2, scheme.activation_scale_ub)
        else:
            quant = (
                _fp8_ops().dynamic_quant_per_tensor
                if x2.is_cuda
                else _fp8_ops().quantize_per_tensor
            )
            xq, x_scale = quant(x2)
        weight = layer.weight if weight is None else weight
        return fp8_linear(xq, weight, x_scale, layer.weight_scale, bias, out_dtype)


def fp8_linear(
    xq: torch.Tensor,
    wq: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The scaled GEMM on CUDA, its dequantize-then-matmul reference elsewhere. Rowwise scales
    produce bf16 (cuBLASLt's rule), cast to `out_dtype`; their bias is added after."""
    rowwise = w_scale.numel() > 1 or x_scale.numel() > 1
    if rowwise and w_scale.numel() == 1:
        w_scale = w_scale.reshape(1, 1).expand(wq.shape[0], 1).contiguous()
    if rowwise and x_scale.numel() == 1:
        x_scale = x_scale.reshape(1, 1).expand(xq.shape[0], 1).contiguous()
    if not xq.is_cuda:
        return _fp8_ops().fp8_scaled_mm_ref(xq, wq, x_scale, w_scale, bias, out_dtype)
    if xq.shape[0] == 0:
        return torch.empty(0, wq.shape[0], dtype=out_dtype, device=xq.device)
    if not rowwise:
        return _fp8_ops().fp8_scaled_mm(xq, wq, x_scale, w_scale, bias, out_dtype)
    out = _fp8_ops().fp8_scaled_mm(xq, wq, x_scale, w_scale, None, torch.bfloat16)
    if bias is not None:
        out = out + bias
    return out.to(out_dtype)


def _requantize_to_max(
    weight: torch.Tensor, part_scales: torch.Tensor, layer: nn.Module
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused layer's parts, each stored with its own per-tensor scale, requantized to one
    scale (the largest), so one GEMM serves them all."""
    top = part_scales.max()
    if bool((part_scales == top).all()):
        return weight, top
    out = torch.empty_like(weight)
    start = 0
    for size, scale in zip(layer.output_partition_sizes, part_scales, strict=True):
        part = weight[start : start + size]
        out[start : start + size] = _fp8_ops().quantize_fp8(_fp8_ops().dequantize(part, scale), top)
        start += size
    return out, top


class Fp8MoEMethod(ExpertsMethodBase):
    """A mixture-of-experts layer's experts in FP8: after loading, `w13_weight` and
    `w2_weight` are e4m3 with a float32 scale per expert and output row (`w13_scale`
    `[E, 2I]`, `w2_scale` `[E, H]`); the fused kernel widens the weight tiles and scales its
    row sums (or, where it times faster, quantizes its inputs per token: W8A8). Half the
    bytes of bf16 experts to hold and, at decode sizes, to read.

    Quantized at load (`stored` False): one expert at a time (one expert's float32 copy at
    most). Loaded as stored (`stored`, a per-tensor or per-channel FP8 checkpoint): the
    weights are made e4m3 before loading and each projection's `weight_scale` fills
    `w13_weight_scale` / `w2_weight_scale` a row each (`FusedMoE.scale_loader`: a per-tensor
    scale on every row of its projection), which become the kernel's scales.

    Block-scaled checkpoint (`weight_block_size` `(bn, bk)`, HF's `fp8` with dynamic
    activations): each projection's `weight_scale_inv` `[ceil(rows / bn), ceil(cols / bk)]`
    fills `w13_weight_scale_inv` / `w2_weight_scale_inv` as stored (`layer.weight_block_size`
    set), and the kernel applies each tile's scale at its K steps (weight-only, or, where it
    times faster, with activations quantized per token and bk columns: W8A8):

        w13_scale [E, 2 * I_part / bn, ceil(H / bk)]   gate's tile rows, then up's
        w2_scale  [E, ceil(H / bn), ceil(I_part / bk)]

    A rank's slice must stay whole tiles, else a ConfigError naming the layer: I_part (gate
    and up rows each; I over the TP ranks) a multiple of bn, so that the two stack without a
    tile astride them, and under TP > 1 a multiple of bk (down's columns); bk a multiple of
    16 (the kernel's K steps). Expert parallel keeps experts whole."""

    def __init__(
        self, stored: bool = False, weight_block_size: tuple[int, int] | None = None
    ) -> None:
        if weight_block_size is not None and not stored:
            raise ValueError("block-scaled FP8 experts are loaded as stored, not quantized")
        self.stored = stored
        self.weight_block_size = weight_block_size

    def create_weights(self, layer: nn.Module) -> None:
        if not self.stored:
            return
        scale_shapes = {"w13": layer.w13_weight.shape[:2], "w2": layer.w2_weight.shape[:2]}
        suffix = "weight_scale"
        if self.weight_block_size is not None:
            scale_shapes = self._block_scale_shapes(layer, self.weight_block_size)
            layer.weight_block_size = self.weight_block_size
            suffix = "weight_scale_inv"
        for name in ("w13", "w2"):
            made = getattr(layer, f"{name}_weight")
            attrs = {"weight_loader": made.weight_loader, "required_shards": made.required_shards}
            weight = nn.Parameter(
                torch.empty(made.shape, dtype=torch.float8_e4m3fn, device=made.device),
                requires_grad=False,
            )
            set_weight_attrs(weight, attrs)
            setattr(layer, f"{name}_weight", weight)
            scale = nn.Parameter(
                torch.empty(scale_shapes[name], dtype=torch.float32, device=made.device),
                requires_grad=False,
            )
            set_weight_attrs(scale, {**attrs, "weight_loader": layer.scale_loader})
            layer.register_parameter(f"{name}_{suffix}", scale)

    @staticmethod
    def _block_scale_shapes(layer: nn.Module, block: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        """This rank's block scale shapes (see the class docstring), after checking that its
        slice of the experts is whole tiles."""
        bn, bk = block
        inter, hidden, tp = layer.intermediate_per_rank, layer.hidden_size, layer.tp_size
        what = f"{layer.prefix or 'FusedMoE'}: FP8 block scales [{bn}, {bk}]"
        split = f" (moe intermediate size {layer.intermediate_size} over {tp} TP ranks)"
        if inter % bn:
            raise ConfigError(
                f"{what} do not divide this rank's experts: gate and up have {inter} rows "
                f"each{split}, not whole tiles of {bn} rows"
            )
        if tp > 1 and inter % bk:
            raise ConfigError(
                f"{what} do not divide this rank's experts: down has {inter} columns{split}, "
                f"not whole tiles of {bk} columns"
            )
        if bk % 16:
            raise ConfigError(f"{what}: the fused MoE kernel needs bk a multiple of 16")
        experts = layer.num_local_experts
        return {
            "w13": (experts, 2 * inter // bn, -(-hidden // bk)),
            "w2": (experts, -(-hidden // bn), -(-inter // bk)),
        }

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.stored:
            suffix = "weight_scale" if self.weight_block_size is None else "weight_scale_inv"
            for name in ("w13", "w2"):
                setattr(layer, f"{name}_scale", getattr(layer, f"{name}_{suffix}").data)
                delattr(layer, f"{name}_{suffix}")
            return

        for name in ("w13", "w2"):
            weight = getattr(layer, f"{name}_weight").data
            q = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
            scale = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
            for e in range(weight.shape[0]):
                q[e : e + 1], scale[e : e + 1] = _fp8_ops().quantize_expert_rows(weight[e : e + 1])
            _replace(layer, f"{name}_weight", q)
            setattr(layer, f"{name}_scale", scale)


def _replace(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    """Re-register parameter `name` of `layer` as `value` (its loading attributes dropped)."""
    if hasattr(layer, name):
        delattr(layer, name)
    layer.register_parameter(name, nn.Parameter(value, requires_grad=False))
