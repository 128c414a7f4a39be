"""The runner's side of logits processors: loading classes, tracking rows, one step's inputs.

- `load_logits_processors`: `module:Class` strings (or classes) to `LogitsProcessor`
  subclasses; one that does not load is a ConfigError naming it.
- `BatchUpdateBuilder`: the `BatchUpdate` from one step's sampling rows to the next.
- `LogitsProcessors`: owned by the step sampler, one per model runner: the custom processors
  (built once), each request's built-in rules (built when it joins the rows), and `prepare`,
  which turns one step's rows into what the sampler's "process logits" stage applies
  (`prepare_verify` for a speculative verify step's k + 1 rows per request).

A request is known by its runner state object, not its id: a request resumed after
preemption has a new state (a new output list) and so is removed and added again.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tandem.config import ConfigError
from tandem.layers.logits_processors.builtin import LogitsRules, RequestLogitsRules
from tandem.layers.logits_processors.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
    processor_name,
)
from tandem.layers.logits_processors.speculative import (
    PerPositionProcessor,
    verified_histories,
)
from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.config import EngineConfig


class SamplingRow(Protocol):
    """What a sampling row's request state offers (tandem.worker.input_batch's state)."""

    req_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def load_logits_processors(specs: Sequence[str | type]) -> list[type[LogitsProcessor]]:
    """The classes `specs` name: each a `LogitsProcessor` subclass, or a string
    `package.module:Class` (or `package.module.Class`). Raises ConfigError naming the one that
    does not load."""
    classes: list[type[LogitsProcessor]] = []
    for spec in specs:
        cls: Any = spec
        if isinstance(spec, str):
            cls = _import_class(spec)
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ConfigError(
                f"logits processor {spec!r} is not a subclass of "
                "tandem.layers.logits_processors.LogitsProcessor"
            )
        if getattr(cls, "__abstractmethods__", None):
            missing = ", ".join(sorted(cls.__abstractmethods__))
            raise ConfigError(f"logits processor {processor_name(cls)} does not define {missing}")
        classes.append(cls)
    return classes


def _import_class(spec: str) -> Any:
    module_name, sep, qualname = spec.partition(":")
    if not sep:
        module_name, _, qualname = spec.rpartition(".")
    if not module_name or not qualname:
        raise ConfigError(f"logits processor {spec!r}: expected module:Class")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(
            f"logits processor {spec!r}: cannot import module {module_name!r}: {exc}"
        ) from exc
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"logits processor {spec!r}: module {module_name!r} has no {qualname!r}"
            )
        obj = getattr(obj, part)
    return obj


class BatchUpdateBuilder:
    """Turns each step's sampling rows into a `BatchUpdate` against the previous step's.

    Removed requests leave their rows; added ones take a free row (their own target row when
    it is free); then, row by row in order, each request moves to its target row (a swap when
    that row is taken). Afterwards row t holds the step's t-th request and no row past the
    batch holds anything."""

    def __init__(self) -> None:
        self._rows: list[SamplingRow] = []

    def update(self, rows: Sequence[SamplingRow]) -> BatchUpdate | None:
        prev = self._rows
        if len(prev) == len(rows) and all(a is b for a, b in zip(prev, rows, strict=True)):
            return None
        current = {id(s) for s in rows}
        slots: list[SamplingRow | None] = [*prev, *([None] * max(0, len(rows) - len(prev)))]
        removed = [i for i, s in enumerate(prev) if id(s) not in current]
        for i in removed:
            slots[i] = None
        pos = {id(s): i for i, s in enumerate(slots) if s is not None}
        free = sorted(i for i, s in enumerate(slots) if s is None)
        free_set = set(free)
        added: list[AddedRequest] = []
        for target, s in enumerate(rows):
            if id(s) in pos:
                continue
            slot = target if target in free_set else min(free_set)
            free_set.discard(slot)
            slots[slot] = s
            pos[id(s)] = slot
            added.append((slot, s.sampling_params, s.prompt_token_ids, s.output_token_ids))
        moved: list[MovedRequest] = []
        for target, s in enumerate(rows):
            at = pos[id(s)]
            if at == target:
                continue
            occupant = slots[target]
            if occupant is None:
                moved.append((at, target, MoveDirectionality.UNIDIRECTIONAL))
                slots[at] = None
            else:
                moved.append((at, target, MoveDirectionality.SWAP))
                slots[at] = occupant
                pos[id(occupant)] = at
            slots[target] = s
            pos[id(s)] = target
        self._rows = list(rows)
        return BatchUpdate(batch_size=len(rows), removed=removed, added=added, moved=moved)


@dataclass(frozen=True)
class ProcessorInputs:
    """What one step's "process logits" stage applies."""

    rules: LogitsRules | None
    processors: tuple[LogitsProcessor, ...]


