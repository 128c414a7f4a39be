"""Quantization methods behind the linear layers' hook (see base.py)."""

from tandem.layers.quantization.base import (
    QUANTIZATION_CONFIGS,
    ExpertsMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    get_quantization_config,
    process_weights_after_loading,
    register_quantization_config,
    resolve_quant_config,
    set_weight_attrs,
)
from tandem.layers.quantization.compressed_tensors import CompressedTensorsConfig
from tandem.layers.quantization.cpu import CpuPackedLinearMethod
from tandem.layers.quantization.factory import get_quant_method
from tandem.layers.quantization.fbgemm_fp8 import FbgemmFp8Config
from tandem.layers.quantization.fp8 import (
    Fp8Config,
    Fp8LinearMethod,
    Fp8MoEMethod,
    PtpcFp8Config,
)
from tandem.layers.quantization.int_weight_only import AWQConfig, GPTQConfig
from tandem.layers.quantization.modelopt import ModelOptFp8Config
from tandem.layers.quantization.unquantized import UnquantizedLinearMethod

__all__ = [
    "QUANTIZATION_CONFIGS",
    "AWQConfig",
    "CompressedTensorsConfig",
    "CpuPackedLinearMethod",
    "ExpertsMethodBase",
    "FbgemmFp8Config",
    "Fp8Config",
    "Fp8LinearMethod",
    "Fp8MoEMethod",
    "GPTQConfig",
    "LinearMethodBase",
    "ModelOptFp8Config",
    "PtpcFp8Config",
    "QuantizationConfig",
    "QuantizeMethodBase",
    "UnquantizedLinearMethod",
    "get_quant_method",
    "get_quantization_config",
    "process_weights_after_loading",
    "register_quantization_config",
    "resolve_quant_config",
    "set_weight_attrs",
]
