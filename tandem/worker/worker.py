"""A worker: one device rank of an engine, owning that rank's `ModelRunner`.

The worker picks its device and makes it current on the calling (engine) thread before
anything is built (Triton launches, CUDA graphs, streams and the KV cache go to the current
device), joins its engine's process groups (a rank of a `MultiprocExecutor`: GPU
`device_index + local_rank`), measures the
weights' and a step's memory, sizes the KV cache, and allocates it in one place
(`allocate_kv_cache`). Everything else it forwards to its runner.

KV sizing on CUDA::

    num_blocks = min(total * gpu_memory_utilization - weights - activations,
                     free - activations - 1 GiB) // bytes_per_block

where `activations` is the profiled peak of the largest step plus the sampler's buffers and a
1 GiB margin for the CUDA graph pool. On other devices `kv_cache_memory_gb` decides.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

import torch

from tandem.config import EngineConfig
from tandem.core.outputs import GrammarBitmaskSource, SchedulerOutput
from tandem.distributed import ParallelState
from tandem.distributed.init import DistributedInit, init_parallel_state
from tandem.worker.cpu_memory import layer_major_kv_cache
from tandem.worker.cpu_threads import (
    CpuThreadGovernor,
    make_cpu_thread_governor,
    setup_cpu_threads,
)
from tandem.worker.model_runner import ModelRunner
from tandem.worker.sampling import PendingStep
from tandem.worker.shared_kv import SharedKVCache, export_kv_cache

logger = logging.getLogger(__name__)


class Worker:
    """One rank's device, memory accounting and model runner."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: Path,
        hf_config: Any,
        max_model_len: int,
        eos_token_id: int | None,
        rank: int = 0,
        local_rank: int = 0,
        dist_init: DistributedInit | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        # CPU: the cores this rank's threads are bound to (None: unbound); see cpu_threads.
        self.cpu_cores: tuple[int, ...] | None = None
        self.cpu_governor: CpuThreadGovernor | None = None
        self.device = self.init_device()
        self.parallel = self.init_distributed(dist_init)
        before = self._allocated()
        self.model_runner = ModelRunner(
            config, self.device, model_path, hf_config, max_model_len, eos_token_id, self.parallel
        )
        self.weight_bytes = self._allocated() - before
        self.num_blocks = 0

    # ----------------------------------------------------------------- device

    def init_device(self) -> torch.device:
        """Resolve the device and make it current on this thread (see the module docstring);
        on a CPU, set the thread count and bind the threads (`cpu_threads`)."""
        config = self.config.device
        device = torch.device(config.resolved_device())
        index = config.device_index
        if device.type == "cuda" and (index is not None or self.local_rank):
            index = (index or 0) + self.local_rank
            if index >= torch.cuda.device_count():
                raise RuntimeError(
                    f"rank {self.rank} needs GPU {index}, but {torch.cuda.device_count()} "
                    "are visible"
                )
            device = torch.device("cuda", index)
        if device.type == "cpu":
            self.cpu_cores = setup_cpu_threads(config)
            self.cpu_governor = make_cpu_thread_governor(config, self.cpu_cores)
        elif config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
        if device.type == "cuda":
            from tandem_kernels.pdl import device_supports_pdl, enable_pdl

            enable_pdl(config.enable_pdl)
            if config.enable_pdl and not device_supports_pdl(device):
                logger.warning("--enable-pdl: %s is below compute capability 9.0; off", device)
        return device

    def init_distributed(self, dist_init: DistributedInit | None) -> ParallelState | None:
        """Join the engine's process groups (None: a one-rank engine, no groups)."""
        if dist_init is None:
            return None
        return init_parallel_state(dist_init, self.device)

    def _allocated(self) -> int:
        if self.device.type != "cuda":
            return 0
        return torch.cuda.memory_allocated(self.device)

    # ----------------------------------------------------------------- KV cache

    def determine_num_blocks(self) -> int:
        """How many KV blocks this rank's share of the device holds (see the module doc)."""
        cache = self.config.cache
        runner = self.model_runner
        if cache.num_gpu_blocks:
            return cache.num_gpu_blocks
        if self.device.type == "cuda":
            # This engine's share: `gpu_memory_utilization` of the device, less its weights and
            # what a step needs (profiled); never more than is free.
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            activation = self.profile_activation_bytes()
            budget = min(
                total * cache.gpu_memory_utilization - self.weight_bytes - activation,
                free - activation - (1 << 30),
            )
            return max(int(budget // runner.kv_bytes_per_block()), 1)
        return max(int(cache.kv_cache_memory_gb * (1 << 30) // runner.kv_bytes_per_block()), 1)

    def profile_activation_bytes(self) -> int:
        """Memory to keep free for activations, logits, sampler temporaries and CUDA graphs.

        Measured (CUDA only): the peak of the runner's `profile_run` (the largest step through
        a scratch KV cache, which is not counted), plus the logits and sampler buffers of
        `max_num_sampled_rows` rows (k + 1 a request under speculation), plus a fixed margin
        for the graph pool.
        """
        runner = self.model_runner
        scratch = torch.zeros(
            runner.kv_cache_shape(runner.profile_num_blocks()),
            dtype=runner.kv_dtype,
            device=self.device,
        )
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        runner.profile_run(scratch)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del scratch
        torch.cuda.empty_cache()
        sampler_bytes = 4 * runner.max_num_sampled_rows * runner.vocab_size * 4
        return int(peak + sampler_bytes + (1 << 30))

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """The engine's KV cache: one zeroed tensor of the runner's `kv_cache_shape` on this
        rank's device. The only place the engine's cache is allocated. On the CPU it is stored
        layer-major (`tandem.worker.cpu_memory.layer_major_kv_cache`: each layer's view is
        contiguous, a block is not); on a GPU, block-major (a block over all layers is one
        contiguous span)."""
        runner = self.model_runner
        shape = runner.kv_cache_shape(num_blocks)
        if self.device.type == "cpu":
            return layer_major_kv_cache(shape, runner.kv_dtype)
        return torch.zeros(shape, dtype=runner.kv_dtype, device=self.device)

    def export_kv_cache(self) -> SharedKVCache:
        """This rank's KV cache for another process of this host."""
        cache = self.model_runner.kv_cache
        if cache is None:
            raise RuntimeError("the worker holds no KV cache")
        return export_kv_cache(cache)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the cache, then let the runner tune kernels on it and capture graphs."""
        self.num_blocks = num_blocks
        self.model_runner.initialize_kv_cache(self.allocate_kv_cache(num_blocks))

    # ----------------------------------------------------------------- steps

    def execute_async(
        self, so: SchedulerOutput, grammar_bitmask: GrammarBitmaskSource | None = None
    ) -> PendingStep:
        if self.cpu_governor is not None:
            self.cpu_governor.before_step()
        return self.model_runner.execute_async(so, grammar_bitmask)

    def drop_requests(self, req_ids: set[str]) -> None:
        self.model_runner.drop_requests(req_ids)

    def needs_prior_tokens(self, so: SchedulerOutput) -> bool:
        return self.model_runner.needs_prior_tokens(so)

    def may_write_blocks(self, block_ids: list[int]) -> bool:
        return self.model_runner.may_write_blocks(block_ids)

    def synchronize(self) -> None:
        self.model_runner.synchronize()

    def take_expert_load(self) -> list[list[int]] | None:
        return self.model_runner.take_expert_load()

    # ----------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Free this rank's KV cache, CUDA graphs and weights, and return the memory to the
        device (idempotent)."""
        self.model_runner.shutdown()
        gc.collect()  # cycles that may still hold device tensors (a step's callbacks)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
