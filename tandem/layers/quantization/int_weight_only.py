"""GPTQ, AWQ and compressed-tensors pack-quantized checkpoints (integer weights, 16-bit
activations): kept quantized for a CUDA kernel, or dequantized as they load.

Each stores each quantized linear layer as three or four tensors in place of its `weight`:

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

Each layer's set of tensors is turned, as they stream in (`map_checkpoint`), into one of two
forms, chosen by the device (`for_device`):

    dequantized (the CPU; and on CUDA the schemes the kernel does not serve, logged)
          weight             [N, K] float32, then the model's dtype: every later step is the
                             unquantized model's (the memory of a 16-bit checkpoint)
    kept quantized (CUDA: `keep_quantized`; tandem_kernels.int_w4a16's layout)
          weight             uint8 [N, K * bits / 8]  4 bits: two values a byte along K, even
                             k in the low nibble; 8 bits: one a byte
          weight_scale       [N, G]                   (the model's dtype once loaded)
          weight_zero_point  [N, G]  float            the real zero points (GPTQ's offset
                                                      added, 2^(bits-1) for symmetric ones)
          W[n, k] = weight_scale[n, k // group_size] * (q[n, k] - weight_zero_point[n, ...])
          input_perm         int32 [K]  act-order checkpoints only (GPTQ `desc_act`,
                                        compressed-tensors actorder "group"): the input
                                        channels sorted by their g_idx group
                                        (`act_order_perm`); the values' columns are stored
                                        in that order, so the groups are runs again, and the
                                        layer gathers its input the same way:
                                        y = x[:, perm] @ W[:, perm]^T = x @ W^T

The quantized form shards as any `[out, in]` weight does (int_linear.IntWeightLinearMethod:
rows for column-parallel and fused layers, K columns and their groups for row-parallel ones).
The kernel path takes 4 and 8 bits in runs of `group_size` channels (a multiple of 32, or
one group), and act orders through `input_perm`: one order a layer, so the parts of a fused
layer (q, k, v; gate, up) must share it, as GPTQ's do (their order comes from their shared
input), else a ConfigError names them. A row-parallel layer of an act-order checkpoint
under tensor parallelism is dequantized at load (`dequantized_prefixes`): a rank holds a
slice of the original channel order, whose groups are not whole on any rank. 2-bit GPTQ,
group sizes the kernel cannot tile and GPTQ checkpoints that name their quantized modules
(`modules_in_block_to_quantize`, `dynamic`) stay dequantized on CUDA too, with a log line
naming why; so do mixture-of-experts experts (the fused MoE kernel has no integer form) and
a quantized LM head (a vocabulary layer).

Layers stored unquantized (GPTQ's unlisted modules, AWQ's `modules_to_not_convert`,
compressed-tensors' `ignore`, the LM head) load as they are. Refused by name: 3-bit GPTQ
(values across int32 words), AWQ other than "gemm" and AWQ without zero points.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from tandem.config import ConfigError
from tandem.layers.quantization.base import (
    QuantizationConfig,
    QuantizeMethodBase,
    is_ignored_layer,
    register_quantization_config,
)
from tandem.layers.weight_utils import LoadedWeight, full_weight

logger = logging.getLogger(__name__)

# AutoAWQ's "gemm" packing: slot i of an int32 holds column `AWQ_PACK_ORDER[i]` of its eight.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Layers dequantized on every device: a mixture-of-experts layer's expert
# (`...experts.<i>.<proj>`: the fused MoE kernel has no integer form) and a quantized LM head
# (GPTQModel's `lm_head: true`; the LM head is a vocabulary layer, not a linear one).
_ALWAYS_DEQUANTIZED = re.compile(r"\.experts\.\d+\.[^.]+$|(^|\.)lm_head$")


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


def act_order_perm(g_idx: torch.Tensor, group_size: int, what: str) -> torch.Tensor:
    """The input channels sorted by their group, stably (int64 `[K]`): `W[:, perm]` has its
    groups in runs of `group_size` (-1: one group) in group order, the layout the kernel
    reads. ConfigError naming `what` where the groups are not runs once sorted (a group with
    more or fewer than `group_size` channels)."""
    g = g_idx.reshape(-1).to(torch.int64)
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], _groups(g.numel(), group_size)):
        raise ConfigError(
            f"{what}: its g_idx does not give every group {group_size} input channels "
            "(an act order the integer kernel cannot take)"
        )
    return perm


class IntWeight(NamedTuple):
    """One layer's integer weight as every format's is read: `values` int32 `[N, K]`,
    `scale` `[N, G]` as stored, `zero` int32 `[N, G]` (the real zero points)."""

    values: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantize(self, group_size: int, g_idx: torch.Tensor | None = None) -> torch.Tensor:
        """W `[N, K]` float32: `scale[n, g] * (values[n, k] - zero[n, g])` with `g` the
        channel's group, `g_idx[k]` or runs of `group_size` (-1: one group)."""
        k = self.values.shape[1]
        g = (_groups(k, group_size) if g_idx is None else g_idx).to(torch.int64)
        q = (self.values - self.zero[:, g]).to(torch.float32)
        return q * self.scale[:, g].to(torch.float32)


