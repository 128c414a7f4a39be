"""Parallel state (world, TP, PP, EP groups) and one communicator on torch.distributed.

Imports nothing above it in tandem (tests/unit/test_layering.py): layers, models and the
executor take a `ParallelState` explicitly; nothing here is a global.
"""

from tandem.distributed.parallel_state import (
    GroupCoordinator,
    ParallelState,
    get_pp_indices,
    rank_layout,
    single_rank_state,
)

__all__ = [
    "GroupCoordinator",
    "ParallelState",
    "get_pp_indices",
    "rank_layout",
    "single_rank_state",
]
