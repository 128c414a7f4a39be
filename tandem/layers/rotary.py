"""Rotary position embedding (the "rotate half" / NeoX layout Hugging Face Llama uses).

A head's `head_size` dims are split in halves (x1, x2); position p with inverse frequency
f_i turns (x1_i, x2_i) by angle p * f_i. `cos_cache[p] = cos(p f)` and `sin_cache[p] = sin(p f)`
(`[max_position, rotary_dim // 2]`, float32) are precomputed for every position;
`apply_rotary_emb` is a plain function with the same arguments as the Triton kernel
(`tandem_kernels.rotary.rotary_embedding`), so one can stand in for the other.

Supported `rope_type`s: "default", "linear" (inverse frequencies / factor), "llama3"
(Llama 3.1's band-wise scaling of long wavelengths), "yarn" (YaRN: short wavelengths kept,
long ones divided by the factor, a linear ramp between; Qwen2.5 / Qwen3's long-context
setting) and "longrope" (Phi-3's per-frequency factors, a short set and a long one). YaRN and
LongRoPE also scale cos and sin (`attention_factor`).

Partial rotary (`partial_rotary_factor` < 1, Phi-4-mini): only a head's first `rotary_dim`
dims rotate, in halves of their own, the rest pass through. The same kernels serve it: the
caches keep `head_size // 2` columns, the rotary frequencies first and then angle zero
(cos 1, sin 0: the identity) for the passing dims, and the model orders each q and k head's
dims by `partial_rotary_order` when it loads (q . k is the same under one order of both), so
each rotating pair lands `head_size // 2` apart.

LongRoPE's set is chosen once per model, by the context it is built for (`long_context`:
the engine's max_model_len beyond `original_max_position_embeddings`), so every sequence,
batch and cached block rotates the same way. transformers chooses per forward call (long once
the call's last position passes the original context), and so does vLLM per batch: the same
result wherever the context is set to the original length (short set) or a prompt is longer
than it (long set).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters_from_config(hf_config: Any) -> dict[str, Any]:
    """`{"rope_type", "rope_theta", ...scaling keys}` from a transformers config (v4 or v5).
    YaRN's and LongRoPE's also carry `original_max_position_embeddings` (the config's own
    field first, as Phi-3 stores it) and `max_position_embeddings` (for their default
    factors)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = float(getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("yarn", "longrope"):
        max_position = int(hf_config.max_position_embeddings)
        original = getattr(hf_config, "original_max_position_embeddings", None)
        original = original or params.get("original_max_position_embeddings") or max_position
        params["original_max_position_embeddings"] = int(original)
        params["max_position_embeddings"] = max_position
    return params


def compute_inv_freq(
    rotary_dim: int, rope_parameters: dict[str, Any], long_context: bool = False
) -> torch.Tensor:
    """Inverse frequencies `[rotary_dim // 2]` float32 for the given rope parameters
    (`long_context`: LongRoPE's long factors, else its short ones)."""
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
        )
    if rope_type in ("yarn", "longrope") and not rope_parameters.get(
        "original_max_position_embeddings"
    ):
        raise ValueError(f"rope_type {rope_type} needs original_max_position_embeddings")
    base = float(rope_parameters["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / float(rope_parameters["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope_parameters)
    elif rope_type == "yarn":
        inv_freq = _yarn_inv_freq(rotary_dim, base, rope_parameters)
    elif rope_type == "longrope":
        key = "long_factor" if long_context else "short_factor"
        stored = rope_parameters.get(key)
        if not isinstance(stored, list | tuple):
            raise ValueError(f"rope {key} must be a list of numbers, got {stored!r}")
        factors = torch.tensor(stored, dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(
                f"rope {key} has {factors.numel()} values; the rotary dim {rotary_dim} needs "
                f"{inv_freq.numel()}"
            )
        inv_freq = 1.0 / (factors * base**exponents)
    return inv_freq


def _context_growth(rope_parameters: dict[str, Any]) -> float:
    """The configured `factor`, else the context's growth over the original."""
    factor = rope_parameters.get("factor")
    if factor is None:
        original = int(rope_parameters["original_max_position_embeddings"])
        factor = int(rope_parameters["max_position_embeddings"]) / original
    return float(factor)


def _yarn_inv_freq(rotary_dim: int, base: float, p: dict[str, Any]) -> torch.Tensor:
    """YaRN's frequencies: those that turn more than `beta_fast` times over the original
    context kept, fewer than `beta_slow` times divided by the factor, a linear ramp between
    (the ramp's ends rounded outward unless `truncate` is false)."""
    factor = _context_growth(p)
    original = int(p["original_max_position_embeddings"])
    beta_fast = float(p.get("beta_fast") or 32)
    beta_slow = float(p.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    # `ramp`: the share of the scaled (interpolated) frequency
    return (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * (1 - ramp)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_context_len(rope_parameters: dict[str, Any], max_position_embeddings: int) -> int:
    """The positions a model rotates: its `max_position_embeddings`, or for YaRN the original
    context times the factor when that is longer (Qwen's long-context setting keeps the
    32k field and scales it 4x, as vLLM reads it)."""
    if rope_parameters.get("rope_type") != "yarn":
        return max_position_embeddings
    original = int(rope_parameters["original_max_position_embeddings"])
    return max(max_position_embeddings, int(original * _context_growth(rope_parameters)))


def uses_long_factors(rope_parameters: dict[str, Any], max_model_len: int | None) -> bool:
    """Whether a model built for `max_model_len` tokens (None: its configured maximum) takes
    LongRoPE's long factors: past the original context. False for every other rope type."""
    if rope_parameters.get("rope_type") != "longrope":
        return False
    original = int(rope_parameters.get("original_max_position_embeddings") or 0)
    length = max_model_len or int(rope_parameters["max_position_embeddings"])
    return length > original


def attention_factor(rope_parameters: dict[str, Any]) -> float:
    """The scale on cos and sin, `attention_factor` where given, else by the context's
    growth `factor` (the configured one, or the growth over the original context): YaRN's
    `0.1 ln(factor) + 1` (with `mscale` / `mscale_all_dim`, their ratio), LongRoPE's
    `sqrt(1 + ln(factor) / ln(original context))`; 1.0 without growth and for every other
    rope type."""
    rope_type = rope_parameters.get("rope_type")
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    given = rope_parameters.get("attention_factor")
    if given is not None:
        return float(given)
    factor = _context_growth(rope_parameters)
    if rope_type == "yarn":
        mscale, all_dims = rope_parameters.get("mscale"), rope_parameters.get("mscale_all_dim")
        if mscale and all_dims:
            return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(all_dims))
        return _yarn_mscale(factor)
    if factor <= 1.0:
        return 1.0
    original = int(rope_parameters["original_max_position_embeddings"])
    return math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3_scale(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    """Long wavelengths slowed by `factor`, short ones kept, a smooth blend in between."""
    factor = float(p["factor"])
    low_freq_factor = float(p["low_freq_factor"])
    high_freq_factor = float(p["high_freq_factor"])
    old_context_len = float(p["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_cos_sin_cache(
    max_position: int, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(cos, sin)`, each `[max_position, rotary_dim // 2]` float32, at angles `p * f`."""
    t = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float())
    return freqs.cos(), freqs.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


def apply_rotary_emb(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `query [T, H, D]` and `key [T, KVH, D]` by `positions [T]`; new tensors.

    cos/sin are cast to the inputs' dtype before use (as Hugging Face does).
    """
    cos = cos_cache.index_select(0, positions)
    sin = sin_cache.index_select(0, positions)
    cos = torch.cat([cos, cos], dim=-1).unsqueeze(1).to(query.dtype)
    sin = torch.cat([sin, sin], dim=-1).unsqueeze(1).to(query.dtype)
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def partial_rotary_order(head_size: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's dims under partial rotary (module docstring): new dim n holds
    old dim `order[n]`; pairs `(i, i + rotary_dim // 2)` of the rotating part become
    `(i, i + head_size // 2)`, the passing dims fill the remaining pairs."""
    half, rest = rotary_dim // 2, (head_size - rotary_dim) // 2
    first = [*range(half), *range(rotary_dim, rotary_dim + rest)]
    second = [*range(half, rotary_dim), *range(rotary_dim + rest, head_size)]
    return torch.tensor(first + second, dtype=torch.int64)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin caches on the device; `forward(positions, q, k) -> (q, k)`.

    On CUDA the Triton kernel (tandem_kernels/rotary.py), else `apply_rotary_emb`.
    `max_model_len`: the context the engine serves (LongRoPE's choice of factors:
    `uses_long_factors`); the caches hold `max_position` positions, cos and sin scaled by
    `attention_factor`. `rotary_dim` (None: the whole head): partial rotary, its dims
    ordered by `partial_rotary_order`.
    """

    def __init__(
        self,
        head_size: int,
        max_position: int,
        rope_parameters: dict[str, Any],
        device: torch.device,
        max_model_len: int | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        rotary_dim = rotary_dim or head_size
        long_context = uses_long_factors(rope_parameters, max_model_len)
        inv_freq = compute_inv_freq(rotary_dim, rope_parameters, long_context)
        cos, sin = compute_cos_sin_cache(max_position, inv_freq)
        scale = attention_factor(rope_parameters)
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        if rotary_dim < head_size:  # the passing dims: angle zero, unscaled
            rest = (head_size - rotary_dim) // 2
            cos = torch.cat([cos, torch.ones(max_position, rest)], dim=1)
            sin = torch.cat([sin, torch.zeros(max_position, rest)], dim=1)
        self.register_buffer("cos_cache", cos.to(device), persistent=False)
        self.register_buffer("sin_cache", sin.to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if query.is_cuda:
            from tandem_kernels.rotary import rotary_embedding

            return rotary_embedding(
                positions, query, key, self.cos_cache, self.sin_cache, inplace=False
            )
        return apply_rotary_emb(positions, query, key, self.cos_cache, self.sin_cache)
