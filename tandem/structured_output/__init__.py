"""Structured outputs: grammars (JSON schema, regex, choice, EBNF, any JSON object) compiled
by xgrammar, per-request matchers, and the token bitmask of a step's structured rows.

`StructuredOutputManager` (one per engine) is the entry point; see `manager`'s docstring for
the life of a request's grammar. The scheduler sees only `tandem.core.structured`.
"""

from __future__ import annotations

from tandem.structured_output.manager import (
    GrammarRequestState,
    StructuredOutputError,
    StructuredOutputManager,
    choice_ebnf,
    spec_key,
)

__all__ = [
    "GrammarRequestState",
    "StructuredOutputError",
    "StructuredOutputManager",
    "choice_ebnf",
    "spec_key",
]
