"""One worker in the engine's own thread: every collective call is a direct call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tandem.config import EngineConfig
from tandem.core.kv_cache_spec import KVCacheSpec
from tandem.core.outputs import GrammarBitmaskSource, SchedulerOutput
from tandem.executor.base import Executor
from tandem.worker.model_runner import ModelRunner
from tandem.worker.sampling import PendingStep
from tandem.worker.worker import Worker


class UniprocExecutor(Executor):
    """Drives a single `Worker` (rank 0) in this process and thread."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: Path,
        hf_config: Any,
        max_model_len: int,
        eos_token_id: int | None,
    ) -> None:
        super().__init__(config, model_path, hf_config, max_model_len, eos_token_id)
        self.driver_worker = Worker(config, model_path, hf_config, max_model_len, eos_token_id)
        self._shut_down = False

    @property
    def device(self) -> torch.device:
        return self.driver_worker.device

    @property
    def vocab_size(self) -> int:
        return self.driver_worker.model_runner.vocab_size

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return self.driver_worker.model_runner.kv_cache_spec

    @property
    def kv_cache(self) -> torch.Tensor | None:
        return self.driver_worker.model_runner.kv_cache

    @property
    def model_runner(self) -> ModelRunner:
        return self.driver_worker.model_runner

    def determine_num_blocks(self) -> int:
        return self.driver_worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.driver_worker.initialize_kv_cache(num_blocks)

    def execute_async(
        self,
        scheduler_output: SchedulerOutput,
        grammar_bitmask: GrammarBitmaskSource | None = None,
    ) -> PendingStep:
        return self.driver_worker.execute_async(scheduler_output, grammar_bitmask)

    def drop_requests(self, req_ids: set[str]) -> None:
        self.driver_worker.drop_requests(req_ids)

    def needs_prior_tokens(self, scheduler_output: SchedulerOutput) -> bool:
        return self.driver_worker.needs_prior_tokens(scheduler_output)

    def may_write_blocks(self, block_ids: list[int]) -> bool:
        return self.driver_worker.may_write_blocks(block_ids)

    def synchronize(self) -> None:
        self.driver_worker.synchronize()

    def take_expert_load(self) -> list[list[int]] | None:
        return self.driver_worker.take_expert_load()

    def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        self.driver_worker.shutdown()
