"""A small, fast reader for GGUF files: metadata, the tensor table, and tensors as numpy.

The file is memory-mapped; metadata is parsed with `struct` in one pass (string arrays such as
the vocabulary are only decoded when asked for), and a tensor's bytes are only touched when it
is dequantized. Dequantization itself is the `gguf` package's.

Layout (GGUF v2/v3, little endian)::

    "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x (key: string, value_type u32, value)
    tensor_count x (name: string, n_dims u32, dims u64 x n_dims (fastest first), type u32,
                    offset u64 from the data section)
    padding to `general.alignment` (default 32) | tensor data
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Metadata value types.
_STRING, _ARRAY = 8, 9
_SCALAR_FORMATS = {
    0: "B",  # uint8
    1: "b",  # int8
    2: "H",  # uint16
    3: "h",  # int16
    4: "I",  # uint32
    5: "i",  # int32
    6: "f",  # float32
    7: "?",  # bool
    10: "Q",  # uint64
    11: "q",  # int64
    12: "d",  # float64
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands; the message names the file."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's entry in the table. `shape` is in numpy/torch order (slowest first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute, in bytes from the start of the file
    nbytes: int


class GGUFFile:
    """A parsed GGUF file.

    `metadata` maps keys to Python values; string arrays not named in `string_arrays` are
    kept as their element count (an int) so parsing stays cheap.
    """

    def __init__(self, path: str | Path, string_arrays: Container[str] = ()) -> None:
        self.path = Path(path)
        self._blob = np.memmap(self.path, mode="r", dtype=np.uint8)
        blob = self._blob
        if bytes(blob[:4]) != GGUF_MAGIC:
            raise GGUFFormatError(f"{self.path} is not a GGUF file (bad magic bytes)")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
        if version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {version} is not supported")
        self.version = version
        pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key, pos = _read_string(blob, pos)
            (value_type,) = struct.unpack_from("<I", blob, pos)
            metadata[key], pos = _read_value(blob, pos + 4, value_type, key in string_arrays)
        self.metadata = metadata

        raw_infos = []
        for _ in range(tensor_count):
            name, pos = _read_string(blob, pos)
            (n_dims,) = struct.unpack_from("<I", blob, pos)
            pos += 4
            dims = struct.unpack_from(f"<{n_dims}Q", blob, pos)
            pos += 8 * n_dims
            ggml_type, offset = struct.unpack_from("<IQ", blob, pos)
            pos += 12
            raw_infos.append((name, tuple(reversed(dims)), ggml_type, offset))

        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        self.data_start = (pos + alignment - 1) // alignment * alignment
        self.header_size = pos
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, ggml_type, offset in raw_infos:
            self.tensors[name] = GGUFTensorInfo(
                name=name,
                shape=shape,
                ggml_type=ggml_type,
                offset=self.data_start + offset,
                nbytes=_tensor_nbytes(shape, ggml_type, self.path),
            )
        end = max((t.offset + t.nbytes for t in self.tensors.values()), default=self.data_start)
        if end > blob.shape[0]:
            raise GGUFFormatError(f"{self.path} is truncated: tensors end past the file")

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes, shaped as `gguf.quants.dequantize` expects (no copy)."""
        from gguf.constants import GGML_QUANT_SIZES

        info = self.tensors[name]
        data = self._blob[info.offset : info.offset + info.nbytes]
        block_size, type_size = GGML_QUANT_SIZES[_quant_type(info.ggml_type, self.path)]
        row_bytes = info.shape[-1] // block_size * type_size
        return data.reshape(*info.shape[:-1], row_bytes)

    def dequantize(self, name: str) -> torch.Tensor:
        """The tensor as a new float32 torch tensor in its stored shape (torch order).

        F32/F16/BF16, Q8_0, Q4_0 and Q4_1 are decoded with torch (several times faster than
        numpy, same bits: the float ops are the same, in the same order); every other type
        goes through `gguf.quants.dequantize`.
        """
        info = self.tensors[name]
        raw = self.raw(name)
        fast = _TORCH_DEQUANT.get(info.ggml_type)
        if fast is not None:
            blocks = torch.from_numpy(np.array(raw, copy=True)).reshape(-1, raw.shape[-1])
            return fast(blocks).reshape(info.shape)
        from gguf.quants import dequantize

        out = dequantize(raw, _quant_type(info.ggml_type, self.path))
        return torch.from_numpy(np.asarray(out, dtype=np.float32).copy()).reshape(info.shape)


