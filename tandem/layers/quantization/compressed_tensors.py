"""compressed-tensors checkpoints (llm-compressor's format), the float-quantized FP8 schemes:
`quantization_config: {"quant_method": "compressed-tensors", "format": "float-quantized",
"config_groups": {...: {"targets": ["Linear"], "weights": {...}, "input_activations": {...}}},
"ignore": ["lm_head"]}`. Weights 8-bit float, per tensor or per channel (`weight_scale`);
activations 8-bit float, dynamic per tensor or per token, or static per tensor
(`input_scale`). The "pack-quantized" integer weight-only groups (W4A16, W8A16) are
int_weight_only.CompressedTensorsIntConfig's (kept quantized on CUDA, dequantized at load on
the CPU). Any other scheme is refused by name (ConfigError) when the engine starts.
"""

from __future__ import annotations

from typing import Any

from tandem.config import ConfigError
from tandem.layers.quantization.base import register_quantization_config
from tandem.layers.quantization.fp8 import Fp8Config, Fp8Scheme
from tandem.layers.quantization.int_weight_only import CompressedTensorsIntConfig

_FORMATS = ("float-quantized", "naive-quantized", "pack-quantized")


def _fp8_args(group: str, kind: str, args: dict[str, Any] | None) -> dict[str, Any]:
    """One `weights` / `input_activations` entry, checked to be 8-bit float, symmetric."""
    if args is None:
        raise ConfigError(
            f"compressed-tensors group {group!r}: no {kind} scheme (weight-only FP8 is not "
            "implemented)"
        )
    if args.get("type") != "float" or int(args.get("num_bits", 0)) != 8:
        raise ConfigError(
            f"compressed-tensors group {group!r}: {kind} {args.get('type')} "
            f"{args.get('num_bits')}-bit is not implemented (8-bit float only)"
        )
    if not args.get("symmetric", True):
        raise ConfigError(f"compressed-tensors group {group!r}: asymmetric {kind}")
    return args


@register_quantization_config
class CompressedTensorsConfig(Fp8Config):
    """The FP8 subset of compressed-tensors, run by the same `Fp8LinearMethod`."""

    name = "compressed-tensors"
    quantizes_at_load = False

    @classmethod
    def from_config(
        cls, config: dict[str, Any]
    ) -> CompressedTensorsConfig | CompressedTensorsIntConfig:
        fmt = config.get("format")
        if fmt not in _FORMATS:
            raise ConfigError(
                f"compressed-tensors format {fmt!r} is not implemented ({', '.join(_FORMATS)})"
            )
        groups = config.get("config_groups") or {}
        if len(groups) != 1:
            raise ConfigError(
                f"compressed-tensors: {len(groups)} config groups; one group (all Linear "
                "layers) is implemented"
            )
        ((group, spec),) = groups.items()
        if "Linear" not in spec.get("targets", []):
            raise ConfigError(
                f"compressed-tensors group {group!r} targets {spec.get('targets')}, not Linear"
            )
        if fmt == "pack-quantized":
            weights = spec.get("weights") or {}
            if weights.get("type") != "int" or spec.get("input_activations") is not None:
                raise ConfigError(
                    f"compressed-tensors group {group!r}: pack-quantized needs int weights and "
                    "16-bit activations"
                )
            ignore = tuple(config.get("ignore") or ())
            return CompressedTensorsIntConfig.from_spec(group, weights, ignore)
        weights = _fp8_args(group, "weights", spec.get("weights"))
        acts = _fp8_args(group, "input_activations", spec.get("input_activations"))
        w_strategy = weights.get("strategy")
        if w_strategy not in ("tensor", "channel") or weights.get("dynamic"):
            raise ConfigError(
                f"compressed-tensors group {group!r}: weight strategy {w_strategy!r} "
                f"(dynamic={weights.get('dynamic')}) is not implemented (static tensor, channel)"
            )
        a_strategy = acts.get("strategy")
        dynamic = bool(acts.get("dynamic"))
        if a_strategy not in ("tensor", "token") or (a_strategy == "token" and not dynamic):
            raise ConfigError(
                f"compressed-tensors group {group!r}: activation strategy {a_strategy!r} "
                f"(dynamic={dynamic}) is not implemented (dynamic tensor or token, static tensor)"
            )
        if a_strategy == "token" and w_strategy != "channel":
            raise ConfigError(
                f"compressed-tensors group {group!r}: per-token activations with "
                f"{w_strategy} weights are not implemented (channel weights)"
            )
        kv_scheme = config.get("kv_cache_scheme")
        if kv_scheme is not None and kv_scheme.get("type") != "float":
            raise ConfigError(f"compressed-tensors kv_cache_scheme {kv_scheme!r}")
        scheme = Fp8Scheme(
            is_checkpoint_fp8_serialized=True,
            weight_strategy=w_strategy,
            activation_scheme="dynamic" if dynamic else "static",
            activation_strategy=a_strategy,
        )
        return cls(scheme, tuple(config.get("ignore") or ()))
