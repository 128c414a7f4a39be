"""The executor interface: what `EngineCore` asks of its workers.

    EngineCore ──> Executor ──> Worker (rank 0) ──> ModelRunner
                            └─> Worker (rank k) ──> ModelRunner      (MultiprocExecutor)

Every method but the properties is collective: the executor runs it on every worker and
answers with one value (rank 0's, or a reduction where ranks differ: the number of KV blocks
is the smallest any rank holds). `UniprocExecutor` runs one worker in the engine's thread; a
`MultiprocExecutor` with one process per rank implements the same interface.

Order: `determine_num_blocks` -> `initialize_kv_cache` -> steps (`execute_async`, ...) ->
`shutdown`. Steps are launched in order and a step's `result()` is called in launch order
(see `PendingStep`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tandem.config import EngineConfig
from tandem.core.kv_cache_spec import KVCacheSpec
from tandem.core.outputs import GrammarBitmaskSource, ModelRunnerOutput, SchedulerOutput
from tandem.worker.shared_kv import SharedKVCache, export_kv_cache

if TYPE_CHECKING:
    from tandem.worker.model_runner import ModelRunner


class LaunchedStep(Protocol):
    """A launched step (`PendingStep` in a rank's process, `RemoteStep` across processes):
    `result()` waits for its sampled ids; called once per step, in launch order."""

    def result(self) -> ModelRunnerOutput: ...


class Executor(ABC):
    """Drives an engine's workers; see the module docstring."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: Path,
        hf_config: Any,
        max_model_len: int,
        eos_token_id: int | None,
    ) -> None:
        self.config = config
        self.model_path = model_path
        self.hf_config = hf_config
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id

    # ----------------------------------------------------------------- what rank 0 is

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Rank 0's device."""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def kv_cache_spec(self) -> KVCacheSpec:
        """The KV cache's groups by attention kind (the same on every rank)."""

    @property
    @abstractmethod
    def kv_cache(self) -> torch.Tensor | None:
        """Rank 0's KV cache tensor (None before `initialize_kv_cache` and after `shutdown`)."""

    def export_kv_cache(self) -> SharedKVCache:
        """Rank 0's KV cache for another process of this host (see `tandem.worker.shared_kv`)."""
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("the executor holds no KV cache")
        return export_kv_cache(cache)

    def export_kv_caches(self) -> tuple[SharedKVCache, ...]:
        """Every rank's KV cache, in rank order, for another process of this host."""
        return (self.export_kv_cache(),)

    @property
    def model_runner(self) -> ModelRunner:
        """Rank 0's runner, where it lives in this process."""
        raise RuntimeError(f"{type(self).__name__} runs no model runner in this process")

    # ----------------------------------------------------------------- collective

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks every rank can hold (the smallest over ranks)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate every rank's cache, tune kernels on it, capture CUDA graphs."""

    @abstractmethod
    def execute_async(
        self,
        scheduler_output: SchedulerOutput,
        grammar_bitmask: GrammarBitmaskSource | None = None,
    ) -> LaunchedStep:
        """Launch one step on every rank; the result is rank 0's sampled tokens.
        `grammar_bitmask` (steps with structured rows) is called once the forward is
        launched, before sampling."""

    @abstractmethod
    def drop_requests(self, req_ids: set[str]) -> None:
        """Forget finished or preempted requests on every rank."""

    @abstractmethod
    def needs_prior_tokens(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether this step samples from whole outputs (see `ModelRunner`)."""

    @abstractmethod
    def may_write_blocks(self, block_ids: list[int]) -> bool:
        """Whether a launched step not known finished writes any of `block_ids`."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until every launched step finished on every rank's device."""

    @abstractmethod
    def take_expert_load(self) -> list[list[int]] | None:
        """Tokens routed to each expert of each MoE layer since the last call, every layer of
        the model in order (`[layers][experts]`; None without MoE layers). Between steps."""

    @abstractmethod
    def shutdown(self) -> None:
        """Free every rank's KV cache, graphs and weights (idempotent)."""
