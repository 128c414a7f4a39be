"""Turns EngineCoreOutputs into user-facing results: text, stop strings, logprobs, n > 1.

The engine knows token ids only. Here each choice gets a `ChoiceOutput` (the per-choice state
machine in tandem.engine.output_state, shared with the frontend): incremental detokenization,
stop strings, finish reasons. A stop string found in the text finishes the choice (the caller
then aborts it in the engine).
A request with n > 1 is fanned out into n child requests sharing one prompt (the prefix
cache shares the prompt's blocks) and gathered back into one `RequestOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.core.outputs import EngineCoreOutput, FinishReason, Logprobs
from tandem.engine.output_state import ChoiceOutput, child_params, child_request_id
from tandem.sampling_params import SamplingParams


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    # sampling_params.prompt_logprobs: one entry per prompt token, None for the first (no
    # token before it), else the token's own logprob and the top ones (vLLM's layout).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class _ChildState:
    index: int
    params: SamplingParams
    output: ChoiceOutput
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_ChildState]
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(c.output.finished for c in self.children)


class OutputProcessor:
    """Owns the user-side state of every in-flight request of one engine."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _ParentState] = {}
        self._child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> list[tuple[str, SamplingParams]]:
        """Register a request; returns the (child id, params) pairs to add to the engine."""
        children = []
        engine_requests = []
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer; this model has none")
        for i in range(params.n):
            cp = child_params(params, i)
            cid = child_request_id(request_id, i, params.n)
            children.append(
                _ChildState(
                    index=i,
                    params=cp,
                    output=ChoiceOutput(self.tokenizer, prompt_token_ids, cp),
                    logprobs=[] if cp.logprobs is not None else None,
                )
            )
            self._child_to_parent[cid] = (request_id, i)
            engine_requests.append((cid, cp))
        self._parents[request_id] = _ParentState(request_id, prompt, prompt_token_ids, children)
        return engine_requests

    @property
    def num_unfinished(self) -> int:
        return len(self._parents)

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs. Returns finished RequestOutputs and child ids to abort."""
        finished: list[RequestOutput] = []
        to_abort: list[str] = []
        for out in outputs:
            key = self._child_to_parent.get(out.request_id)
            if key is None:
                continue
            parent = self._parents[key[0]]
            child = parent.children[key[1]]
            if child.output.finished:
                continue
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            child.token_ids.extend(out.new_token_ids)
            if out.prompt_logprobs is not None and parent.prompt_logprobs is None:
                parent.prompt_logprobs = [None, *map(logprob_entry, out.prompt_logprobs)]
            if child.logprobs is not None and out.new_logprobs:
                for lp in out.new_logprobs:
                    child.logprobs.append(logprob_entry(lp))
                    child.cumulative_logprob += lp.logprobs[0]
            if child.output.update(out.new_token_ids, out.finish_reason, out.stop_reason):
                to_abort.append(out.request_id)
            if child.output.finished:
                del self._child_to_parent[out.request_id]
                if parent.finished:  # only a child finishing can finish its parent
                    finished.append(self._make_output(parent))
                    del self._parents[parent.request_id]
        return finished, to_abort

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns the child ids to abort in the engine."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        ids = []
        for child in parent.children:
            cid = child_request_id(request_id, child.index, len(parent.children))
            if self._child_to_parent.pop(cid, None) is not None:
                ids.append(cid)
        return ids

    def _make_output(self, parent: _ParentState) -> RequestOutput:
        outs = []
        for c in parent.children:
            outs.append(
                CompletionOutput(
                    index=c.index,
                    text=c.output.text,
                    token_ids=list(c.token_ids),
                    cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
                    logprobs=c.logprobs,
                    finish_reason=c.output.finish_reason,
                    stop_reason=c.output.stop_reason,
                )
            )
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outs,
            finished=True,
            num_cached_tokens=parent.num_cached_tokens,
            prompt_logprobs=parent.prompt_logprobs,
        )


def logprob_entry(lp: Logprobs) -> dict[int, Logprob]:
    """One position's logprobs by token id: the chosen (or prompt) token at its rank first,
    then the top ones at ranks 1.. (a token in both keeps its first entry)."""
    entry: dict[int, Logprob] = {}
    ranks = [lp.sampled_rank, *range(1, len(lp.token_ids))]
    for tok, val, rank in zip(lp.token_ids, lp.logprobs, ranks, strict=True):
        if tok not in entry:
            entry[tok] = Logprob(val, rank)
    return entry
