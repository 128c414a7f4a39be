"""Model definitions and the architecture registry."""

from tandem.models.llama import LlamaForCausalLM
from tandem.models.registry import UnsupportedModelError, get_model_class, supported_architectures

__all__ = [
    "LlamaForCausalLM",
    "UnsupportedModelError",
    "get_model_class",
    "supported_architectures",
]
