"""The quantization-method hook every linear layer (and the LM head) goes through.

A linear layer does not make its own weights: it asks its method to, and the method owns the
product. The layer keeps the sharding (which rows or columns of the checkpoint this rank
holds); the method keeps the representation (plain, prepacked for the CPU, FP8 with scales):

    layer.__init__  -> method.create_weights(layer, ...)       registers parameters on `layer`,
                                                               each with a `weight_loader`
    load_weights    -> param.weight_loader(param, tensor, shard_id)
    after loading   -> method.process_weights_after_loading(layer)   (repack, requantize)
    forward         -> method.apply(layer, x, bias)
    the op before   -> method.input_quantizer(layer)   (input_quant.py: the norm or activation
                                                       feeding `layer` writes the quantized
                                                       input the method wants, or plain input)

Sharding metadata lives on the parameters, as vLLM's does: `output_dim` (the dim a column-
parallel layer splits) and `input_dim` (the dim a row-parallel layer splits). A parameter with
neither (a per-tensor scale) is loaded whole on every rank. A method that adds parameters (an
FP8 method's `weight_scale`) registers them with the same `weight_loader` and the right dims,
and `load_weights` then accepts their checkpoint names with no change.

A `QuantizationConfig` (the engine's, on `ModelContext.quant_config`) picks a method per
layer; configs register by name (`register_quantization_config`) so the FP8 issue adds its
own module here. `factory.get_quant_method` gives a layer its method: the config's, else the
CPU step path's packed one, else unquantized.
"""

from __future__ import annotations

import fnmatch
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from tandem.layers.quantization.input_quant import ActivationQuantizer
    from tandem.layers.weight_utils import LoadedWeight

# `weight_loader(param, loaded_weight, shard_id=None)`: copies this rank's part of a
# checkpoint tensor into `param`.
WeightLoader = Callable[..., None]


def set_weight_attrs(param: nn.Parameter, attrs: dict[str, Any]) -> None:
    """Attach loading metadata (`weight_loader`, `output_dim`, `input_dim`) to `param`."""
    for key, value in attrs.items():
        if hasattr(param, key):
            raise ValueError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


def is_ignored_layer(prefix: str, patterns: Iterable[str]) -> bool:
    """Whether layer `prefix` matches a checkpoint's list of layers left unquantized: an entry
    `re:<regex>` (compressed-tensors), a wildcard (`model.layers.0.*`, ModelOpt's) or a
    module name (whole, or a dotted suffix). A fused layer matches as its first part does
    (`q_proj` for `qkv_proj`, `gate_proj` for `gate_up_proj`)."""
    names = {prefix}
    for fused, first in ((".qkv_proj", ".q_proj"), (".gate_up_proj", ".gate_proj")):
        if prefix.endswith(fused):
            names.add(prefix[: -len(fused)] + first)
    return any(_matches(name, pattern) for name in names for pattern in patterns)


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if any(c in pattern for c in "*?"):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.endswith("." + pattern)


class QuantizeMethodBase(ABC):
    """How one layer's weights are held and multiplied (see the module docstring)."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        *,
        device: torch.device | None = None,
        **extra_weight_attrs: Any,
    ) -> None:
        """Register this rank's parameters on `layer`. `output_partition_sizes` are the
        fused parts' widths on this rank ([q, k, v], [gate, up], or one); `input_size` and
        `output_size` are the unsharded layer's. `extra_weight_attrs` (the layer's
        `weight_loader`) go on every parameter made; parameters are made on `device`."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027
        """Called once every checkpoint tensor is loaded (and after any later reload)."""

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`x W^T + bias` with this rank's weights."""


class LinearMethodBase(QuantizeMethodBase):
    """A method for linear layers (the LM head included)."""

    def input_quantizer(self, layer: nn.Module) -> ActivationQuantizer | None:
        """How `layer` wants its input from the op before it (tandem.layers.quantization.
        input_quant): None, plain input (the default); a method that returns a quantizer
        accepts that quantizer's `QuantizedActivation` (and `GatedActivation`, where its
        `takes_gated` says so) in `apply`."""
        return None

    def apply_silu_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """`silu_and_mul(self.apply(layer, x, bias))` for a `[gate | up]` layer, in one kernel
        where this method has one for `x` (giving the two ops' bits); None: the caller runs
        `apply` and the activation."""
        return None


