"""Hugging Face `architectures` name -> tandem model class (each built
`cls(hf_config, ctx: ModelContext)` and implementing tandem.models.interface.CausalLM)."""

from __future__ import annotations

from typing import Any

from tandem.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from tandem.models.granite import GraniteForCausalLM
from tandem.models.interface import CausalLM
from tandem.models.llama import LlamaForCausalLM
from tandem.models.mixtral import MixtralForCausalLM
from tandem.models.qwen3 import Qwen3ForCausalLM
from tandem.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "GraniteForCausalLM": GraniteForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


# A config that names no `architectures` (saved from a bare config class) is taken by its
# `model_type`.
_BY_MODEL_TYPE: dict[str, str] = {
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "granite": "GraniteForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


class UnsupportedModelError(ValueError):
    """The config's architecture has no tandem implementation; the message lists those that do."""


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def check_model_config(hf_config: Any) -> None:
    """UnsupportedModelError naming the architecture, variant or option of `hf_config` tandem
    cannot run (the class's `check_config`); nothing when it can. Reads only the config."""
    cls = get_model_class(hf_config)
    check = getattr(cls, "check_config", None)
    if check is None:
        return
    try:
        check(hf_config)
    except ValueError as exc:
        # Named as the config names it (a Phi-3 config runs on the Llama class).
        served = [a for a in getattr(hf_config, "architectures", None) or [] if a in MODEL_REGISTRY]
        raise UnsupportedModelError(f"{served[0] if served else cls.__name__}: {exc}") from None


def get_model_class(hf_config: Any) -> type[CausalLM]:
    """The class for the first of `hf_config.architectures` tandem implements (none named:
    the one of its `model_type`)."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures and getattr(hf_config, "model_type", None) in _BY_MODEL_TYPE:
        architectures = [_BY_MODEL_TYPE[hf_config.model_type]]
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    named = ", ".join(architectures) if architectures else "(none given)"
    raise UnsupportedModelError(
        f"model architecture {named} is not supported; supported: "
        f"{', '.join(supported_architectures())}"
    )
