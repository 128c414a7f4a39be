"""GPTQ and AWQ checkpoints (integer weights, 16-bit activations), loaded dequantized.

Both store each quantized linear layer as three or four tensors in place of its `weight`:

    GPTQ  qweight  int32 [K / p, N]   p = 32 / bits values per int32 along K, low bits first
          qzeros   int32 [G, N / p]   the zero points, packed the same way along N
          scales   fp16  [G, N]       G groups of `group_size` input channels (-1: one group)
          g_idx    int32 [K]          each input channel's group (`desc_act` reorders them)
          W[n, k] = scales[g, n] * (q[k, n] - zero[g, n]),  g = g_idx[k]
          (`checkpoint_format` "gptq": the stored zero is one below the real one; "gptq_v2":
          stored as is)

    AWQ   qweight  int32 [K, N / 8]   4-bit values along N, eight an int32 in the order
                                      0 2 4 6 1 3 5 7 (AutoAWQ's "gemm" layout)
          qzeros   int32 [G, N / 8]   packed the same way
          scales   fp16  [G, N]
          W[n, k] = scales[k // group_size, n] * (q[k, n] - zero[k // group_size, n])

    compressed-tensors "pack-quantized" (llm-compressor's W4A16 / W8A16 exports)
          weight_packed      int32 [N, K / p]   values + 2^(bits-1) along K, low bits first
          weight_scale             [N, G]       G = K / group_size (group), 1 (channel)
          weight_zero_point  int32 [N / p, G]   packed the same way along N (asymmetric only)
          weight_g_idx       int32 [K]          each channel's group (actorder "group")
          W[n, k] = weight_scale[n, g] * (q[n, k] - zero[n, g])   (symmetric: zero 2^(bits-1))

`map_checkpoint` turns each layer's set into its `weight` `[N, K]` as the tensors stream in,
so every later step is the unquantized model's: the model runs in its dtype with the
dequantized weights (the memory of a 16-bit checkpoint, no integer kernel). Layers stored
unquantized (GPTQ's unlisted modules, AWQ's `modules_to_not_convert`, the LM head) load as
they are. Refused by name: 3-bit GPTQ (values across int32 words), AWQ other than "gemm"
and AWQ without zero points.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from tandem.config import ConfigError
from tandem.layers.quantization.base import (
    QuantizationConfig,
    QuantizeMethodBase,
    register_quantization_config,
)
from tandem.layers.weight_utils import LoadedWeight, full_weight

# AutoAWQ's "gemm" packing: slot i of an int32 holds column `AWQ_PACK_ORDER[i]` of its eight.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The `32 // bits` values of each int32 of `packed` (2-D), low bits first, laid out
    along `dim` (int32: the mask undoes the sign a shift of a negative word brings)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32)
    if dim == 0:
        values = (words[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
        return values.reshape(packed.shape[0] * per_word, packed.shape[1])
    values = (words[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0], packed.shape[1] * per_word)


def _groups(k: int, group_size: int) -> torch.Tensor:
    """Each of `k` input channels' group: runs of `group_size` (-1: one group)."""
    return torch.arange(k) // (k if group_size == -1 else group_size)


def gptq_dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    zero_offset: int,
) -> torch.Tensor:
    """A GPTQ layer's weight `[N, K]` float32 (module docstring); `g_idx` None: runs of
    `group_size` channels; `zero_offset` 1 for the "gptq" format, 0 for "gptq_v2"."""
    q = unpack_int32(qweight, bits, dim=0)
    k, n = q.shape
    zeros = unpack_int32(qzeros, bits, dim=1)[:, :n] + zero_offset
    g = (_groups(k, group_size) if g_idx is None else g_idx).to(torch.int64)
    weight = (q - zeros[g]).to(torch.float32) * scales[g].to(torch.float32)
    return weight.t().contiguous()


