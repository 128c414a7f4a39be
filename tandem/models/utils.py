"""Helpers a model file shares: pipeline-stage placeholders and checkpoint loading."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import nn

from tandem.distributed import get_pp_indices
from tandem.layers.weight_utils import LoadedWeight, copy_weight, full_weight


class PPMissingLayer(nn.Identity):
    """A layer another pipeline stage holds: it keeps the module names (`model.layers.7`)
    global, holds no parameters, and `load_weights` skips checkpoint tensors under it."""


def make_layers(
    num_layers: int, pp_rank: int, pp_size: int, layer_fn: Callable[[int], nn.Module]
) -> tuple[int, int, nn.ModuleList]:
    """`(start, end, layers)`: layers `[start, end)` of this stage built by `layer_fn(index)`,
    the others `PPMissingLayer`."""
    start, end = get_pp_indices(num_layers, pp_rank, pp_size)
    layers = nn.ModuleList(
        layer_fn(i) if start <= i < end else PPMissingLayer() for i in range(num_layers)
    )
    return start, end, layers


def missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The module names (with a trailing dot) of a model's `PPMissingLayer`s."""
    return tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, PPMissingLayer))


# A checkpoint's FP8 KV cache scales, by name ending: which scale of the layer's attention.
_KV_SCALE_SUFFIXES = {
    ".self_attn.k_scale": ("k_scale",),
    ".self_attn.v_scale": ("v_scale",),
    ".self_attn.k_proj.output_scale": ("k_scale",),  # older compressed-tensors
    ".self_attn.v_proj.output_scale": ("v_scale",),
    ".self_attn.kv_scale": ("k_scale", "v_scale"),  # one scale for both
    ".self_attn.k_proj.k_scale": ("k_scale",),  # ModelOpt
    ".self_attn.v_proj.v_scale": ("v_scale",),
}


def kv_scale_target(name: str) -> tuple[str, tuple[str, ...]] | None:
    """For a checkpoint's KV cache scale (`model.layers.3.self_attn.k_scale`): the module name
    of its `Attention` layer (`model.layers.3.self_attn.attn`) and the scales it sets;
    None for any other tensor."""
    for suffix, scales in _KV_SCALE_SUFFIXES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".self_attn.attn", scales
    return None


def default_weight_loader(param: nn.Parameter, loaded_weight: LoadedWeight) -> None:
    """The whole checkpoint tensor into `param` (norms and other replicated parameters)."""
    copy_weight(param.data, loaded_weight, "parameter")


def weight_loader_of(param: nn.Parameter) -> Callable[..., None]:
    return getattr(param, "weight_loader", default_weight_loader)


# (fused parameter, checkpoint projection, shard id): the dense layers' fused parameters.
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)
_SHARDS_OF = {".qkv_proj": {"q", "k", "v"}, ".gate_up_proj": {0, 1}}


# An expert's checkpoint tensor: `<moe>.experts.<i>.<proj>.weight`, Mixtral's w1/w2/w3 or
# Qwen-MoE's gate/up/down projections, -> the MoE layer's fused parameter and shard.
_EXPERT_NAME = re.compile(
    r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
    r"\.(weight|weight_scale|weight_scale_inv)$"
)
_EXPERT_SHARDS = {
    "w1": "w1",
    "gate_proj": "w1",
    "w3": "w3",
    "up_proj": "w3",
    "w2": "w2",
    "down_proj": "w2",
}


def expert_param(name: str) -> tuple[str, str, int] | None:
    """`(parameter name, shard id, expert id)` of an expert's checkpoint tensor, else None:
    gate (w1) and up (w3) go into `<moe>.experts.w13_weight`, down (w2) into
    `<moe>.experts.w2_weight` (tandem.layers.moe.FusedMoE); an FP8 checkpoint's
    `weight_scale` into `w13_weight_scale` / `w2_weight_scale`, and a block-scaled one's
    `weight_scale_inv` into `w13_weight_scale_inv` / `w2_weight_scale_inv` (Fp8MoEMethod's)."""
    match = _EXPERT_NAME.match(name)
    if match is None:
        return None
    prefix, expert_id, proj, kind = match.groups()
    shard = _EXPERT_SHARDS[proj]
    param = ("w2_" if shard == "w2" else "w13_") + kind
    return f"{prefix}.{param}", shard, int(expert_id)


