"""The engine's configuration: one small frozen dataclass per concern, each engine flag declared
once on its field, resolved once.

    flags, LLM(**kwargs) --> EngineArgs (flat, tandem.engine_args) --create_engine_config()-->
        EngineConfig: model, cache, scheduler, parallel, device, ...  (resolved by
        tandem.loader.resolve)

- Every user-settable field of the config classes below is a field of `EngineArgs` (generated
  from them: there is no second list). A field whose metadata carries a `Flag` is a command-line
  flag; `add_engine_args` builds every entry point's parser from those declarations, and
  `engine_argv` turns values back into flags for a child process (the launcher's workers).
- Resolution happens once, in `tandem.loader.resolve.resolve_engine_config` (which
  `create_engine_config` and the engine call): the model path is resolved (converting GGUF
  once), the HF config is loaded once, and `max_model_len` is decided once (the model's
  `max_position_embeddings`, or the user's value checked against it), then copied into
  `SchedulerConfig.max_model_len`. Everything downstream reads `config.model.hf_config` /
  `config.model.max_model_len`; nothing loads or patches them. This module is plain data and
  flags: it imports no other part of tandem.
- Nothing here imports torch at module level (tandem.core imports this module), nor reads the
  environment except where a caller builds a parser (`add_engine_args(environ=...)`).
- An `EngineConfig`, resolved or not, pickles (it is sent to an engine child process).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

DEFAULT_MODEL = "default"
Dtype = Literal["float32", "float16", "bfloat16", "auto"]
# The KV cache's dtype: the model's ("auto"), another float dtype, or FP8 e4m3 ("fp8" and
# "fp8_e4m3" name the same, as in vLLM).
KVCacheDtype = Literal["auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3"]
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")


class ConfigError(ValueError):
    """Raised for an invalid engine configuration; the message names the setting."""


def default_cache_dir() -> Path:
    """Where converted models are kept (callers may pass TANDEM_CACHE_DIR instead)."""
    return Path.home() / ".cache" / "tandem"


# ----------------------------------------------------------------------------- flag declarations


@dataclass(frozen=True)
class Flag:
    """How one config field appears on the command line.

    The flag is `--<field-name-with-dashes>` unless `name` says otherwise. Its type, choices
    (from a `Literal`) and default come from the field. A bool field is a pair
    `--x` / `--no-x`; `false_aliases` are further flags that set it False. A `tuple[int, ...]`
    field takes one or more values. `env` names an environment variable whose value, when set,
    is the flag's default (read only where a caller builds a parser)."""

    help: str
    name: str = ""
    aliases: tuple[str, ...] = ()
    false_aliases: tuple[str, ...] = ()
    env: str = ""
    type: Callable[[str], Any] | None = None


def flag(help: str, **kwargs: Any) -> dict[str, Any]:
    """Field metadata declaring a flag: `field(default=..., metadata=flag("help", ...))`."""
    return {"flag": Flag(help, **kwargs)}


# Field metadata of values filled in by resolution (not settable, not flags).
_RESOLVED: dict[str, Any] = {"resolved": True}


