"""The one resolution step of an engine's configuration: the model path resolved (converting
GGUF once), the HF config loaded once (with `--hf-overrides` set on it) and checked against
the model classes, `max_model_len` decided once (the model's `max_position_embeddings`, YaRN's
scaled context, or the user's value checked against it)
and copied into `SchedulerConfig.max_model_len`, a draft model's vocabulary checked against
the target's. Everything downstream reads `config.model.hf_config` /
`config.model.max_model_len`; nothing loads or patches them again.

It lives here, above the models, because reading a checkpoint's config and asking the model
classes whether they run it needs both; `tandem.config` stays plain data and flags.
"""

from __future__ import annotations

import dataclasses

from tandem.config import ConfigError, EngineConfig, ModelConfig, SpeculativeConfig
from tandem.layers.rotary import rope_context_len, rope_parameters_from_config
from tandem.loader.hf_folder import apply_hf_overrides, load_hf_config
from tandem.loader.model_loader import resolve_model_path
from tandem.models.registry import check_model_config


def resolve_engine_config(config: EngineConfig) -> EngineConfig:
    """`config` resolved (see the module docstring); itself when already resolved. Raises
    ConfigError for a model, length, parallel layout or draft the engine cannot run."""
    if config.is_resolved:
        return config
    model = resolve_model_config(config.model)
    config.parallel.check_model(model.hf_config)
    scheduler = dataclasses.replace(config.scheduler, max_model_len=model.max_model_len)
    vocab = int(getattr(model.hf_config, "vocab_size", 0) or 0)
    speculative = resolve_speculative_config(config.speculative, model.cache_dir, vocab)
    return dataclasses.replace(config, model=model, scheduler=scheduler, speculative=speculative)


def resolve_model_config(model: ModelConfig) -> ModelConfig:
    """`model` with the model path, HF config and max_model_len decided (itself when already
    resolved). Raises ConfigError when the model's architecture, a variant or an option of its
    config is unsupported, or `max_model_len` exceeds its context."""
    if model.is_resolved:
        return model
    model_path = resolve_model_path(model.model, model.cache_dir or None)
    hf_config = apply_hf_overrides(load_hf_config(model_path), model.overrides)
    try:
        check_model_config(hf_config)
    except ValueError as exc:  # an architecture, variant or option tandem cannot run
        raise ConfigError(f"model {model.model}: {exc}") from None
    text = getattr(hf_config, "text_config", None) or hf_config  # a multimodal config's
    model_max = int(getattr(text, "max_position_embeddings", 0) or 0)
    scaling = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if model_max and isinstance(scaling, dict) and scaling.get("rope_type") == "yarn":
        # YaRN rotates past the field (rope_context_len)
        model_max = rope_context_len(rope_parameters_from_config(text), model_max)
    max_len = model.max_model_len or model_max
    if model_max and max_len > model_max:
        raise ConfigError(f"max_model_len {max_len} exceeds the model's context ({model_max})")
    return dataclasses.replace(
        model, model_path=model_path, hf_config=hf_config, max_model_len=max_len
    )


def resolve_speculative_config(
    speculative: SpeculativeConfig, cache_dir: str, target_vocab_size: int
) -> SpeculativeConfig:
    """Check a draft model or EAGLE head against the target: the same vocabulary
    (ConfigError else)."""
    if speculative.method not in ("draft_model", "eagle"):
        return speculative
    draft = load_hf_config(resolve_model_path(speculative.model, cache_dir or None))
    draft_vocab = int(getattr(draft, "vocab_size", 0) or 0)
    if draft_vocab != target_vocab_size:
        raise ConfigError(
            f"speculative_config: the draft model {speculative.model!r} has a vocabulary of "
            f"{draft_vocab} tokens, the target's has {target_vocab_size}"
        )
    return speculative
