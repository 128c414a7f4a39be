"""NVIDIA ModelOpt FP8 checkpoints (what TensorRT-LLM users export), loaded as stored.

Two layouts name the scheme: a `hf_quant_config.json` beside the config,
`{"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules":
[...]}}` (read into the config by `tandem.loader.hf_folder.load_hf_config` as
`quantization_config: {"quant_method": "modelopt", ...}`), or the config's own
`quantization_config: {"quant_method": "modelopt", "quant_algo": ..., "kv_cache_scheme":
{...}, "ignore": [...]}`. Each `quant_algo` is one of `Fp8Scheme`'s, run by `Fp8LinearMethod`:

    FP8                         weight_scale []           per tensor, with the static
                                input_scale []            activation scale
    FP8_PER_CHANNEL_PER_TOKEN   weight_scale [N]          per channel, dynamic per-token
                                                          activations (as ptpc_fp8)
    FP8_PB_WO                   weight_scale              128 x 128 tiles, weight-only
                                [N/128, 1, K/128, 1]      (as the `fp8` block checkpoints)

The checkpoint's own shapes and names are mapped to the layers' as the tensors stream in
(`map_checkpoint`): a channel scale `[N]` becomes `[N, 1]`; a tile scale becomes the block
scheme's `weight_scale_inv` `[N/128, K/128]`. The FP8 KV cache's scales are stored as
`self_attn.k_proj.k_scale` / `v_proj.v_scale` (tandem.models.utils.kv_scale_target).
`exclude_modules` / `ignore` entries are module names or wildcards (`model.layers.0.*`).
Any other algorithm (NVFP4, MXFP8, mixed precision) is refused by name at start.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from tandem.config import ConfigError
from tandem.layers.quantization.base import register_quantization_config
from tandem.layers.quantization.fp8 import Fp8Config, Fp8Scheme
from tandem.layers.weight_utils import LoadedWeight, full_weight

# ModelOpt's tile for FP8_PB_WO (its exports use 128 x 128; the scale's shape does not say).
PB_WO_BLOCK = (128, 128)

_SCHEMES = {
    "FP8": Fp8Scheme(
        is_checkpoint_fp8_serialized=True, weight_strategy="tensor", activation_scheme="static"
    ),
    "FP8_PER_CHANNEL_PER_TOKEN": Fp8Scheme(
        is_checkpoint_fp8_serialized=True, weight_strategy="channel", activation_strategy="token"
    ),
    "FP8_PB_WO": Fp8Scheme(
        is_checkpoint_fp8_serialized=True, weight_strategy="block", weight_block_size=PB_WO_BLOCK
    ),
}


@register_quantization_config
class ModelOptFp8Config(Fp8Config):
    """ModelOpt's FP8 algorithms (see the module docstring), run by `Fp8LinearMethod`."""

    name = "modelopt"
    quantizes_at_load = False

    def __init__(
        self,
        scheme: Fp8Scheme | None = None,
        ignored_layers: tuple[str, ...] = (),
        quant_algo: str = "FP8",
    ) -> None:
        super().__init__(scheme if scheme is not None else _SCHEMES[quant_algo], ignored_layers)
        self.quant_algo = quant_algo

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelOptFp8Config:
        nested = config.get("quantization")
        if isinstance(nested, dict):  # hf_quant_config.json's layout
            algo = nested.get("quant_algo")
            kv_algo = nested.get("kv_cache_quant_algo")
            excluded = nested.get("exclude_modules") or []
        else:  # the config's own quantization_config
            algo = config.get("quant_algo")
            kv_scheme = config.get("kv_cache_scheme")
            kv_algo = None
            if isinstance(kv_scheme, dict):
                is_fp8 = kv_scheme.get("type") == "float" and kv_scheme.get("num_bits") == 8
                kv_algo = "FP8" if is_fp8 else repr(kv_scheme)
            excluded = config.get("ignore") or config.get("exclude_modules") or []
        if not algo:
            raise ConfigError("ModelOpt checkpoint: no quant_algo in its quantization config")
        algo = str(algo).upper()
        if algo not in _SCHEMES:
            raise ConfigError(
                f"ModelOpt quant_algo {algo!r} is not implemented ({', '.join(_SCHEMES)})"
            )
        if kv_algo is not None and str(kv_algo).upper() != "FP8":
            raise ConfigError(f"ModelOpt kv_cache_quant_algo {kv_algo!r} is not implemented (FP8)")
        if not isinstance(excluded, list):
            raise ConfigError(f"ModelOpt exclude_modules must be a list, got {excluded!r}")
        return cls(_SCHEMES[algo], tuple(excluded), algo)

    def map_checkpoint(
        self, weights: Iterable[tuple[str, LoadedWeight]]
    ) -> Iterator[tuple[str, LoadedWeight]]:
        """The stored weight scales in the layers' shapes and names: per channel `[N]` to
        `[N, 1]`; 128 x 128 tiles `[N/128, 1, K/128, 1]` (or `[N/128, K/128]`) to
        `weight_scale_inv`. Everything else as stored."""
        strategy = self.scheme.weight_strategy
        for name, tensor in weights:
            if not name.endswith(".weight_scale") or strategy == "tensor":
                yield name, tensor
                continue
            scale = full_weight(tensor)
            if strategy == "channel":
                yield name, scale.reshape(-1, 1)
            else:
                if scale.dim() == 4:
                    scale = scale[:, 0, :, 0]
                yield name[: -len("weight_scale")] + "weight_scale_inv", scale
