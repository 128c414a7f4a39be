"""Helpers a model file shares: pipeline-stage placeholders and the default weight loader."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from tandem.distributed import get_pp_indices
from tandem.layers.weight_utils import LoadedWeight, copy_weight


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