# ggml type ids with a torch decoder below.
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_BF16 = 0, 1, 2, 3, 8, 30


def _f16_column(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # A block's byte j holds element j in its low nibble and element j + 16 in its high one.
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _dequant_q4_0(rows: torch.Tensor) -> torch.Tensor:
    blocks = rows.reshape(-1, 18)
    d = _f16_column(blocks, 0)
    q = (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()
    return d * q


def _dequant_q4_1(rows: torch.Tensor) -> torch.Tensor:
    blocks = rows.reshape(-1, 20)
    d = _f16_column(blocks, 0)
    m = _f16_column(blocks, 2)
    q = _nibbles(blocks[:, 4:]).float()
    return d * q + m


def _dequant_q8_0(rows: torch.Tensor) -> torch.Tensor:
    blocks = rows.reshape(-1, 34)
    d = _f16_column(blocks, 0)
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return q * d


_TORCH_DEQUANT: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    GGML_F32: lambda rows: rows.contiguous().view(torch.float32),
    GGML_F16: lambda rows: rows.contiguous().view(torch.float16).float(),
    GGML_BF16: lambda rows: rows.contiguous().view(torch.bfloat16).float(),
    GGML_Q4_0: _dequant_q4_0,
    GGML_Q4_1: _dequant_q4_1,
    GGML_Q8_0: _dequant_q8_0,
}


def _quant_type(ggml_type: int, path: Path) -> Any:
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type)
    except ValueError:
        raise GGUFFormatError(f"{path}: unknown ggml tensor type {ggml_type}") from None


def _tensor_nbytes(shape: tuple[int, ...], ggml_type: int, path: Path) -> int:
    from gguf.constants import GGML_QUANT_SIZES

    block_size, type_size = GGML_QUANT_SIZES[_quant_type(ggml_type, path)]
    n = int(np.prod(shape, dtype=np.int64))
    if shape and shape[-1] % block_size:
        raise GGUFFormatError(f"{path}: a row of {shape[-1]} is not a whole number of blocks")
    return n // block_size * type_size


def _read_string(blob: np.ndarray, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    pos += 8
    return bytes(blob[pos : pos + length]).decode("utf-8", errors="replace"), pos + length


def _read_value(
    blob: np.ndarray, pos: int, value_type: int, decode_strings: bool
) -> tuple[Any, int]:
    if value_type in _SCALAR_FORMATS:
        fmt = "<" + _SCALAR_FORMATS[value_type]
        (value,) = struct.unpack_from(fmt, blob, pos)
        return value, pos + struct.calcsize(fmt)
    if value_type == _STRING:
        return _read_string(blob, pos)
    if value_type == _ARRAY:
        element_type, count = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        if element_type in _SCALAR_FORMATS:
            fmt = f"<{count}{_SCALAR_FORMATS[element_type]}"
            return list(struct.unpack_from(fmt, blob, pos)), pos + struct.calcsize(fmt)
        if element_type == _STRING:
            if decode_strings:
                values = []
                for _ in range(count):
                    value, pos = _read_string(blob, pos)
                    values.append(value)
                return values, pos
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", blob, pos)
                pos += 8 + length
            return count, pos
        values = []
        for _ in range(count):
            value, pos = _read_value(blob, pos, element_type, decode_strings)
            values.append(value)
        return values, pos
    raise GGUFFormatError(f"unknown GGUF metadata value type {value_type}")