class LogitsProcessors:
    """The logits processors of one model runner (see the module docstring)."""

    def __init__(
        self,
        classes: Sequence[type[LogitsProcessor]],
        config: EngineConfig | None,
        device: torch.device,
        vocab_size: int,
    ) -> None:
        self.device = device
        self.vocab_size = vocab_size
        pin = device.type == "cuda"
        self.custom: tuple[LogitsProcessor, ...] = tuple(
            cls(config, device, pin)  # type: ignore[arg-type]
            for cls in classes
        )
        self._builder = BatchUpdateBuilder()
        # Per sampling row's state (by identity): its rules, built once.
        self._rules: dict[int, tuple[SamplingRow, RequestLogitsRules | None]] = {}

    def prepare(self, rows: Sequence[SamplingRow]) -> ProcessorInputs:
        """One step's inputs: rows[i] is the request of logits row i."""
        self._update_custom(rows)
        per_row = self._request_rules(rows)
        rules = None
        if any(r is not None for r in per_row):
            rules = LogitsRules.build(per_row, [s.output_token_ids for s in rows], self.device)
        return ProcessorInputs(rules, self.custom)

    def prepare_verify(
        self, rows: Sequence[SamplingRow], num_draft: Sequence[int], drafts: Sequence[int]
    ) -> ProcessorInputs:
        """A speculative verify step's inputs: rows[b] verifies num_draft[b] drafts (its
        k_b + 1 logits rows in order; `drafts`: all requests' drafts in order). The rules have
        one row per verified row, each following the output and the drafts before it; the
        custom processors see the requests as one row each and are wrapped to apply at every
        draft position (tandem.layers.logits_processors.speculative)."""
        self._update_custom(rows)
        per_request = self._request_rules(rows)
        rules = None
        if any(r is not None for r in per_request):
            per_row = [r for r, k in zip(per_request, num_draft, strict=True) for _ in range(k + 1)]
            # Only the tails the bad words read (whole outputs would be copied k + 1 times).
            tails = [
                s.output_token_ids[-r.history_len :] if r is not None and r.history_len else []
                for s, r in zip(rows, per_request, strict=True)
            ]
            histories = verified_histories(tails, num_draft, drafts)
            rules = LogitsRules.build(per_row, histories, self.device)
        processors = tuple(PerPositionProcessor(p, num_draft) for p in self.custom)
        return ProcessorInputs(rules, processors)

    def _update_custom(self, rows: Sequence[SamplingRow]) -> None:
        if self.custom:
            update = self._builder.update(rows)
            for proc in self.custom:
                proc.update_state(update)

    def _request_rules(self, rows: Sequence[SamplingRow]) -> list[RequestLogitsRules | None]:
        """Each row's built-in rules (built when its request joins the rows)."""
        per_row: list[RequestLogitsRules | None] = []
        kept: dict[int, tuple[SamplingRow, RequestLogitsRules | None]] = {}
        for s in rows:
            entry = self._rules.get(id(s))
            if entry is None or entry[0] is not s:
                entry = (s, RequestLogitsRules.from_params(s.sampling_params, self.vocab_size))
            kept[id(s)] = entry
            per_row.append(entry[1])
        self._rules = kept
        return per_row
