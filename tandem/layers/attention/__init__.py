from tandem.layers.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionShape,
    get_attention_backend,
    plan_step_metadata,
    register_attention_backend,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionShape",
    "get_attention_backend",
    "plan_step_metadata",
    "register_attention_backend",
]