def device_arg(value: str) -> str:
    """argparse type of --device: "auto" | "cpu" | "cuda" | "cuda:<index>"."""
    try:
        parse_device(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def parse_device(device: str) -> tuple[str, int | None]:
    """A device name -> (kind, GPU index or None); names: auto, cpu, cuda, cuda:<index>.
    Raises ConfigError for anything else."""
    kind, sep, index = device.partition(":")
    if not sep and kind in ("auto", "cpu", "cuda"):
        return kind, None
    if kind == "cuda" and index.isascii() and index.isdigit():  # no sign, no spaces
        return kind, int(index)
    raise ConfigError(f"device must be auto, cpu, cuda or cuda:<index>, got {device!r}")


# ----------------------------------------------------------------------------- the configs


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run and how.

    `model` is a Hugging Face folder, a `.gguf` file, a named random-weight shape
    (`random:llama-3.2-1b`) or "default" (the embedded SmolLM2-135M-Instruct).
    `max_model_len` 0 means "from the model's config" until resolution decides it.
    After resolution (`resolve_engine_config`): `model_path` is the local HF folder,
    `hf_config` its loaded config and `max_model_len` the context every part of the engine
    uses.
    """

    model: str = field(
        default=DEFAULT_MODEL,
        metadata=flag("HF folder, .gguf file, random:<shape>, or 'default' (SmolLM2-135M)"),
    )
    dtype: Dtype = field(
        default="auto",
        metadata=flag(
            "weight and activation dtype (auto: bfloat16 on CUDA and on CPUs with avx512_bf16 "
            "or AMX, else float32)",
            env="TANDEM_DTYPE",
        ),
    )
    max_model_len: int = field(
        default=0,
        metadata=flag(
            "context length (0: the model's max_position_embeddings); 128k is 128,000 and "
            "128K 131,072 (vLLM's forms)",
            type=lambda v: human_int_arg(v),
        ),
    )
    seed: int = 0
    skip_tokenizer_init: bool = field(
        default=False,
        metadata=flag("load no tokenizer: prompts must be token ids (text prompts are refused)"),
    )
    cache_dir: str = field(
        default="",
        metadata=flag(
            "where converted models are kept ('': ~/.cache/tandem)", env="TANDEM_CACHE_DIR"
        ),
    )
    generation_config: str = field(
        default="auto",
        metadata=flag(
            "default sampling parameters (vLLM's flag): auto, the model folder's "
            "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty) "
            "for requests that leave them out; vllm, none; or another folder's"
        ),
    )
    hf_overrides: str = field(
        default="",
        metadata=flag(
            "a JSON object of fields set on the model's Hugging Face config after it loads "
            '(vLLM\'s flag), e.g. \'{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, '
            '"original_max_position_embeddings": 32768}}\'',
            type=lambda v: hf_overrides_arg(v),
        ),
    )
    model_path: Path | None = field(default=None, metadata=_RESOLVED)
    hf_config: Any = field(default=None, compare=False, repr=False, metadata=_RESOLVED)

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("model must not be empty")
        if isinstance(self.hf_overrides, Mapping):  # LLM(hf_overrides={...})
            object.__setattr__(self, "hf_overrides", json.dumps(dict(self.hf_overrides)))
        self.overrides  # noqa: B018  (a bad JSON object is refused here)
        if self.dtype not in ("float32", "float16", "bfloat16", "auto"):
            raise ConfigError(f"dtype must be float32, float16, bfloat16 or auto, got {self.dtype}")
        if self.max_model_len < 0:
            raise ConfigError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if not -(2**63) <= self.seed < 2**63:
            raise ConfigError(f"seed must be in [-2**63, 2**63), got {self.seed}")

    @property
    def is_resolved(self) -> bool:
        return self.hf_config is not None

    @property
    def overrides(self) -> dict[str, Any]:
        """`hf_overrides` parsed (empty for none); ConfigError when it is not a JSON object."""
        if not self.hf_overrides.strip():
            return {}
        try:
            value = json.loads(self.hf_overrides)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"hf_overrides is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"hf_overrides must be a JSON object, got {type(value).__name__}")
        return value


# A count with a suffix, as vLLM's flags take them: lowercase decimal, uppercase binary.
_COUNT_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_human_int(value: str) -> int:
    """`"4096"`, `"128k"` (128,000), `"128K"` (131,072), `"1.5m"`, ... as an int; ValueError
    naming the value for anything else (a fraction of one is refused)."""
    text = value.strip()
    scale = _COUNT_SUFFIXES.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    try:
        amount = float(number) * scale if scale != 1 else int(number)
    except ValueError:
        raise ValueError(f"{value!r} is not a count (e.g. 4096, 128k, 128K)") from None
    if amount != int(amount):
        raise ValueError(f"{value!r} is not a whole number")
    return int(amount)


def human_int_arg(value: str) -> int:
    """argparse type of a count flag (`parse_human_int`)."""
    try:
        return parse_human_int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def hf_overrides_arg(value: str) -> str:
    """argparse type of --hf-overrides: a JSON object, checked when flags are read."""
    try:
        ModelConfig(hf_overrides=value).overrides  # noqa: B018
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    `num_gpu_blocks` 0 means "size from memory": `kv_cache_memory_gb` on the CPU, the
    `gpu_memory_utilization` fraction on CUDA after weights and a profiling pass.
    """

    block_size: int = field(default=16, metadata=flag("tokens per KV block (a power of two)"))
    num_gpu_blocks: int = field(
        default=0,
        metadata=flag("KV blocks (0: size from memory)", aliases=("--num-gpu-blocks-override",)),
    )
    kv_cache_memory_gb: float = field(
        default=1.0, metadata=flag("KV cache size on the CPU, in GB (with --num-gpu-blocks 0)")
    )
    gpu_memory_utilization: float = field(
        default=0.90,
        metadata=flag("fraction of GPU memory for weights, activations and the KV cache"),
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata=flag(
            "reuse cached KV blocks of equal prefixes", false_aliases=("--no-prefix-caching",)
        ),
    )
    disable_hybrid_kv_cache_manager: bool = field(
        default=False,
        metadata=flag(
            "keep every layer's KV blocks in one group: sliding-window layers then hold the "
            "whole context's blocks (default: a group per attention kind, sliding groups free "
            "the blocks left of their window)"
        ),
    )
    kv_cache_dtype: KVCacheDtype = field(
        default="auto",
        metadata=flag(
            "KV cache dtype (auto: --dtype; fp8 / fp8_e4m3: e4m3 with the checkpoint's "
            "per-tensor k_scale / v_scale, else 1.0; a GPU of compute capability >= 8.9)"
        ),
    )

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
        if self.kv_cache_dtype not in typing.get_args(KVCacheDtype):
            raise ConfigError(
                "kv_cache_dtype must be one of " + ", ".join(typing.get_args(KVCacheDtype)) + ", "
                f"got {self.kv_cache_dtype}"
            )

    @property
    def is_fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype in FP8_KV_CACHE_DTYPES


@dataclass(frozen=True)
class SchedulerConfig:
    """Step-level scheduling: a token budget per step and a cap on running sequences."""

    max_num_batched_tokens: int = field(default=2048, metadata=flag("token budget of one step"))
    max_num_seqs: int = field(default=256, metadata=flag("most requests running at once"))
    policy: Literal["fcfs", "priority"] = field(
        default="fcfs", metadata=flag("waiting-queue order", aliases=("--scheduling-policy",))
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata=flag("split long prompts over steps under the token budget")
    )
    # The most prompt tokens one request is given in one step (vLLM's flag of that name), so a
    # long prompt leaves the rest of the step's budget to the requests queued behind it.
    # 0: no cap beyond the step's budget. Without chunked prefill it does nothing.
    long_prefill_token_threshold: int = field(
        default=0,
        metadata=flag("most prompt tokens of one request per step (0: the whole step budget)"),
    )
    # Plan step N+1 while the device runs step N (the tokens step N samples feed step N+1 on
    # the device). "auto": on for CUDA, where the host's planning then hides behind the GPU,
    # and under pipeline parallel, where the second step in flight keeps the stages busy.
    # "late": as "on", but step N+1 is planned shortly before step N is predicted to end
    # rather than when it starts, so a request that arrives while step N runs joins N+1
    # (tandem.engine.late_plan; in an engine-core process, which takes commands meanwhile).
    async_scheduling: Literal["auto", "on", "off", "late"] = field(
        default="auto",
        metadata=flag(
            "plan step N+1 while the device runs step N (auto: on for CUDA and for pipeline "
            "parallel; late: as on, planned shortly before step N is predicted to end, so "
            "requests that arrive meanwhile join step N+1)"
        ),
    )
    # Filled in from the resolved ModelConfig (0 = unknown yet).
    max_model_len: int = field(default=0, metadata=_RESOLVED)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(
                "long_prefill_token_threshold must be >= 0, got "
                f"{self.long_prefill_token_threshold}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(f"policy must be fcfs or priority, got {self.policy}")
        if self.async_scheduling not in ("auto", "on", "off", "late"):
            raise ConfigError(
                f"async_scheduling must be auto, on, off or late, got {self.async_scheduling}"
            )
        if (
            not self.enable_chunked_prefill
            and self.max_model_len
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ConfigError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """How one engine spreads over devices and hosts: `tensor_parallel_size` x
    `pipeline_parallel_size` ranks (vLLM's rank order: `tandem.distributed`), each a worker
    process of a `MultiprocExecutor` when there is more than one (or when asked for).

    Several hosts: every host runs `nnodes`' share of the ranks; the engine runs on the host of
    `node_rank` 0, which serves the c10d rendezvous at `master_addr:master_port`; the others run
    `tandem rank-host` with the same flags and their own `--node-rank` (see
    `tandem.executor.multiproc`). `check_model` refuses a split the model cannot take, before
    anything is loaded."""

    tensor_parallel_size: int = field(
        default=1,
        metadata=flag(
            "tensor-parallel ranks (each holds a slice of every layer)", aliases=("-tp",)
        ),
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata=flag("pipeline-parallel stages (each holds a run of layers)", aliases=("-pp",)),
    )
    distributed_executor_backend: Literal["auto", "uni", "mp"] = field(
        default="auto",
        metadata=flag(
            "uni: one rank in the engine's process; mp: one worker process per rank "
            "(auto: mp when there are several ranks, else uni)"
        ),
    )
    nnodes: int = field(default=1, metadata=flag("hosts the ranks span"))
    node_rank: int = field(default=0, metadata=flag("this host's index (0: the engine's)"))
    master_addr: str = field(
        default="127.0.0.1",
        metadata=flag("address of the c10d rendezvous (the engine's host) that every rank meets"),
    )
    master_port: int = field(
        default=0, metadata=flag("port of the c10d rendezvous (0: a free one, one host only)")
    )
    enable_expert_parallel: bool = field(
        default=False,
        metadata=flag(
            "MoE layers: spread the experts whole over the ranks (all-to-all dispatch) instead "
            "of splitting each expert over tensor parallel",
            aliases=("-ep",),
        ),
    )

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            size = getattr(self, name)
            if size < 1:
                raise ConfigError(f"{name} must be >= 1, got {size}")
        if self.distributed_executor_backend not in ("auto", "uni", "mp"):
            raise ConfigError(
                "distributed_executor_backend must be auto, uni or mp, "
                f"got {self.distributed_executor_backend}"
            )
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ConfigError(
                f"distributed_executor_backend uni runs one rank; tensor_parallel_size x "
                f"pipeline_parallel_size is {self.world_size} (use mp)"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank {self.node_rank} outside [0, nnodes={self.nnodes})")
        if self.world_size % self.nnodes:
            raise ConfigError(
                f"{self.world_size} ranks do not split evenly over nnodes {self.nnodes}"
            )
        if self.nnodes > 1 and self.master_port == 0:
            raise ConfigError("several hosts (nnodes > 1) need --master-port to meet at")
        if not 0 <= self.master_port < 65536:
            raise ConfigError(f"master_port {self.master_port} is not a port")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def uses_multiproc(self) -> bool:
        backend = self.distributed_executor_backend
        return backend == "mp" or (backend == "auto" and self.world_size > 1)

    def check_model(self, hf_config: Any) -> None:
        """Raise ConfigError when the model cannot be split this way: attention heads, KV
        heads (unless replicated: the ranks a multiple of them) or the MLP width not divisible
        by the TP size, or more pipeline stages than layers. The vocabulary is padded to a
        multiple of the TP size (as vLLM pads it), so any size splits."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        text = getattr(hf_config, "text_config", None) or hf_config
        heads = int(getattr(text, "num_attention_heads", 0) or 0)
        kv_heads = int(getattr(text, "num_key_value_heads", 0) or heads)
        layers = int(getattr(text, "num_hidden_layers", 0) or 0)
        inter = int(getattr(text, "intermediate_size", 0) or 0)
        if heads and heads % tp:
            raise ConfigError(
                f"num_attention_heads {heads} is not divisible by tensor_parallel_size {tp}"
            )
        if kv_heads and kv_heads % tp and tp % kv_heads:
            raise ConfigError(
                f"num_key_value_heads {kv_heads} and tensor_parallel_size {tp}: neither divides "
                "the other (KV heads are split, or replicated when the ranks outnumber them)"
            )
        if inter and inter % tp:
            raise ConfigError(
                f"intermediate_size {inter} is not divisible by tensor_parallel_size {tp}"
            )
        if layers and pp > layers:
            raise ConfigError(f"pipeline_parallel_size {pp} exceeds the model's {layers} layers")


def world_size_from_argv(argv: Iterable[str]) -> int:
    """TP x PP named by engine flags on a command line (1 where they are absent): what a
    launcher or a container entry point needs to know before it places a worker."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    ns, _ = p.parse_known_args(list(argv))
    return max(ns.tensor_parallel_size, 1) * max(ns.pipeline_parallel_size, 1)


_CUDA_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
_CUDA_GRAPH_SIZES += (320, 384, 448, 512, 640, 768, 896, 1024)
# Token counts of mixed steps captured piecewise (above the largest: eager, device-bound).
_PIECEWISE_GRAPH_SIZES = (16, 32, 64, 128, 256, 384, 512, 768, 1024)


def parse_core_list(text: str) -> tuple[int, ...]:
    """`0-3,8` -> (0, 1, 2, 3, 8): comma-separated cores and inclusive ranges, no repeats."""
    cores: list[int] = []
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if sep else int(lo)
            if first < 0 or last < first:
                raise ValueError(part)
            cores.extend(range(first, last + 1))
    except ValueError:
        msg = f"cpu_cores must be auto, all, none or a list like 0-3,8: {text!r}"
        raise ConfigError(msg) from None
    if len(set(cores)) != len(cores):
        raise ConfigError(f"cpu_cores lists a core twice: {text!r}")
    return tuple(cores)


# `--attention-backend` values -> the registered backend (tandem/layers/attention); vLLM's
# names are aliases.
ATTENTION_BACKEND_ALIASES: dict[str, str] = {
    "auto": "auto",
    "torch": "torch",
    "triton": "triton",
    "cpu": "cpu",
    "flashinfer": "flashinfer",
    "flash_attn": "flash_attn",
    "TRITON_ATTN": "triton",
    "FLASHINFER": "flashinfer",
    "FLASH_ATTN": "flash_attn",
}
# Optional backends: the modules any one of which provides it, what to install, and how.
_BACKEND_PACKAGES: dict[str, tuple[tuple[str, ...], str, str]] = {
    "flashinfer": (("flashinfer",), "flashinfer-python", "pip install 'tandem[flashinfer]'"),
    "flash_attn": (
        ("vllm_flash_attn", "vllm.vllm_flash_attn", "flash_attn"),
        "vllm-flash-attn (vLLM's build) or flash-attn",
        "install it",
    ),
}


def _module_present(name: str) -> bool:
    """Whether `name` can be imported, found without importing it (nor a parent package:
    `vllm.vllm_flash_attn` is looked for as a folder of an installed `vllm`)."""
    import importlib.util

    top, _, rest = name.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if not rest:
        return True
    roots = spec.submodule_search_locations or []
    return any((Path(root) / rest.replace(".", "/")).exists() for root in roots)


def attention_backend_name(value: str) -> str:
    """The registered backend `--attention-backend value` asks for ("auto" stays "auto").
    ConfigError for an unknown name, or an optional backend whose package is not installed
    (the message names the package)."""
    name = ATTENTION_BACKEND_ALIASES.get(value)
    if name is None:
        known = ", ".join(ATTENTION_BACKEND_ALIASES)
        raise ConfigError(f"attention_backend must be one of {known}; got {value!r}")
    if name in _BACKEND_PACKAGES:
        modules, package, how = _BACKEND_PACKAGES[name]
        if not any(_module_present(m) for m in modules):
            raise ConfigError(
                f"attention_backend {value} needs the {package} package, which is not "
                f"installed here (none of {', '.join(modules)} imports); {how} or pick "
                "TRITON_ATTN"
            )
    return name


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs and how it is compiled: "auto" (CUDA when present), "cpu", "cuda"
    (the current device, normally 0) or "cuda:<index>" (that GPU; the engine makes it current on
    its thread, and every GPU stays visible to the process, so other processes' GPUs can be
    reached)."""

    device: str = field(
        default="auto",
        metadata=flag(
            "auto | cpu | cuda | cuda:<index> (that GPU; every GPU stays visible)",
            type=device_arg,
        ),
    )
    attention_backend: Literal[
        "auto",
        "torch",
        "triton",
        "cpu",
        "flashinfer",
        "flash_attn",
        "TRITON_ATTN",
        "FLASHINFER",
        "FLASH_ATTN",
    ] = field(
        default="auto",
        metadata=flag(
            "attention implementation (auto: triton on CUDA, the fastest measured, ahead of "
            "FLASHINFER at every prefill and decode shape of benchmarks/attention_kernels.py; "
            "on CPUs cpu, the C++ kernels, when they build, else torch). vLLM's names: "
            "TRITON_ATTN (= triton), FLASHINFER (flashinfer-python), FLASH_ATTN "
            "(vllm-flash-attn or flash-attn); those two only where their package is installed"
        ),
    )
    enforce_eager: bool = field(default=False, metadata=flag("no CUDA graphs"))
    enable_pdl: bool = field(
        default=False,
        metadata=flag(
            "CUDA compute capability 9.0+: launch the decode chain's Triton kernels (RMSNorm, "
            "W8A16 GEMV, rotary, KV write, decode attention) with programmatic dependent "
            "launch, each starting while the one before finishes (tandem_kernels.pdl)"
        ),
    )
    cuda_graph_sizes: tuple[int, ...] = field(
        default=_CUDA_GRAPH_SIZES, metadata=flag("decode batch sizes captured as CUDA graphs")
    )
    cudagraph_mode: Literal["full_decode_only", "full_and_piecewise", "full"] = field(
        default="full",
        metadata=flag(
            "full_decode_only: decode steps as whole graphs, mixed steps eager; "
            "full_and_piecewise: mixed steps too, as graphs between eager attention calls; "
            "full: mixed steps as whole graphs too (attention backends that can: triton; "
            "else as full_and_piecewise)"
        ),
    )
    piecewise_cuda_graph_sizes: tuple[int, ...] = field(
        default=_PIECEWISE_GRAPH_SIZES,
        metadata=flag(
            "token counts of mixed steps captured as CUDA graphs (piecewise or full, "
            "by --cudagraph-mode)"
        ),
    )
    num_threads: int = field(default=0, metadata=flag("torch intra-op threads (0: torch's)"))
    cpu_cores: str = field(
        default="auto",
        metadata=flag(
            "CPU engine: cores its threads are bound to, one thread each, e.g. 0-3,8 "
            "(all: the cores this process may use; none: unbound; auto: all in an engine "
            "process, none for an engine on the caller's thread); --num-threads caps the count"
        ),
    )
    cpu_gemm: Literal["auto", "torch", "mkl", "onednn", "panel"] = field(
        default="auto",
        metadata=flag(
            "CPU engine: the GEMM of the linear layers (auto: a fixed rule by dtype, shape "
            "and CPU, the same in every process: float32 decode batches on tandem's AVX-512 "
            "panel kernel, prefill and bf16 on onednn; or force torch, mkl, onednn or panel)"
        ),
    )
    cpu_adaptive_threads: bool = field(
        default=True,
        metadata=flag(
            "CPU engine: before each step, run on as many threads as other processes leave "
            "cores free (all, bound, on a quiet machine; fewer, unbound, on a busy one)"
        ),
    )

    def __post_init__(self) -> None:
        parse_device(self.device)
        attention_backend_name(self.attention_backend)
        if self.num_threads < 0:
            raise ConfigError(f"num_threads must be >= 0 (0: torch's), got {self.num_threads}")
        if self.cpu_gemm not in ("auto", "torch", "mkl", "onednn", "panel"):
            raise ConfigError(
                f"cpu_gemm must be auto, torch, mkl, onednn or panel, got {self.cpu_gemm}"
            )
        if self.cpu_cores not in ("auto", "all", "none"):
            parse_core_list(self.cpu_cores)
        if any(s < 1 for s in self.cuda_graph_sizes):
            raise ConfigError("cuda_graph_sizes must be positive")
        if self.cudagraph_mode not in ("full_decode_only", "full_and_piecewise", "full"):
            raise ConfigError(
                "cudagraph_mode must be full_decode_only, full_and_piecewise or full, "
                f"got {self.cudagraph_mode}"
            )
        if any(s < 1 for s in self.piecewise_cuda_graph_sizes):
            raise ConfigError("piecewise_cuda_graph_sizes must be positive")

    @property
    def device_index(self) -> int | None:
        """The GPU index of "cuda:<index>"; None for any other device."""
        return parse_device(self.device)[1]

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


SpecMethod = Literal["ngram", "draft_model", "eagle", "replay"]
_SPEC_METHODS = ("ngram", "draft_model", "eagle", "replay")
# Methods vLLM has that are declared in the issue but not built yet: refused by name.
_SPEC_METHODS_LATER = ("eagle3", "medusa", "mlp_speculator")
# The most draft tokens per request per step (1 + k query tokens are verified at once).
MAX_NUM_SPECULATIVE_TOKENS = 16
SPECULATION_RULES = ("measured", "always")


def speculative_config_arg(value: str) -> str:
    """argparse type of --speculative-config: a JSON object (or '' for none), checked here so
    a bad one is refused when flags are read."""
    try:
        SpeculativeConfig(speculative_config=value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts up to `num_speculative_tokens` (k) tokens per
    request, the target verifies 1 + k query tokens in one step and a rejection sampler keeps
    the target's distribution (`tandem.spec_decode`).

    Set as one JSON object, vLLM's shape: `--speculative-config '{"method": "ngram",
    "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'`, or
    `LLM(speculative_config={...})` (a dict). The object's keys are parsed into the fields
    below (which may also be given directly); unknown keys, an unknown method, k out of
    [1, MAX_NUM_SPECULATIVE_TOKENS] and a bad n-gram window are ConfigErrors naming them.

    - `ngram`: prompt lookup on the host; the last n tokens (n from `prompt_lookup_max` down
      to `prompt_lookup_min`) are looked up earlier in the request, and the k tokens that
      followed their latest earlier occurrence are the draft.
    - `draft_model`: a second small model (`model`, any registered architecture) run by the
      target's workers, k greedy steps per engine step; its vocabulary must be the target's
      (checked by `resolve_engine_config`); `draft_tensor_parallel_size`, if given, must be
      the target's (the draft runs on the target's ranks).
    - `eagle`: an EAGLE-1 head for a Llama-family target (`model`: the head's folder in its
      HF layout: `fc` over [token embedding, target hidden state], one decoder layer; the
      target's embedding and LM head unless the head has its own), fed the target's hidden
      states (tandem.spec_decode.eagle).
    - `replay` (benchmarks only): proposes the continuation recorded in `replay_path` (JSON:
      a list of {"prompt_token_ids": [...], "output_token_ids": [...]}) for a request with
      that prompt, keeping each draft token with probability `replay_acceptance` (a token not
      kept is replaced by a wrong one), so acceptance is controlled on random weights.

    Below `disable_by_batch_size` (vLLM's hard cap), `speculation_rule` decides each step's
    drafts: "measured" (tandem.core.spec_decode_rule) or "always".
    """

    speculative_config: str = field(
        default="",
        metadata=flag(
            "speculative decoding as a JSON object, e.g. "
            '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\' '
            "(methods: ngram, draft_model, eagle, replay)",
            type=speculative_config_arg,
        ),
    )
    method: SpecMethod | None = field(default=None, metadata=_RESOLVED)
    num_speculative_tokens: int = field(default=0, metadata=_RESOLVED)
    prompt_lookup_min: int = field(default=0, metadata=_RESOLVED)
    prompt_lookup_max: int = field(default=0, metadata=_RESOLVED)
    model: str = field(default="", metadata=_RESOLVED)
    # vLLM's name; a draft runs with the target's TP, so only that value (or 0: unset) is taken.
    draft_tensor_parallel_size: int = field(default=0, metadata=_RESOLVED)
    replay_path: str = field(default="", metadata=_RESOLVED)
    replay_acceptance: float = field(default=1.0, metadata=_RESOLVED)
    replay_seed: int = field(default=0, metadata=_RESOLVED)
    # No drafts while this many requests or more run (0: always speculate): at large batches
    # the step is compute-bound and verifying drafts costs more than it saves. Steps without
    # drafts take the decode CUDA graphs as usual.
    disable_by_batch_size: int = field(default=0, metadata=_RESOLVED)
    # How many drafts each step takes below that cap: "measured" decides per step, 0..k,
    # from the measured step times and acceptance (tandem.core.spec_decode_rule); "always"
    # takes every proposed draft (up to k). Greedy output is the same either way; a seeded
    # request sampled at temperature > 0 draws its randomness per verified row, so its tokens
    # reproduce run to run only under "always" (measured choices follow timing).
    speculation_rule: str = field(default="measured", metadata=_RESOLVED)

    def __post_init__(self) -> None:
        raw: Any = self.speculative_config
        if isinstance(raw, str) and raw.strip():
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config is not valid JSON: {exc}") from None
        if isinstance(raw, Mapping):
            self._take(dict(raw))
        elif raw not in ("", None):
            raise ConfigError(f"speculative_config must be a JSON object, got {type(raw).__name__}")
        if self.method is None:
            return
        if self.method not in _SPEC_METHODS:
            later = " (not supported yet)" if self.method in _SPEC_METHODS_LATER else ""
            raise ConfigError(
                f"speculative_config: unknown method {self.method!r}{later}; "
                f"methods: {', '.join(_SPEC_METHODS)}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"speculative_config: num_speculative_tokens must be in "
                f"[1, {MAX_NUM_SPECULATIVE_TOKENS}], got {k!r}"
            )
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo < 1 or hi < lo:
                raise ConfigError(
                    "speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, "
                    f"got {lo} and {hi}"
                )
        if not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 0:
            raise ConfigError(
                "speculative_config: disable_by_batch_size must be an integer >= 0, "
                f"got {self.disable_by_batch_size!r}"
            )
        if self.speculation_rule not in SPECULATION_RULES:
            raise ConfigError(
                f"speculative_config: speculation_rule must be one of {list(SPECULATION_RULES)}, "
                f"got {self.speculation_rule!r}"
            )
        if self.method in ("draft_model", "eagle") and not self.model:
            raise ConfigError(f'speculative_config: method "{self.method}" needs "model"')
        if self.method == "replay":
            if not self.replay_path:
                raise ConfigError('speculative_config: method "replay" needs "replay_path"')
            if not 0.0 <= self.replay_acceptance <= 1.0:
                raise ConfigError(
                    "speculative_config: replay_acceptance must be in [0, 1], "
                    f"got {self.replay_acceptance}"
                )

    def _take(self, values: dict[str, Any]) -> None:
        """Set the fields from a parsed JSON object (frozen: through object.__setattr__)."""
        known = {f.name for f in dataclasses.fields(self)} - {"speculative_config"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unknown keys {unknown}")
        if "method" not in values:
            raise ConfigError('speculative_config needs "method"')
        # The flag's value, canonical: a dict and its JSON text give equal configs.
        canonical = json.dumps(values, sort_keys=True)
        if values["method"] == "ngram":
            lo, hi = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
            # vLLM's defaults: one bound alone sets both; neither gives 5.
            values["prompt_lookup_min"] = lo if lo is not None else (hi if hi else 5)
            values["prompt_lookup_max"] = hi if hi is not None else values["prompt_lookup_min"]
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "speculative_config", canonical)

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def k(self) -> int:
        """Draft tokens per request per step (0 without speculation)."""
        return self.num_speculative_tokens if self.method is not None else 0


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Structured outputs (`tandem.structured_output`): grammars compiled by xgrammar on a
    thread pool, cached by spec, applied as token bitmasks in the sampler."""

    disable_any_whitespace: bool = field(
        default=False,
        metadata=flag("JSON outputs without free whitespace between their tokens"),
    )
    compile_timeout_s: float = field(
        default=30.0,
        metadata=flag(
            "seconds a grammar may take to compile before its request fails (0: no limit)",
            name="--structured-outputs-compile-timeout",
        ),
    )
    compile_threads: int = field(
        default=2,
        metadata=flag(
            "threads compiling grammars",
            name="--structured-outputs-compile-threads",
        ),
    )
    bitmask_threads: int = field(
        default=0,
        metadata=flag(
            "threads filling a step's grammar bitmasks (0: one below 64 rows, else up to 8)",
            name="--structured-outputs-bitmask-threads",
        ),
    )
    grammar_cache_size: int = field(
        default=256,
        metadata=flag(
            "compiled grammars kept, by spec (least recently used evicted)",
            name="--structured-outputs-cache-size",
        ),
    )

    def __post_init__(self) -> None:
        if self.compile_timeout_s < 0:
            raise ConfigError(f"compile_timeout_s must be >= 0, got {self.compile_timeout_s}")
        if self.compile_threads < 1:
            raise ConfigError(f"compile_threads must be >= 1, got {self.compile_threads}")
        if self.bitmask_threads < 0:
            raise ConfigError(f"bitmask_threads must be >= 0, got {self.bitmask_threads}")
        if self.grammar_cache_size < 1:
            raise ConfigError(f"grammar_cache_size must be >= 1, got {self.grammar_cache_size}")


@dataclass(frozen=True)
class SamplerConfig:
    """The sampler (`tandem.layers.sampler`): custom batch-level logits processors
    (`tandem.layers.logits_processors.LogitsProcessor` subclasses), applied after the built-in
    ones (logit_bias, allowed_token_ids, bad_words) to every step's sampling rows."""

    logits_processors: tuple[str | type, ...] = field(
        default=(),
        metadata=flag(
            "custom logits processors, each module:Class (a LogitsProcessor subclass)",
            type=str,
        ),
    )

    def __post_init__(self) -> None:
        specs = self.logits_processors
        if isinstance(specs, str | type):
            specs = (specs,)
        specs = tuple(specs)
        for spec in specs:
            if isinstance(spec, str):
                if not spec.strip(". :") or spec.count(":") > 1:
                    raise ConfigError(f"logits_processors: {spec!r} is not module:Class")
            elif not isinstance(spec, type):
                raise ConfigError(
                    f"logits_processors: {spec!r} is neither a class nor a module:Class string"
                )
        object.__setattr__(self, "logits_processors", specs)


# `--quantization` values: methods applied at load, and the names of stored formats (which
# only load checkpoints of that format; "auto" takes whatever the checkpoint says).
QuantizationMethod = Literal[
    "auto", "fp8", "ptpc_fp8", "modelopt", "compressed-tensors", "fbgemm_fp8", "gptq", "awq"
]  # fmt: skip
QUANTIZATION_METHODS: tuple[str, ...] = typing.get_args(QuantizationMethod)


@dataclass(frozen=True)
class QuantizationConfig:
    """Weight / activation quantization (tandem.layers.quantization).

    `quantization`: the method applied at load to an unquantized checkpoint, vLLM's names:
    `fp8` (per-tensor weight scales, dynamic per-tensor activation scales), `ptpc_fp8`
    (per-channel weights, dynamic per-token activations). A checkpoint that is quantized
    already (its config's `quantization_config`, or ModelOpt's `hf_quant_config.json`) is
    loaded as stored; "auto" (or None) takes that, or runs unquantized; `modelopt`,
    `compressed-tensors`, `fbgemm_fp8`, `gptq` and `awq` name the stored format the
    checkpoint must have (GPTQ and AWQ load dequantized to the model's dtype). FP8 needs a
    GPU of compute capability 8.9 or above.
    """

    quantization: QuantizationMethod = field(
        default="auto",
        metadata=flag(
            "fp8 | ptpc_fp8: quantize the weights at load; modelopt | compressed-tensors | "
            "fbgemm_fp8 | gptq | awq: the checkpoint's stored format (auto: the checkpoint's "
            "own scheme, if any)",
            aliases=("-q",),
        ),
    )

    def __post_init__(self) -> None:
        if self.quantization is None:  # vLLM's spelling of "none asked for"
            object.__setattr__(self, "quantization", "auto")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                f"got {self.quantization}"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Every config of one engine. Build it with `EngineArgs.create_engine_config()` (resolved);
    an engine given an unresolved one resolves it itself (`resolve_engine_config` is
    idempotent)."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)

    @property
    def is_resolved(self) -> bool:
        return self.model.is_resolved


# The sections of EngineConfig whose user-settable fields make up EngineArgs, in flag order.
ENGINE_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "device": DeviceConfig,
    "speculative": SpeculativeConfig,
    "structured_outputs": StructuredOutputsConfig,
    "quantization": QuantizationConfig,
    "sampler": SamplerConfig,
}


def settable_fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.init and not f.metadata.get("resolved")]


# ----------------------------------------------------------------------------- argparse


@dataclass(frozen=True)
class EngineFlag:
    """One engine flag as declared: its field, the type hint and the declaration."""

    dest: str
    hint: Any
    default: Any
    flag: Flag

    @property
    def option(self) -> str:
        return self.flag.name or "--" + self.dest.replace("_", "-")

    @property
    def is_bool(self) -> bool:
        return self.hint is bool

    @property
    def is_tuple(self) -> bool:
        return typing.get_origin(self.hint) is tuple


def engine_flags() -> list[EngineFlag]:
    """Every engine flag, in declaration order (the one definition every parser uses)."""
    flags = []
    for cls in ENGINE_SECTIONS.values():
        hints = typing.get_type_hints(cls)
        for f in settable_fields(cls):
            declared = f.metadata.get("flag")
            if declared is not None:
                flags.append(EngineFlag(f.name, hints[f.name], f.default, declared))
    return flags


# Engine defaults of the served entry points (`tandem serve`, the worker services, `tandem
# bench serve --launch`) where they differ from the fields' defaults, which stay the offline
# `LLM`'s. Those parsers take these as their defaults (`add_engine_args(defaults=...)`) and a
# launcher forwards a value to its workers only where it differs from them (`engine_argv`).
#
# max_num_batched_tokens 8,192 is vLLM's serving budget. Issue 30's runs on one H200 (vllm bench
# serve's workload, 5-25 req/s and all at once): at 8,192 against 2,048, tandem's TPOT p50 went
# from 1.0-1.08x vLLM's to 0.88-0.97x and its TTFT p99 at 25 req/s from 1.85x to 0.87x. Half
# of it loses too (one H100, session 35, the same prompts back to back: at 4,096 TPOT p50
# +3-12% and TTFT p99 1.6-1.9x at 15 and 25 req/s, 1.6% fewer tokens/s all at once;
# serving_budget{4096,8192}_h100_2026-12-07_s35.json). The offline `LLM` keeps 2,048
# (SchedulerConfig's default).
#
# long_prefill_token_threshold 2,048: a prompt longer than that takes at most 2,048 tokens of a
# step, so the short requests queued behind it prefill in the same steps. Issue 30's
# long-context load on one H100 (session 24, 120 requests at 4 req/s, 12 of them 9.8k-30.6k
# tokens; serving_long_context_h100_2026-12-06_s24_thr2048.json against session 23's run at 0):
# the short requests' TTFT p99 1,229 -> 452 ms (p50 56.7 -> 59.1), their TPOT p50/p99
# 9.8/33.5 -> 10.0/33.6 ms, the long prompts' TTFT p50/p99 887/1,492 -> 989/1,691 ms. Prompts
# of 2,048 tokens or fewer (issue 30's served table: 500-1,500) are scheduled as before.
SERVING_ENGINE_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {"max_num_batched_tokens": 8192, "long_prefill_token_threshold": 2048}
)


def add_engine_args(
    parser: argparse.ArgumentParser,
    environ: Mapping[str, str] | None = None,
    only: Iterable[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add every engine flag, as an "engine" argument group, to `parser`. Defaults are the
    fields' defaults (or `defaults[name]` where given: SERVING_ENGINE_DEFAULTS for the served
    entry points), or the declared environment variable's value in `environ` (default:
    this process's environment; call this where flags are read, in a `__main__`).

    `only`: the field names of the flags to add (a service that needs a few engine values,
    e.g. the frontend's model for its tokenizer), declared here all the same. A caller that
    wants other defaults sets them after this (`parser.set_defaults`)."""
    env = os.environ if environ is None else environ
    flags = engine_flags()
    if only is not None:
        wanted = set(only)
        unknown = wanted - {ef.dest for ef in flags}
        if unknown:
            raise ValueError(f"no engine flags for {sorted(unknown)}")
        flags = [ef for ef in flags if ef.dest in wanted]
    group = parser.add_argument_group("engine")
    overrides = defaults or {}
    for ef in flags:
        declared = overrides.get(ef.dest, ef.default)
        default = declared
        if ef.flag.env and env.get(ef.flag.env):
            default = env[ef.flag.env]
        names = [ef.option, *ef.flag.aliases]
        help_text = f"{ef.flag.help} (default: {_show(declared)})"
        if ef.is_bool:
            group.add_argument(
                *names,
                dest=ef.dest,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=ef.flag.help,
            )
            for alias in ef.flag.false_aliases:
                group.add_argument(
                    alias, dest=ef.dest, action="store_false", help=f"same as --no-{ef.option[2:]}"
                )
        elif ef.is_tuple:
            (item,) = {a for a in typing.get_args(ef.hint) if a is not Ellipsis}
            group.add_argument(
                *names,
                dest=ef.dest,
                nargs="+",
                type=ef.flag.type or item,
                default=default,
                help=help_text,
            )
        else:
            choices, kind = _choices_and_type(ef.hint)
            group.add_argument(
                *names,
                dest=ef.dest,
                type=ef.flag.type or kind,
                choices=choices,
                default=default,
                help=help_text,
            )


def engine_kwargs_from(ns: argparse.Namespace) -> dict[str, Any]:
    """EngineArgs keyword arguments from a namespace parsed with `add_engine_args`, every flag's
    value but `model` (callers pass `model=` themselves)."""
    kwargs: dict[str, Any] = {}
    for ef in engine_flags():
        if ef.dest == "model":
            continue
        value = getattr(ns, ef.dest)
        kwargs[ef.dest] = tuple(value) if ef.is_tuple else value
    return kwargs


def engine_argv(
    values: Any,
    exclude: Iterable[str] = ("model",),
    defaults: Mapping[str, Any] | None = None,
) -> list[str]:
    """Command-line arguments that give a child process these engine `values` (an
    `EngineArgs`, a parsed namespace or a mapping): one flag for each
    value that differs from the child's default (a launcher forwarding its flags to workers):
    its field's default, or `defaults[name]` where given (the child's parser got the same
    `defaults`)."""
    get: Callable[[str], Any] = (
        values.__getitem__ if isinstance(values, Mapping) else lambda n: getattr(values, n)
    )
    skip = set(exclude)
    argv: list[str] = []
    for ef in engine_flags():
        if ef.dest in skip:
            continue
        value = get(ef.dest)
        if ef.is_tuple:
            value = tuple(value)
        if value == (defaults or {}).get(ef.dest, ef.default):
            continue
        if isinstance(value, Mapping):  # a JSON-object flag given as a dict (LLM kwargs)
            value = json.dumps(value)
        if ef.is_bool:
            argv.append(ef.option if value else "--no-" + ef.option[2:])
        elif ef.is_tuple:
            argv += [ef.option, *map(_flag_value, value)]
        else:
            argv += [ef.option, str(value)]
    return argv


def _choices_and_type(hint: Any) -> tuple[list[str] | None, Callable[[str], Any]]:
    if typing.get_origin(hint) is Literal:
        return [str(a) for a in typing.get_args(hint)], str
    if hint in (int, float, str):
        return None, hint
    raise TypeError(f"no flag type for {hint!r}")


def _flag_value(value: Any) -> str:
    """A tuple flag's item on a command line (a class as its `module:Class`)."""
    if isinstance(value, type):
        return f"{value.__module__}:{value.__qualname__}"
    return str(value)


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value)) if len(value) <= 8 else f"{len(value)} sizes"
    return repr(value) if value == "" else str(value)