def gptq_int_weight(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    zero_offset: int,
) -> IntWeight:
    """A GPTQ layer's tensors as an `IntWeight` (module docstring); `zero_offset` 1 for the
    "gptq" format, 0 for "gptq_v2"."""
    q = unpack_int32(qweight, bits, dim=0)
    n = q.shape[1]
    zeros = unpack_int32(qzeros, bits, dim=1)[:, :n] + zero_offset
    return IntWeight(q.t(), scales.t(), zeros.t())


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
    weight = gptq_int_weight(qweight, qzeros, scales, bits, zero_offset)
    return weight.dequantize(group_size, g_idx).contiguous()


def awq_int_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> IntWeight:
    """An AWQ ("gemm") layer's tensors as an `IntWeight` (module docstring)."""
    order = torch.tensor(AWQ_PACK_ORDER)
    column_slot = torch.argsort(order)  # where column j of eight sits in its word

    def unpack(packed: torch.Tensor) -> torch.Tensor:
        values = unpack_int32(packed, 4, dim=1)
        rows, cols = values.shape
        return values.view(rows, cols // 8, 8)[:, :, column_slot].reshape(rows, cols)

    return IntWeight(unpack(qweight).t(), scales.t(), unpack(qzeros).t())


def awq_dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """An AWQ ("gemm") layer's weight `[N, K]` float32 (module docstring)."""
    return awq_int_weight(qweight, qzeros, scales).dequantize(group_size).contiguous()


def pack_quantized_int_weight(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shape: torch.Tensor,
    bits: int,
    zero_point: torch.Tensor | None = None,
) -> IntWeight:
    """A compressed-tensors pack-quantized layer's tensors as an `IntWeight` (module
    docstring); no `zero_point`: symmetric, the zero 2^(bits-1)."""
    n, k = (int(v) for v in shape.flatten().tolist())
    q = unpack_int32(packed, bits, dim=1)[:, :k]
    if zero_point is None:
        zeros = torch.full((n, scale.shape[1]), 1 << (bits - 1), dtype=torch.int32)
    else:
        zeros = unpack_int32(zero_point, bits, dim=0)[:n]
    return IntWeight(q, scale, zeros)


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
    weight = pack_quantized_int_weight(packed, scale, shape, bits, zero_point)
    return weight.dequantize(group_size, g_idx)


class _IntWeightConfig(QuantizationConfig):
    """Integer checkpoints: each layer's packed tensors, once all have come, as its
    dequantized `weight` (then the default, unquantized method), or with `keep_quantized`
    (`for_device` on CUDA) in the kernel's layout for `IntWeightLinearMethod`."""

    quantizes_at_load = False
    # The tensors that stand for one layer's weight; `self.parts` (these, and the optional
    # ones a config needs) are awaited, the other optional ones dropped.
    PARTS: ClassVar[tuple[str, ...]] = ("qweight", "qzeros", "scales")
    OPTIONAL: ClassVar[tuple[str, ...]] = ()

    def __init__(self, bits: int, group_size: int = -1, *needed: str) -> None:
        self.bits = bits
        self.group_size = group_size
        self.parts: tuple[str, ...] = self.PARTS + needed
        # Whether the layers keep their integer weights for the CUDA kernel (`for_device`).
        self.keep_quantized = False
        # Kept quantized, the layers this config still dequantizes at load (row-parallel
        # ranks of an act-order checkpoint, `get_quant_method`), by prefix.
        self.dequantized_prefixes: set[str] = set()

    @property
    def act_order(self) -> bool:
        """Whether each input channel's group comes from a stored g_idx (GPTQ `desc_act`,
        compressed-tensors actorder "group") rather than runs."""
        return any(part.endswith("g_idx") for part in self.parts)

    def _int_weight(self, parts: dict[str, torch.Tensor]) -> IntWeight:
        """A complete set of a layer's tensors as an `IntWeight`."""
        raise NotImplementedError

    def _g_idx(self, parts: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The channels' groups where the format stores them (None: runs)."""
        return None

    def kernel_refusal(self) -> str | None:
        """Why the CUDA kernel cannot serve this scheme (the layers then load dequantized
        there too), or None."""
        from tandem_kernels.int_w4a16 import unsupported

        return unsupported(self.bits, self.group_size)

    def is_ignored(self, prefix: str) -> bool:
        """Whether the checkpoint stores layer `prefix` unquantized (default: none)."""
        return False

    def for_device(self, device: torch.device) -> _IntWeightConfig:
        """On CUDA, where the kernel serves the scheme, a copy with `keep_quantized`; else
        this config (dequantized at load; on CUDA a log line says why)."""
        if device.type != "cuda":
            return self
        refusal = self.kernel_refusal()
        if refusal is not None:
            logger.info(
                "%s checkpoint: layers dequantized at load on %s: %s", self.name, device, refusal
            )
            return self
        kept = copy.copy(self)
        kept.keep_quantized = True
        kept.dequantized_prefixes = set()
        return kept

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from tandem.layers.linear import LinearBase, RowParallelLinear

        if not self.keep_quantized or not isinstance(layer, LinearBase) or self.is_ignored(prefix):
            return None  # dequantized, the LM head, embeddings and layers stored unquantized
        if self.act_order and isinstance(layer, RowParallelLinear) and layer.tp_size > 1:
            if not self.dequantized_prefixes:
                logger.info(
                    "%s checkpoint with an act order: row-parallel layers dequantized at load "
                    "under tensor parallelism (%s first); the others kept quantized",
                    self.name,
                    prefix,
                )
            self.dequantized_prefixes.add(prefix)
            return None
        from tandem.layers.quantization.int_linear import IntWeightLinearMethod

        return IntWeightLinearMethod(self.bits, self.group_size, act_order=self.act_order)

    def map_checkpoint(
        self, weights: Iterable[tuple[str, LoadedWeight]]
    ) -> Iterator[tuple[str, LoadedWeight]]:
        """Each layer's packed tensors, once all have come, as its dequantized `weight`, or
        (`keep_quantized`) as `weight`, `weight_scale` and `weight_zero_point` in the
        kernel's layout, and with an act order its `input_perm` (module docstring);
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
                weight = self._int_weight(parts)
                g_idx = self._g_idx(parts)
                if (
                    not self.keep_quantized
                    or _ALWAYS_DEQUANTIZED.search(prefix)
                    or prefix in self.dequantized_prefixes
                ):
                    yield f"{prefix}.weight", weight.dequantize(self.group_size, g_idx)
                    continue
                from tandem_kernels.int_w4a16 import pack_int_weight

                values = weight.values
                if g_idx is not None:
                    perm = act_order_perm(g_idx, self.group_size, f"{self.name} layer {prefix}")
                    values = values[:, perm]
                    yield f"{prefix}.input_perm", perm.to(torch.int32)
                yield f"{prefix}.weight", pack_int_weight(values, self.bits)
                yield f"{prefix}.weight_scale", weight.scale.contiguous()
                yield f"{prefix}.weight_zero_point", weight.zero.to(torch.float32).contiguous()
        if pending:
            prefix, parts = next(iter(pending.items()))
            raise ConfigError(
                f"{self.name} checkpoint: {prefix} has only {', '.join(sorted(parts))} "
                f"(needs {', '.join(self.parts)})"
            )


@register_quantization_config
class GPTQConfig(_IntWeightConfig):
    """GPTQ checkpoints (`quant_method: gptq`; AutoGPTQ, GPTQModel, Optimum), 2, 4 or 8
    bits, any group size, `desc_act` orders included (module docstring)."""

    name = "gptq"
    OPTIONAL = ("g_idx",)

    def __init__(
        self,
        bits: int = 4,
        group_size: int = -1,
        desc_act: bool = False,
        zero_offset: int = 1,
        names_modules: bool = False,
    ) -> None:
        # With desc_act the channels' groups come from g_idx; else they are runs.
        super().__init__(bits, group_size, *(("g_idx",) if desc_act else ()))
        self.desc_act = desc_act
        self.zero_offset = zero_offset
        # The checkpoint lists its quantized modules (`modules_in_block_to_quantize`,
        # `dynamic`), which this config does not read: dequantized on every device.
        self.names_modules = names_modules

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        bits = config.get("bits", 4)
        if bits not in (2, 4, 8):
            raise ConfigError(f"GPTQ with {bits}-bit weights is not implemented (2, 4 or 8)")
        fmt = config.get("checkpoint_format") or config.get("format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ConfigError(f"GPTQ checkpoint_format {fmt!r} is not implemented (gptq, gptq_v2)")
        desc_act = bool(config.get("desc_act", False))
        names_modules = bool(config.get("modules_in_block_to_quantize") or config.get("dynamic"))
        return cls(
            int(bits),
            _group_size(config, "GPTQ"),
            desc_act,
            1 if fmt == "gptq" else 0,
            names_modules,
        )

    def kernel_refusal(self) -> str | None:
        if self.names_modules:
            return "modules_in_block_to_quantize / dynamic lists are not read"
        return super().kernel_refusal()

    def _int_weight(self, parts: dict[str, torch.Tensor]) -> IntWeight:
        return gptq_int_weight(
            parts["qweight"], parts["qzeros"], parts["scales"], self.bits, self.zero_offset
        )

    def _g_idx(self, parts: dict[str, torch.Tensor]) -> torch.Tensor | None:
        return parts.get("g_idx")


@register_quantization_config
class AWQConfig(_IntWeightConfig):
    """AWQ checkpoints (`quant_method: awq`; AutoAWQ's "gemm" layout), 4 bits with zero
    points (module docstring)."""

    name = "awq"

    def __init__(self, group_size: int = -1, not_converted: tuple[str, ...] = ()) -> None:
        super().__init__(4, group_size)
        self.not_converted = tuple(not_converted)

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
        return cls(_group_size(config, "AWQ"), tuple(config.get("modules_to_not_convert") or ()))

    def is_ignored(self, prefix: str) -> bool:
        """AutoAWQ's `modules_to_not_convert`: a layer whose name contains an entry."""
        return any(name in prefix for name in self.not_converted)

    def _int_weight(self, parts: dict[str, torch.Tensor]) -> IntWeight:
        return awq_int_weight(parts["qweight"], parts["qzeros"], parts["scales"])


def _group_size(config: dict[str, Any], what: str) -> int:
    size = config.get("group_size", config.get("q_group_size", -1))
    if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
        raise ConfigError(f"{what} group_size must be a positive integer or -1, got {size!r}")
    return size


class CompressedTensorsIntConfig(_IntWeightConfig):
    """compressed-tensors' integer weight-only groups ("pack-quantized", 4 or 8 bits, group
    or channel scales, symmetric or with zero points, actorder "group" with its g_idx): made
    by `CompressedTensorsConfig.from_config` for such a checkpoint (module docstring)."""

    name = "compressed-tensors"
    PARTS = ("weight_packed", "weight_scale", "weight_shape")
    OPTIONAL = ("weight_g_idx",)

    def __init__(
        self,
        bits: int,
        group_size: int,
        symmetric: bool,
        group_order: bool,
        ignore: tuple[str, ...] = (),
    ) -> None:
        needed = (() if symmetric else ("weight_zero_point",)) + (
            ("weight_g_idx",) if group_order else ()
        )
        super().__init__(bits, group_size, *needed)
        self.group_order = group_order
        self.ignore = tuple(ignore)

    @classmethod
    def from_spec(
        cls, group: str, weights: dict[str, Any], ignore: tuple[str, ...] = ()
    ) -> CompressedTensorsIntConfig:
        """From one config group's `weights` (type int) and the checkpoint's `ignore` list:
        ConfigError naming what is not implemented."""
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
        return cls(int(bits), int(size), symmetric, actorder == "group", ignore)

    def is_ignored(self, prefix: str) -> bool:
        """The checkpoint's `ignore` list (names, `re:` patterns)."""
        return is_ignored_layer(prefix, self.ignore)

    def _int_weight(self, parts: dict[str, torch.Tensor]) -> IntWeight:
        return pack_quantized_int_weight(
            parts["weight_packed"],
            parts["weight_scale"],
            parts["weight_shape"],
            self.bits,
            parts.get("weight_zero_point"),
        )

    def _g_idx(self, parts: dict[str, torch.Tensor]) -> torch.Tensor | None:
        return parts.get("weight_g_idx")
