"""One choice's output, from token ids to finished text: the state machine both the offline
`OutputProcessor` and the frontend's `RequestTracker` drive.

A request with n > 1 is n choices (child requests of the engine sharing one prompt); each
choice has one `ChoiceOutput`. Per step the caller hands it that step's new token ids (all
of them at once: one detokenizer window, one stop-string scan per step, never per token)
and what the engine said of the step (finished or not, why), then, when it streams, takes
the text the client may see now::

                     update(ids)                update(ids, engine finished)
    ┌─────────┐  stop string in text   ┌──────────────────┐
    │ RUNNING │───────────────────────▶│ STOPPED_BY_STRING│  finish_reason "stop",
    └─────────┘                        └──────────────────┘  stop_reason = the string;
         │  engine finished, no stop string (length, eos / stop token id, abort)
         ▼                                                   the engine must abort it
    ┌────────────────────┐                                   when it still runs it
    │ FINISHED_BY_ENGINE │  finish_reason / stop_reason as the engine gave them
    └────────────────────┘

Both end states are final: later updates are ignored (a step already in flight may still
bring tokens). When the engine finishes a choice, held-back tokens (a character not yet
complete) are flushed first; a stop string completed by that flush still ends the choice
as STOPPED_BY_STRING.

Text held back: while RUNNING, `take_text` keeps the last `len(longest stop) - 1`
characters, so no streamed delta ever shows the start of a stop string that later
completes; reaching an end state releases them (cut at the stop string, which is kept with
`include_stop_str_in_output`).

min_tokens is the sampler's (eos and stop token ids are masked below it); stop strings are
matched from the first output token, as before this module existed.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

from tandem.core.outputs import FinishReason
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.sampling_params import SamplingParams


class ChoiceState(enum.Enum):
    """Where one choice's output stands. Transitions: `TRANSITIONS`, nowhere else."""

    RUNNING = "running"
    STOPPED_BY_STRING = "stopped_by_string"
    FINISHED_BY_ENGINE = "finished_by_engine"

    @property
    def finished(self) -> bool:
        return self is not ChoiceState.RUNNING


TRANSITIONS: dict[ChoiceState, frozenset[ChoiceState]] = {
    ChoiceState.RUNNING: frozenset({ChoiceState.STOPPED_BY_STRING, ChoiceState.FINISHED_BY_ENGINE}),
    ChoiceState.STOPPED_BY_STRING: frozenset(),
    ChoiceState.FINISHED_BY_ENGINE: frozenset(),
}


class _NoText:
    """Stands in for the detokenizer of a model without a tokenizer: token ids only."""

    output_text = ""

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        return None

    def finish(self) -> str | None:
        return None

    def get_next_delta(self) -> str:
        return ""


class ChoiceOutput:
    """One choice's text, stop strings and finish reason (see the module docstring).

    `tokenizer` None: a model without one (token ids only; stop strings are refused by the
    caller). `num_tokens` counts every output token applied, the step that finished the
    choice included.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self.detokenizer: IncrementalDetokenizer | _NoText
        if tokenizer is None:
            self.detokenizer = _NoText()
        else:
            self.detokenizer = IncrementalDetokenizer(
                tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        self.state = ChoiceState.RUNNING
        self.num_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.state is not ChoiceState.RUNNING

    @property
    def text(self) -> str:
        """All text so far, held-back characters included (cut at a matched stop string)."""
        return self.detokenizer.output_text

    def update(
        self,
        new_token_ids: Sequence[int],
        engine_finish_reason: FinishReason | None = None,
        engine_stop_reason: int | str | None = None,
    ) -> bool:
        """Apply one step of this choice: its new tokens and, when the engine finished it,
        why (STOP, LENGTH, ABORT or ERROR; `engine_stop_reason` the stop token id, if any).

        Returns True when a stop string ended the choice while the engine still runs it:
        the caller aborts it there. Ignored (False) once the choice is finished."""
        if self.state is not ChoiceState.RUNNING:
            return False
        self.num_tokens += len(new_token_ids)
        detok = self.detokenizer
        stop_str = detok.update(new_token_ids)
        if stop_str is None and engine_finish_reason is not None:
            stop_str = detok.finish()
        if stop_str is not None:
            self._move(ChoiceState.STOPPED_BY_STRING, FinishReason.STOP, stop_str)
            return engine_finish_reason is None
        if engine_finish_reason is not None:
            self._move(ChoiceState.FINISHED_BY_ENGINE, engine_finish_reason, engine_stop_reason)
        return False

    def take_text(self) -> str:
        """The text not taken before, minus the hold-back while RUNNING."""
        return self.detokenizer.get_next_delta()

    def _move(
        self, state: ChoiceState, finish_reason: FinishReason, stop_reason: int | str | None
    ) -> None:
        if state not in TRANSITIONS[self.state]:
            raise RuntimeError(f"choice output cannot go from {self.state} to {state}")
        self.state = state
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason


def child_request_id(parent_id: str, index: int, n: int) -> str:
    """The engine request id of choice `index` of a request with `n` choices."""
    return parent_id if n == 1 else f"{parent_id}#{index}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Each child of an n > 1 request samples independently; seeds differ by index. The
    prompt's logprobs are the same for every child: the first alone computes them."""
    changes: dict[str, object] = {"n": 1}
    if params.seed is not None and index > 0:
        changes["seed"] = params.seed + index
    if params.prompt_logprobs is not None and index > 0:
        changes["prompt_logprobs"] = None
    return params.clone(**changes)
