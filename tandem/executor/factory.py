"""Which executor an engine gets: the one place that names every executor class, so the
interface (`base.py`) knows none of its implementations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.config import EngineConfig
from tandem.executor.base import Executor


def create_executor(
    config: EngineConfig,
    model_path: Path,
    hf_config: Any,
    max_model_len: int,
    eos_token_id: int | None,
) -> Executor:
    """The executor for this configuration: a `MultiprocExecutor` (one process per rank) when
    `ParallelConfig.uses_multiproc`, else the in-process `UniprocExecutor`."""
    if config.parallel.uses_multiproc:
        from tandem.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, model_path, hf_config, max_model_len, eos_token_id)
    from tandem.executor.uniproc import UniprocExecutor

    return UniprocExecutor(config, model_path, hf_config, max_model_len, eos_token_id)
