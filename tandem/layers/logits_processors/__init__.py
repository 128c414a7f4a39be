"""Logits processors: the built-in `logit_bias`, `allowed_token_ids` and `bad_words`, and
custom batch-level processors (vLLM v1's interface), applied in the sampler's "process
logits" stage (tandem.layers.sampler)."""

from __future__ import annotations

from tandem.layers.logits_processors.builtin import (
    LogitsRules,
    RequestLogitsRules,
    apply_logits_rules,
)
from tandem.layers.logits_processors.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
    RemovedRequest,
)
from tandem.layers.logits_processors.state import (
    BatchUpdateBuilder,
    LogitsProcessors,
    ProcessorInputs,
    load_logits_processors,
)

__all__ = [
    "AddedRequest",
    "BatchUpdate",
    "BatchUpdateBuilder",
    "LogitsProcessor",
    "LogitsProcessors",
    "LogitsRules",
    "MoveDirectionality",
    "MovedRequest",
    "ProcessorInputs",
    "RemovedRequest",
    "RequestLogitsRules",
    "apply_logits_rules",
    "load_logits_processors",
]
