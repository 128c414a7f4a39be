"""FBGEMM FP8 checkpoints (Meta's FP8 releases, transformers' `FbgemmFp8Config`), loaded as
stored: `quantization_config: {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
"modules_to_not_convert": [...]}`. Weights e4m3 with a scale per output channel
(`weight_scale [N, 1]`); activations quantized per token on the fly, each token's amax first
capped at `activation_scale_ub` (`Fp8Scheme.activation_scale_ub`): a token with an outlier
saturates there instead of coarsening its whole scale. Run by `Fp8LinearMethod` as per-channel
weights with per-token activations (ptpc_fp8's path, the bound applied where the layer
quantizes its input; small batches take the weight-only W8A16 GEMM, as every FP8 scheme does).
Mixture-of-experts layers are refused at start.
"""

from __future__ import annotations

from typing import Any

from tandem.config import ConfigError
from tandem.layers.quantization.base import register_quantization_config
from tandem.layers.quantization.fp8 import Fp8Config, Fp8Scheme


@register_quantization_config
class FbgemmFp8Config(Fp8Config):
    """`fbgemm_fp8`: per-channel e4m3 weights, bounded per-token dynamic activations."""

    name = "fbgemm_fp8"
    quantizes_at_load = False

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> FbgemmFp8Config:
        bound = config.get("activation_scale_ub")
        try:
            bound = float(bound)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ConfigError(
                f"fbgemm_fp8 checkpoint: activation_scale_ub {bound!r} is not a number"
            ) from None
        if not bound > 0:
            raise ConfigError(f"fbgemm_fp8 checkpoint: activation_scale_ub {bound} must be > 0")
        scheme = Fp8Scheme(
            is_checkpoint_fp8_serialized=True,
            weight_strategy="channel",
            activation_strategy="token",
            activation_scale_ub=bound,
        )
        return cls(scheme, tuple(config.get("modules_to_not_convert") or ()))
