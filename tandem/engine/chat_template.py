"""The chat template's options as vLLM names them, checked once for every entry point (the
offline `LLM.chat`, the HTTP API, gRPC's `Chat`).

- `add_generation_prompt` (default true): the prompt ends with the assistant's turn opened.
- `continue_final_message`: the prompt ends inside the final message, left open for the model
  to go on (transformers drops its trailing end-of-turn tokens); never with the above.
- `chat_template_kwargs`: extra variables for the template (e.g. `{"enable_thinking": false}`),
  none of `apply_chat_template`'s own arguments (`TEMPLATE_RESERVED`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# apply_chat_template's own arguments, which chat_template_kwargs may not set (each is a field
# of its own, or the request itself).
TEMPLATE_RESERVED = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    }
)


def template_options_problem(
    add_generation_prompt: bool, continue_final_message: bool, kwargs: Mapping[str, Any]
) -> tuple[str, str] | None:
    """(the message, the field it names) for options that cannot render, or None."""
    taken = sorted(TEMPLATE_RESERVED & kwargs.keys())
    if taken:
        return (
            f"chat_template_kwargs may not set {', '.join(taken)} (a field of its own)",
            "chat_template_kwargs",
        )
    if add_generation_prompt and continue_final_message:
        return (
            "continue_final_message and add_generation_prompt cannot both be true (set "
            "add_generation_prompt: false to continue the final message)",
            "continue_final_message",
        )
    return None
