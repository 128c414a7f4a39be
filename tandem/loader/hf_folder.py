"""Reading a local Hugging Face model folder: config, tokenizer, eos ids, weights.

Everything is local: nothing here ever asks the hub.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# ModelOpt's file naming a checkpoint's quantization when config.json does not.
MODELOPT_QUANT_CONFIG = "hf_quant_config.json"


def load_hf_config(path: str | Path) -> Any:
    """The folder's `transformers` config (a `PretrainedConfig`). A ModelOpt export whose
    scheme is only in `hf_quant_config.json` gets it as `quantization_config` (`quant_method`
    "modelopt": tandem.layers.quantization.modelopt)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    modelopt = Path(path) / MODELOPT_QUANT_CONFIG
    if modelopt.is_file() and not getattr(config, "quantization_config", None):
        stored = json.loads(modelopt.read_text())
        config.quantization_config = {"quant_method": "modelopt", **stored}
    return config


def apply_hf_overrides(hf_config: Any, overrides: dict[str, Any]) -> Any:
    """`hf_config` with each field of `overrides` set (vLLM's `--hf-overrides`). A
    `rope_scaling` override also becomes the `rope_parameters` of a transformers v5 config
    (with its rope_theta kept), which is what the model reads."""
    for key, value in overrides.items():
        old = getattr(hf_config, "rope_parameters", None)
        v5_rope = isinstance(old, dict) and "rope_theta" in old
        if key == "rope_scaling" and isinstance(value, dict) and v5_rope:
            # a v5 config: its rope_parameters, theta kept
            params = {**value, "rope_theta": value.get("rope_theta") or old["rope_theta"]}
            params["rope_type"] = params.get("rope_type", params.get("type", "default"))
            hf_config.rope_parameters = params
            continue
        setattr(hf_config, key, dict(value) if isinstance(value, dict) else value)
    return hf_config


# generation_config.json's sampling fields that become a model's default sampling parameters
# (vLLM's `--generation-config auto`); SamplingParams' names. `max_new_tokens` becomes
# `max_tokens`: the served API takes it as a cap on every request's output (vLLM's rule).
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model_path: str | Path, generation_config: str = "auto") -> dict[str, Any]:
    """The default sampling parameters a model's requests get where they leave a field out:
    the sampling fields of `generation_config.json` in the model folder ("auto") or in the
    folder `generation_config` names; none for "vllm" or a folder without the file. Its
    `max_new_tokens` comes as `max_tokens`. A value of the wrong type is a ValueError naming
    the field."""
    if generation_config == "vllm":
        return {}
    folder = Path(model_path) if generation_config == "auto" else Path(generation_config)
    if generation_config != "auto" and not folder.is_dir():
        raise ValueError(f"generation_config {generation_config!r} is not a folder")
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    stored = json.loads(path.read_text())
    out: dict[str, Any] = {}
    for name in SAMPLING_DEFAULT_FIELDS:
        value = stored.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{path}: {name} {value!r} is not a number")
        out[name] = int(value) if name == "top_k" else float(value)
    max_new = stored.get("max_new_tokens")
    if max_new is not None:
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"{path}: max_new_tokens {max_new!r} is not a positive integer")
        out["max_tokens"] = max_new
    return out


# Files of which a folder's tokenizer loads (any one of them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class TokenizerNotFoundError(ValueError):
    """The model folder has no tokenizer; the one-line message says what makes one."""


def has_tokenizer_files(path: str | Path) -> bool:
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(path: str | Path) -> Any:
    """The folder's fast tokenizer. A random-weight folder (`random:<shape>`) gets the
    stand-in id tokenizer (tandem.loader.id_tokenizer) made on first use; any other folder
    without tokenizer files is a TokenizerNotFoundError naming the fixes."""
    from transformers import AutoTokenizer

    from tandem.models.presets import has_random_weights

    path = Path(path)
    if has_random_weights(path) and not has_tokenizer_files(path):
        from tandem.loader.id_tokenizer import write_id_tokenizer

        write_id_tokenizer(path, int(load_hf_config(path).vocab_size))
    if not has_tokenizer_files(path):
        raise TokenizerNotFoundError(
            f"{path} has no tokenizer ({', '.join(TOKENIZER_FILES)}): copy the model's "
            "tokenizer files into it, or run with --skip-tokenizer-init and token-id prompts"
        )
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def get_eos_token_ids(path: str | Path, use_tokenizer: bool = True) -> list[int]:
    """Token ids that end generation, in order, without repeats.

    From generation_config.json, then config.json; the tokenizer's eos token only when
    neither names any (and `use_tokenizer`; else none).
    """
    path = Path(path)
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if file.is_file():
            with open(file) as f:
                ids += _as_id_list(json.load(f).get("eos_token_id"))
    if not ids and use_tokenizer and has_tokenizer_files(path):
        tokenizer = load_tokenizer(path)
        ids = _as_id_list(tokenizer.eos_token_id)
    return list(dict.fromkeys(ids))


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def iterate_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's `*.safetensors` files, as (Hugging Face name, CPU tensor).

    Each yielded tensor owns fresh memory (the caller may keep it as a parameter). Tensors are
    read in file order with `readinto`, which is several times faster here than copying out
    of a memory map page by page.
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weight files")
    for file in files:
        yield from _read_safetensors(file)


