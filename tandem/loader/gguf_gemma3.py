"""Gemma 3 text in GGUF, as llama.cpp's converter writes it and its runtime reads it.

What a `gemma3` file says differently from a llama one, and how each maps back to a
`Gemma3TextConfig` and Hugging Face tensors:

- **Norm weights hold `1 + w`.** Gemma's RMSNorm scales by `1 + w`; llama.cpp adds the one
  when converting (every `*norm.weight`: input, post-attention, pre/post feed-forward, the
  per-head q/k norms, the final norm) so its kernels scale by the stored value. The loader
  subtracts it again: the folder holds `w`, as a Hugging Face checkpoint does.
- **Per-layer tensor names.** `post_attention_norm` is the post-attention norm (in a llama
  file `ffn_norm` is, there being no post-norms); `ffn_norm` is the pre-feed-forward norm;
  `post_ffw_norm` the post-feed-forward one. Q/K rows are not permuted (NeoX rotary).
- **Which layers slide.** `attention.sliding_window_pattern` when the file has it (an int n:
  layer i slides unless `i % n == n - 1`; or one bool per layer, true = sliding); llama.cpp's
  Gemma 3 default, n = 6, otherwise. `attention.sliding_window` is the window in tokens.
- **Two rotary bases.** `rope.freq_base` (with `rope.scaling.*`) is the global layers';
  sliding layers take `rope.freq_base_swa`, or 10000 with no scaling when absent (llama.cpp's
  fixed Gemma 3 value).
- **The score scale is not stored.** llama.cpp derives it from the shape: `hidden / heads`
  for the 62-layer (27B) model, `head_dim` otherwise; that is the checkpoints'
  `query_pre_attn_scalar`.
- `final_logit_softcapping` when present; Gemma 2's attention soft-capping is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# Per-layer GGUF tensor names whose Hugging Face name differs from the llama mapping.
GEMMA3_LAYER_TENSOR_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# What llama.cpp adds to every norm weight of a Gemma 3 file.
NORM_SHIFT = 1.0
# llama.cpp's Gemma 3 defaults for what older files leave out.
DEFAULT_SLIDING_WINDOW_PATTERN = 6
DEFAULT_SWA_ROPE_THETA = 10000.0
_LAYERS_27B = 62

Meta = Callable[[str], Any]


def is_shifted_norm(gguf_name: str) -> bool:
    """Whether this tensor of a Gemma 3 file holds `1 + w` (every norm weight)."""
    return gguf_name.endswith("norm.weight")


def layer_types(pattern: int | Sequence[bool] | None, num_layers: int) -> list[str]:
    """Each layer's `layer_types` entry from the file's sliding-window pattern (see above)."""
    if pattern is None:
        pattern = DEFAULT_SLIDING_WINDOW_PATTERN
    if isinstance(pattern, Sequence):
        if len(pattern) != num_layers:
            raise ValueError(
                f"sliding_window_pattern has {len(pattern)} entries for {num_layers} layers"
            )
        slides = [bool(p) for p in pattern]
    else:
        n = int(pattern)
        slides = [n == 0 or i % n < n - 1 for i in range(num_layers)]
    return ["sliding_attention" if s else "full_attention" for s in slides]


def query_pre_attn_scalar(num_layers: int, hidden_size: int, num_heads: int, head_dim: int) -> int:
    """The score scale's inverse square, as llama.cpp derives it for Gemma 3."""
    return hidden_size // num_heads if num_layers == _LAYERS_27B else head_dim


def gemma3_config_fields(meta: Meta, fields: dict[str, Any], where: str) -> dict[str, Any]:
    """The `Gemma3TextConfig` fields beyond the common ones in `fields` (which must hold the
    sizes and the global layers' `rope_parameters`); `meta(key)` reads `gemma3.<key>` (None
    when absent). Raises ValueError naming the key when the file can't be run."""
    if meta("attn_logit_softcapping"):
        raise ValueError(
            f"{where}: gemma3.attn_logit_softcapping is set; attention soft-capping "
            "(Gemma 2's) is not supported"
        )
    num_layers = fields["num_hidden_layers"]
    try:
        types = layer_types(meta("attention.sliding_window_pattern"), num_layers)
    except ValueError as e:
        raise ValueError(f"{where}: gemma3.attention.{e}") from None
    window = meta("attention.sliding_window")
    if window is None and "sliding_attention" in types:
        raise ValueError(f"{where}: metadata key gemma3.attention.sliding_window is missing")
    swa_theta = meta("rope.freq_base_swa")
    cap = meta("final_logit_softcapping")
    return {
        "layer_types": types,
        "sliding_window": int(window) if window is not None else None,
        "rope_parameters": {
            "full_attention": fields["rope_parameters"],
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(swa_theta or DEFAULT_SWA_ROPE_THETA),
            },
        },
        "query_pre_attn_scalar": query_pre_attn_scalar(
            num_layers, fields["hidden_size"], fields["num_attention_heads"], fields["head_dim"]
        ),
        "final_logit_softcapping": float(cap) if cap else None,
        "attn_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
    }
