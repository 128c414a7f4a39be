"""Model definitions, the model interface and the architecture registry."""

from tandem.models.interface import CausalLM, IntermediateTensors, ModelContext
from tandem.models.llama import LlamaForCausalLM
from tandem.models.registry import (
    MODEL_REGISTRY,
    UnsupportedModelError,
    check_model_config,
    get_model_class,
    supported_architectures,
)

__all__ = [
    "MODEL_REGISTRY",
    "CausalLM",
    "IntermediateTensors",
    "LlamaForCausalLM",
    "ModelContext",
    "UnsupportedModelError",
    "check_model_config",
    "get_model_class",
    "supported_architectures",
]