class ExpertsMethodBase(ABC):
    """How a mixture-of-experts layer's expert weights are held for its kernel. The layer
    (`FusedMoE`) makes `w13_weight` and `w2_weight` in the model's dtype, each with its
    `weight_loader`, then calls `create_weights(layer)`, which may remake them (another dtype,
    same loaders) and add parameters of its own (a stored checkpoint's scales); after
    loading, `process_weights_after_loading(layer)` may replace them and set the layer's
    `w13_scale` / `w2_scale` buffers (FP8 with a scale per expert and row, or per tile of
    the layer's `weight_block_size`), which the layer hands its kernel
    (`tandem_kernels.fused_moe`)."""

    def create_weights(self, layer: nn.Module) -> None:  # noqa: B027
        """Called once the layer has made its parameters (default: keep them)."""

    @abstractmethod
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once every checkpoint tensor is loaded."""


class QuantizationConfig(ABC):
    """A checkpoint's quantization scheme: which method each layer gets."""

    name: ClassVar[str]
    # Whether `--quantization <name>` can quantize an unquantized checkpoint at load (False:
    # the name only loads checkpoints stored in that format).
    quantizes_at_load: ClassVar[bool] = True

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for `layer` (named `prefix` in the checkpoint), or None for the
        default (unquantized) one."""

    def get_experts_method(self, layer: nn.Module, prefix: str) -> ExpertsMethodBase | None:
        """The method for a mixture-of-experts layer's experts, or None: kept in the
        model's dtype."""
        return None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """From the checkpoint's `quantization_config`."""
        raise NotImplementedError(f"{cls.__name__} cannot be read from a checkpoint config")

    def map_checkpoint(
        self, weights: Iterable[tuple[str, LoadedWeight]]
    ) -> Iterable[tuple[str, LoadedWeight]]:
        """The checkpoint's tensors as the layers' loaders take them (a format whose scales
        are stored under other names or shapes maps them here); default: as stored."""
        return weights

    def for_device(self, device: torch.device) -> QuantizationConfig:
        """This scheme as `device` runs it: a config whose layers hold their weights one way
        on one device and another way elsewhere (integer checkpoints: kept quantized for a
        CUDA kernel, dequantized at load on the CPU) returns the one for `device`. Called
        once at start, before `verify_device` and before any weight is made; default:
        itself."""
        return self

    def verify_device(self, device: torch.device) -> None:  # noqa: B027
        """Raise ConfigError (naming the method and the device) where `device` cannot run
        this scheme; called once at start, before any weight is made."""


QUANTIZATION_CONFIGS: dict[str, type[QuantizationConfig]] = {}


def register_quantization_config(cls: type[QuantizationConfig]) -> type[QuantizationConfig]:
    """Class decorator: make `cls` known under `cls.name`."""
    if cls.name in QUANTIZATION_CONFIGS:
        raise ValueError(f"quantization method {cls.name!r} is registered twice")
    QUANTIZATION_CONFIGS[cls.name] = cls
    return cls


def get_quantization_config(name: str) -> type[QuantizationConfig]:
    if name not in QUANTIZATION_CONFIGS:
        known = ", ".join(sorted(QUANTIZATION_CONFIGS)) or "(none)"
        raise ValueError(f"unknown quantization method {name!r}; known: {known}")
    return QUANTIZATION_CONFIGS[name]


def resolve_quant_config(
    method: str, hf_config: Any, device: torch.device, check_device: bool = True
) -> QuantizationConfig | None:
    """The engine's quantization config: the checkpoint's `quantization_config` when it has
    one (loaded as stored), else `method` applied at load ("auto": none), as `device` runs it
    (`QuantizationConfig.for_device`). Raises ConfigError
    for a scheme not implemented, a `method` that contradicts the checkpoint, or a device
    that cannot run it (`check_device` False: not checked, for tests of the CPU reference
    path)."""
    from tandem.config import ConfigError

    stored = getattr(hf_config, "quantization_config", None)
    if stored is not None and not isinstance(stored, dict):
        stored = stored.to_dict()
    if stored:
        name = stored.get("quant_method")
        if name not in QUANTIZATION_CONFIGS:
            known = ", ".join(sorted(QUANTIZATION_CONFIGS))
            raise ConfigError(
                f"the checkpoint's quantization method {name!r} is not implemented ({known})"
            )
        # An FP8 request over an FP8 compressed-tensors, ModelOpt or FBGEMM checkpoint is the
        # checkpoint's scheme.
        stored_fp8 = name in ("compressed-tensors", "modelopt", "fbgemm_fp8")
        if method not in ("auto", name) and not (method == "fp8" and stored_fp8):
            raise ConfigError(
                f"--quantization {method} does not match the checkpoint's quantization "
                f"method {name!r}"
            )
        config = QUANTIZATION_CONFIGS[name].from_config(stored)
    elif method == "auto":
        return None
    else:
        try:
            config_cls = get_quantization_config(method)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not config_cls.quantizes_at_load:
            raise ConfigError(
                f"--quantization {method} loads {method} checkpoints; this one has no "
                "quantization_config (use fp8 or ptpc_fp8 to quantize it at load)"
            )
        config = config_cls()
    config = config.for_device(device)
    if check_device:
        config.verify_device(device)
    return config


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every layer's method finish its weights (`process_weights_after_loading`) once the
    checkpoint is loaded: the loader calls it after `load_weights`."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethodBase | ExpertsMethodBase):
            method.process_weights_after_loading(module)