class SafetensorsSlice:
    """One tensor of a safetensors file, not read yet (tandem.layers.weight_utils's
    CheckpointTensor): `narrow(0, ...)` reads just those rows (one contiguous read), a narrow
    on another dim reads only the strips it keeps (through safetensors' own slicing), `load()`
    the whole tensor. A rank's weight loaders narrow to its shard, so it reads only that."""

    def __init__(
        self, file: Path, name: str, dtype: torch.dtype, shape: list[int], data_offset: int
    ) -> None:
        self.file = file
        self.name = name
        self.dtype = dtype
        self.shape = torch.Size(shape)
        self.data_offset = data_offset  # from the file's start
        self.element_size = torch.empty((), dtype=dtype).element_size()

    def dim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"SafetensorsSlice({self.file.name}:{self.name}, {tuple(self.shape)}, {self.dtype})"

    def load(self) -> torch.Tensor:
        return self._read_rows(0, self.shape[0]) if self.shape else self._read_scalar()

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim = dim % len(self.shape)
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise ValueError(
                f"{self.name}: [{start}, {start + length}) is outside dim {dim} of "
                f"{tuple(self.shape)}"
            )
        if dim == 0:
            return self._read_rows(start, length)
        from safetensors import safe_open

        index = (*[slice(None)] * dim, slice(start, start + length))
        with safe_open(str(self.file), framework="pt", device="cpu") as f:
            return f.get_slice(self.name)[index].contiguous()

    def _read_rows(self, start: int, length: int) -> torch.Tensor:
        tensor = torch.empty((length, *self.shape[1:]), dtype=self.dtype)
        row_bytes = self.shape[1:].numel() * self.element_size
        nbytes = length * row_bytes
        if nbytes:
            with open(self.file, "rb") as f:
                f.seek(self.data_offset + start * row_bytes)
                view = memoryview(tensor.view(-1).view(torch.uint8).numpy())
                if f.readinto(view) != nbytes:
                    raise ValueError(f"{self.file} is truncated at tensor {self.name}")
        return tensor

    def _read_scalar(self) -> torch.Tensor:
        tensor = torch.empty((), dtype=self.dtype)
        with open(self.file, "rb") as f:
            f.seek(self.data_offset)
            view = memoryview(tensor.view(1).view(torch.uint8).numpy())
            if f.readinto(view) != self.element_size:
                raise ValueError(f"{self.file} is truncated at tensor {self.name}")
        return tensor


def iterate_weight_slices(path: str | Path) -> Iterator[tuple[str, SafetensorsSlice]]:
    """Every tensor of the folder's `*.safetensors` files as a lazy `SafetensorsSlice`, in
    file order (only the headers are read here)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weight files")
    for file in files:
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        data_start = 8 + header_len
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            if info["dtype"] not in _SAFETENSORS_DTYPES:
                raise ValueError(f"{file}: tensor {name} has unsupported dtype {info['dtype']}")
            begin, end = info["data_offsets"]
            item = SafetensorsSlice(
                file, name, _SAFETENSORS_DTYPES[info["dtype"]], info["shape"], data_start + begin
            )
            if item.shape.numel() * item.element_size != end - begin:
                raise ValueError(f"{file}: tensor {name} has {end - begin} bytes")
            yield name, item


def _read_safetensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Layout: u64 header length N | N bytes of JSON {name: {dtype, shape, data_offsets}} | data."""
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        if any(info["dtype"] not in _SAFETENSORS_DTYPES for info in header.values()):
            yield from _read_safetensors_generic(file)
            return
        data_start = 8 + header_len
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            begin, end = info["data_offsets"]
            tensor = torch.empty(info["shape"], dtype=_SAFETENSORS_DTYPES[info["dtype"]])
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes != end - begin:
                raise ValueError(
                    f"{file}: tensor {name} has {end - begin} bytes, expected {nbytes}"
                )
            if nbytes:
                f.seek(data_start + begin)
                view = memoryview(tensor.view(-1).view(torch.uint8).numpy())
                if f.readinto(view) != nbytes:
                    raise ValueError(f"{file} is truncated at tensor {name}")
            yield name, tensor


def _read_safetensors_generic(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            yield name, f.get_tensor(name).clone()
