"""EngineArgs (flat, from the CLI or the offline API) -> one frozen config tree.

One small frozen dataclass per concern, each validated in `__post_init__`. Nothing here
reads the environment: callers (a service's `__main__`, the CLI, `LLM`) do that once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

DEFAULT_MODEL = "default"
Dtype = Literal["float32", "float16", "bfloat16", "auto"]


class ConfigError(ValueError):
    """Raised for an invalid engine configuration; the message names the setting."""


def default_cache_dir() -> Path:
    """Where converted models are kept (callers may pass TANDEM_CACHE_DIR instead)."""
    return Path.home() / ".cache" / "tandem"


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run and how.

    `model` is a Hugging Face folder, a `.gguf` file, a named random-weight shape
    (`random:llama-3.2-1b`) or "default" (the embedded SmolLM2-135M-Instruct).
    `max_model_len` 0 means "from the model's config".
    """

    model: str = DEFAULT_MODEL
    dtype: Dtype = "auto"
    max_model_len: int = 0
    seed: int = 0
    cache_dir: str = ""

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("model must not be empty")
        if self.dtype not in ("float32", "float16", "bfloat16", "auto"):
            raise ConfigError(f"dtype must be float32, float16, bfloat16 or auto, got {self.dtype}")
        if self.max_model_len < 0:
            raise ConfigError(f"max_model_len must be >= 0, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    `num_gpu_blocks` 0 means "size from memory": `kv_cache_memory_gb` on the CPU, the
    `gpu_memory_utilization` fraction on CUDA after weights and a profiling pass.
    """

    block_size: int = 16
    num_gpu_blocks: int = 0
    kv_cache_memory_gb: float = 1.0
    gpu_memory_utilization: float = 0.90
    enable_prefix_caching: bool = True
    kv_cache_dtype: Dtype = "auto"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_gpu_blocks < 0:
            raise ConfigError(f"num_gpu_blocks must be >= 0, got {self.num_gpu_blocks}")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory_gb <= 0:
            raise ConfigError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Step-level scheduling: a token budget per step and a cap on running sequences."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    policy: Literal["fcfs", "priority"] = "fcfs"
    enable_chunked_prefill: bool = True
    # Plan step N+1 while the device runs step N (the tokens step N samples feed step N+1 on
    # the device). "auto": on for CUDA, where the host's planning then hides behind the GPU.
    async_scheduling: Literal["auto", "on", "off"] = "auto"
    # Filled in from the model at engine build time (0 = unknown yet).
    max_model_len: int = 0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(f"policy must be fcfs or priority, got {self.policy}")
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ConfigError(
                f"async_scheduling must be auto, on or off, got {self.async_scheduling}"
            )
        if (
            not self.enable_chunked_prefill
            and self.max_model_len
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ConfigError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len"
            )


def parse_device(device: str) -> tuple[str, int | None]:
    """A device name -> (kind, GPU index or None); names: auto, cpu, cuda, cuda:<index>.
    Raises ConfigError for anything else."""
    kind, sep, index = device.partition(":")
    if not sep and kind in ("auto", "cpu", "cuda"):
        return kind, None
    if kind == "cuda" and index.isascii() and index.isdigit():  # no sign, no spaces
        return kind, int(index)
    raise ConfigError(f"device must be auto, cpu, cuda or cuda:<index>, got {device!r}")


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs: "auto" (CUDA when present), "cpu", "cuda" (the current device,
    normally 0) or "cuda:<index>" (that GPU; the engine makes it current on its thread, and
    every GPU stays visible to the process, so other processes' GPUs can be reached)."""

    device: str = "auto"
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] = (
        1,
        2,
        4,
        8,
        16,
        24,
        32,
        48,
        64,
        96,
        128,
        160,
        192,
        224,
        256,
        320,
        384,
        448,
        512,
        640,
        768,
        896,
        1024,
    )
    num_threads: int = 0

    def __post_init__(self) -> None:
        parse_device(self.device)
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ConfigError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend}"
            )
        if any(s < 1 for s in self.cuda_graph_sizes):
            raise ConfigError("cuda_graph_sizes must be positive")

    @property
    def device_index(self) -> int | None:
        """The GPU index of "cuda:<index>"; None for any other device."""
        return parse_device(self.device)[1]

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig


@dataclass
class EngineArgs:
    """Flat engine arguments, as the CLI and `LLM(...)` take them."""

    model: str = DEFAULT_MODEL
    dtype: Dtype = "auto"
    max_model_len: int = 0
    seed: int = 0
    cache_dir: str = ""
    block_size: int = 16
    num_gpu_blocks: int = 0
    kv_cache_memory_gb: float = 1.0
    gpu_memory_utilization: float = 0.90
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    policy: Literal["fcfs", "priority"] = "fcfs"
    enable_chunked_prefill: bool = True
    async_scheduling: Literal["auto", "on", "off"] = "auto"
    # "auto" | "cpu" | "cuda" | "cuda:<index>" (see DeviceConfig)
    device: str = "auto"
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    enforce_eager: bool = False
    num_threads: int = 0
    extra: dict[str, object] = field(default_factory=dict)

    def create_engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=ModelConfig(
                model=self.model,
                dtype=self.dtype,
                max_model_len=self.max_model_len,
                seed=self.seed,
                cache_dir=self.cache_dir,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                num_gpu_blocks=self.num_gpu_blocks,
                kv_cache_memory_gb=self.kv_cache_memory_gb,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                policy=self.policy,
                enable_chunked_prefill=self.enable_chunked_prefill,
                async_scheduling=self.async_scheduling,
            ),
            device=DeviceConfig(
                device=self.device,
                attention_backend=self.attention_backend,
                enforce_eager=self.enforce_eager,
                num_threads=self.num_threads,
            ),
        )

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}