def load_checkpoint(
    model: nn.Module,
    weights: Iterable[tuple[str, LoadedWeight]],
    stacked_params: Sequence[tuple[str, str, str | int]] = STACKED_PARAMS,
    tie_word_embeddings: bool = False,
) -> None:
    """Hand each checkpoint tensor (Hugging Face names) to its parameter's `weight_loader`,
    which keeps this rank's part.

    - an expert's tensor (`...experts.{i}.{proj}.weight`) goes to its MoE layer's fused
      parameter with `(shard_id, expert_id)` (`expert_param`);
    - a projection of `stacked_params` goes into its fused parameter with its shard id;
    - an FP8 KV cache's `k_scale` / `v_scale` go to the layer's attention (`kv_scale_target`);
    - tensors of layers another stage holds are skipped, and so are rotary `inv_freq`
      buffers and, with tied embeddings, `lm_head.weight` (a last stage without the
      embedding loads `model.embed_tokens.weight` into its own LM head).

    Raises on an unknown name, a shape mismatch, or a parameter no checkpoint tensor filled
    (a fused parameter needs every shard: its `required_shards` attribute, else all parts).
    """
    params = dict(model.named_parameters())
    elsewhere = missing_prefixes(model)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    own_tied_head = tie_word_embeddings and isinstance(embed, PPMissingLayer)
    loaded: dict[str, set[Any]] = {}
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        if tie_word_embeddings and name == "lm_head.weight":
            continue
        if own_tied_head and name == "model.embed_tokens.weight":
            name = "lm_head.weight"
        kv_scale = kv_scale_target(name)
        if kv_scale is not None:  # an FP8 KV cache's scale: the attention layer keeps it
            module, scales = kv_scale
            if not module.startswith(elsewhere):
                for which in scales:
                    model.get_submodule(module).load_kv_scale(which, full_weight(tensor))
            continue
        args: tuple[Any, ...] = ()
        expert = expert_param(name)
        if expert is not None:
            name, shard, expert_id = expert
            args = (shard, expert_id)
        else:
            for fused, part, shard in stacked_params:
                if part in name:
                    name, args = name.replace(part, fused), (shard,)
                    break
        if name.startswith(elsewhere):
            continue
        param = params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model")
        weight_loader_of(param)(param, tensor, *args)
        loaded.setdefault(name, set()).add(args[0] if len(args) == 1 else args or None)
    missing = [
        name
        for name, param in params.items()
        if not (name in loaded and _complete(name, param, loaded[name]))
    ]
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} parameters: {shown}")


def _complete(name: str, param: nn.Parameter, shards: set[Any]) -> bool:
    """Whether a parameter got all its parts (a fused one: every shard id, or the whole)."""
    if None in shards:
        return True
    required = getattr(param, "required_shards", None)
    if required is not None:
        return shards >= required
    module = name.rsplit(".", 1)[0]
    for fused, expected in _SHARDS_OF.items():
        if module.endswith(fused):
            return shards >= expected
    return True


def sliding_window_for_layer(hf_config: Any, layer_index: int) -> int | None:
    """The sliding window (in tokens, `Attention.sliding_window`) of layer `layer_index`, or
    None for full attention; read from the HF config:

    - `layer_types` (Gemma 3, Qwen2/3 in transformers 5, ...): "sliding_attention" layers get
      `sliding_window`, "full_attention" layers None; another type is a ConfigError;
    - else a `sliding_window_pattern` p (older Gemma 3 configs): every p-th layer is global;
    - else `use_sliding_window` where the config has it (Qwen2: layers from
      `max_window_layers` on), or Mistral-style a set `sliding_window` alone.

    A window of at least `max_position_embeddings` never excludes a key and reads as None.
    """
    from tandem.config import ConfigError

    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        if not 0 <= layer_index < len(layer_types):
            raise ConfigError(f"layer_types has {len(layer_types)} entries, no layer {layer_index}")
        kind = layer_types[layer_index]
        if kind not in ("sliding_attention", "full_attention"):
            raise ConfigError(
                f"layer_types[{layer_index}] {kind!r} is not supported "
                "(sliding_attention, full_attention)"
            )
        slides = kind == "sliding_attention"
    else:
        pattern = getattr(hf_config, "sliding_window_pattern", None) or getattr(
            hf_config, "_sliding_window_pattern", None
        )
        if pattern:
            slides = bool((layer_index + 1) % int(pattern))
        elif hasattr(hf_config, "use_sliding_window"):
            max_window_layers = getattr(hf_config, "max_window_layers", None) or 0
            slides = bool(hf_config.use_sliding_window) and layer_index >= max_window_layers
        else:
            slides = True
    if not slides or not window:
        return None
    window = int(window)
    if window <= 0:
        raise ConfigError(f"sliding_window must be positive, got {window}")
    max_positions = getattr(hf_config, "max_position_embeddings", None)
    if max_positions is not None and window >= int(max_positions):
        return None
    return window
