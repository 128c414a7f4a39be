"""The batch-level custom logits processor interface (vLLM v1's shape).

A processor class is loaded once per engine (`--logits-processors module:Class`, or
`LLM(logits_processors=[Class])`) and constructed once per model runner as
`Class(config, device, is_pin_memory)`. Each step that samples:

    update_state(BatchUpdate | None)   which requests joined, left or moved among the rows
    apply(logits [batch_size, V])      -> logits of the same shape (in place or new)

The rows are the step's sampling rows, in the sampler's order. A `BatchUpdate` is applied in
the order removed, added, moved; None means the rows are the previous step's, unchanged::

    previous rows    0:A  1:B  2:C           this step's rows   0:C  1:D
    removed  [0, 1]                          (A finished, B is not sampled this step)
    added    [(1, D's params, D's prompt ids, D's output ids)]
    moved    [(2, 0, UNIDIRECTIONAL)]        (C from row 2 to the free row 0)

An added request's output ids are the live list the runner appends each sampled token to
(under async scheduling it may lag one token behind the step unless the request reads its
history: penalties, min_tokens, bad words). Per-request arguments travel in
`SamplingParams.extra_args`.

Under speculative decoding a verify step has k_b + 1 logits rows per request (its draft
positions, then the bonus row). The rows a processor is told of stay one per request, as
above; `apply` is called once per draft position j = 0..max_k with a `[batch_size, V]` batch
whose row b is request b's logits at position min(j, k_b), and only the rows with j <= k_b
are kept (tandem.layers.logits_processors.speculative). So `apply` may run several times a
step on the same rows, and a request's output ids do not include the step's drafts (they are
not emitted until verified): a processor that reads them sees the output before the step.

`is_argmax_invariant()` True promises the processor never changes a row's argmax (it only
reshapes the distribution): then it is skipped on steps whose rows are all greedy. A class
may define `validate_params(sampling_params)` (a classmethod raising ValueError): the engine
calls it on every request it adds, so a bad `extra_args` is refused with a clear error.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.config import EngineConfig


class MoveDirectionality(enum.Enum):
    # The request at row a moves to row b; row a is then empty.
    UNIDIRECTIONAL = enum.auto()
    # The requests at rows a and b swap.
    SWAP = enum.auto()


# Row index of a request that left the rows.
RemovedRequest = int
# (row, params, prompt token ids, output token ids (live list)).
AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]
# (from row a, to row b, how).
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How this step's sampling rows differ from the previous step's (apply in the order
    removed, added, moved; an added or moved request may replace the row's occupant)."""

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """A batch-level logits processor (see the module docstring)."""

    def __init__(  # noqa: B027
        self, config: EngineConfig, device: torch.device, is_pin_memory: bool
    ) -> None:
        """Built once per model runner, with the engine's config and the logits' device."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The batch's logits [batch_size, V] (float32) after this processor."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when `apply` never changes a row's most likely token."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Take the step's row changes (None: the same rows as the previous step)."""

    @classmethod  # noqa: B027
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError naming the problem when a request's params (its `extra_args`) do
        not suit this processor; called by the engine on every request it adds."""


def processor_name(cls: Any) -> str:
    """`module:Class` of a processor class (for messages)."""
    return f"{getattr(cls, '__module__', '?')}:{getattr(cls, '__qualname__', repr(cls))}"