def awq_dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """An AWQ ("gemm") layer's weight `[N, K]` float32 (module docstring)."""
    order = torch.tensor(AWQ_PACK_ORDER)
    column_slot = torch.argsort(order)  # where column j of eight sits in its word

    def unpack(packed: torch.Tensor) -> torch.Tensor:
        values = unpack_int32(packed, 4, dim=1)
        rows, cols = values.shape
        return values.view(rows, cols // 8, 8)[:, :, column_slot].reshape(rows, cols)

    q, zeros = unpack(qweight), unpack(qzeros)
    g = _groups(q.shape[0], group_size)
    weight = (q - zeros[g]).to(torch.float32) * scales[g].to(torch.float32)
    return weight.t().contiguous()


class _DequantizedConfig(QuantizationConfig):
    """Integer checkpoints dequantized as they load: every layer then takes the default
    (unquantized) method."""

    quantizes_at_load = False
    # The tensors that stand for one layer's weight; `self.parts` (these, and the optional
    # ones a config needs) are awaited, the other optional ones dropped.
    PARTS: ClassVar[tuple[str, ...]] = ("qweight", "qzeros", "scales")
    OPTIONAL: ClassVar[tuple[str, ...]] = ()

    def __init__(self, group_size: int = -1, *needed: str) -> None:
        self.group_size = group_size
        self.parts: tuple[str, ...] = self.PARTS + needed

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        return None

    def _dequantize(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def map_checkpoint(
        self, weights: Iterable[tuple[str, LoadedWeight]]
    ) -> Iterator[tuple[str, LoadedWeight]]:
        """Each layer's packed tensors as its dequantized `weight`, once all have come;
        everything else as stored. A layer whose set stays incomplete is a ConfigError."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        names = (*self.parts, *self.OPTIONAL)
        for name, tensor in weights:
            prefix, _, suffix = name.rpartition(".")
            if suffix not in names:
                yield name, tensor
                continue
            if suffix not in self.parts:
                continue
            parts = pending.setdefault(prefix, {})
            parts[suffix] = full_weight(tensor)
            if len(parts) == len(self.parts):
                del pending[prefix]
                yield f"{prefix}.weight", self._dequantize(parts)
        if pending:
            prefix, parts = next(iter(pending.items()))
            raise ConfigError(
                f"{self.name} checkpoint: {prefix} has only {', '.join(sorted(parts))} "
                f"(needs {', '.join(self.parts)})"
            )


@register_quantization_config
class GPTQConfig(_DequantizedConfig):
    """GPTQ checkpoints (`quant_method: gptq`; AutoGPTQ, GPTQModel, Optimum), 2, 4 or 8
    bits, any group size, `desc_act` orders included (module docstring)."""

    name = "gptq"
    OPTIONAL = ("g_idx",)

    def __init__(
        self, bits: int = 4, group_size: int = -1, desc_act: bool = False, zero_offset: int = 1
    ) -> None:
        # With desc_act the channels' groups come from g_idx; else they are runs.
        super().__init__(group_size, *(("g_idx",) if desc_act else ()))
        self.bits = bits
        self.zero_offset = zero_offset

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        bits = config.get("bits", 4)
        if bits not in (2, 4, 8):
            raise ConfigError(f"GPTQ with {bits}-bit weights is not implemented (2, 4 or 8)")
        fmt = config.get("checkpoint_format") or config.get("format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ConfigError(f"GPTQ checkpoint_format {fmt!r} is not implemented (gptq, gptq_v2)")
        desc_act = bool(config.get("desc_act", False))
        return cls(int(bits), _group_size(config, "GPTQ"), desc_act, 1 if fmt == "gptq" else 0)

    def _dequantize(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return gptq_dequantize(
            parts["qweight"],
            parts["qzeros"],
            parts["scales"],
            parts.get("g_idx"),
            self.bits,
            self.group_size,
            self.zero_offset,
        )


@register_quantization_config
class AWQConfig(_DequantizedConfig):
    """AWQ checkpoints (`quant_method: awq`; AutoAWQ's "gemm" layout), 4 bits with zero
    points (module docstring)."""

    name = "awq"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        bits = config.get("bits", config.get("w_bit", 4))
        if bits != 4:
            raise ConfigError(f"AWQ with {bits}-bit weights is not implemented (4)")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(f"AWQ version {version!r} is not implemented (gemm)")
        if not config.get("zero_point", True):
            raise ConfigError("AWQ without zero points is not implemented")
        return cls(_group_size(config, "AWQ"))

    def _dequantize(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return awq_dequantize(parts["qweight"], parts["qzeros"], parts["scales"], self.group_size)


def _group_size(config: dict[str, Any], what: str) -> int:
    size = config.get("group_size", config.get("q_group_size", -1))
    if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
        raise ConfigError(f"{what} group_size must be a positive integer or -1, got {size!r}")
    return size


def pack_quantized_dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shape: torch.Tensor,
    bits: int,
    group_size: int,
    zero_point: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """A compressed-tensors pack-quantized layer's weight `[N, K]` float32 (module
    docstring); `group_size` -1 for one scale a row (channel)."""
    n, k = (int(v) for v in shape.flatten().tolist())
    q = unpack_int32(packed, bits, dim=1)[:, :k]
    if zero_point is None:
        zeros = torch.full((n, scale.shape[1]), 1 << (bits - 1), dtype=torch.int32)
    else:
        zeros = unpack_int32(zero_point, bits, dim=0)[:n]
    g = _groups(k, group_size) if g_idx is None else g_idx.to(torch.int64)
    return (q - zeros[:, g]).to(torch.float32) * scale[:, g].to(torch.float32)


class CompressedTensorsIntConfig(_DequantizedConfig):
    """compressed-tensors' integer weight-only groups ("pack-quantized", 4 or 8 bits, group
    or channel scales, symmetric or with zero points, actorder "group" with its g_idx): made
    by `CompressedTensorsConfig.from_config` for such a checkpoint (module docstring)."""

    name = "compressed-tensors"
    PARTS = ("weight_packed", "weight_scale", "weight_shape")
    OPTIONAL = ("weight_g_idx",)

    def __init__(self, bits: int, group_size: int, symmetric: bool, group_order: bool) -> None:
        needed = (() if symmetric else ("weight_zero_point",)) + (
            ("weight_g_idx",) if group_order else ()
        )
        super().__init__(group_size, *needed)
        self.bits = bits

    @classmethod
    def from_spec(cls, group: str, weights: dict[str, Any]) -> CompressedTensorsIntConfig:
        """From one config group's `weights` (type int): ConfigError naming what is not
        implemented."""
        bits = weights.get("num_bits")
        if bits not in (4, 8):
            raise ConfigError(
                f"compressed-tensors group {group!r}: int {bits}-bit weights are not "
                "implemented (4 or 8)"
            )
        strategy = weights.get("strategy")
        if strategy not in ("group", "channel") or weights.get("dynamic"):
            raise ConfigError(
                f"compressed-tensors group {group!r}: int weight strategy {strategy!r} is not "
                "implemented (group, channel)"
            )
        size = weights.get("group_size") if strategy == "group" else -1
        if strategy == "group" and (not isinstance(size, int) or size < 1):
            raise ConfigError(f"compressed-tensors group {group!r}: group_size {size!r}")
        actorder = weights.get("actorder")
        if actorder not in (None, "group", "weight", "static", "dynamic"):
            raise ConfigError(f"compressed-tensors group {group!r}: actorder {actorder!r}")
        symmetric = bool(weights.get("symmetric", True))
        return cls(int(bits), int(size), symmetric, actorder == "group")

    def _dequantize(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return pack_quantized_dequantize(
            parts["weight_packed"],
            parts["weight_scale"],
            parts["weight_shape"],
            self.bits,
            self.group_size,
            parts.get("weight_zero_point"),
            parts.get("weight_g_idx"),
        )
