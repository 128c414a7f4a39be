"""The offline API: `LLM(model=...).generate(prompts, params)` and `.chat(messages)`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from tqdm.auto import tqdm

from tandem.core.outputs import FinishReason
from tandem.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from tandem.engine.chat_template import template_options_problem
from tandem.engine.core import EngineCore, InvalidRequestError, check_prompt_token_ids
from tandem.engine.core_client import InprocClient
from tandem.engine.output_processor import OutputProcessor, RequestOutput
from tandem.engine_args import EngineArgs
from tandem.loader import load_tokenizer, sampling_defaults
from tandem.models.presets import has_random_weights
from tandem.request import EngineCoreRequest
from tandem.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError

PromptType = str | list[int] | dict[str, Any]


def _cache_salt(prompt: PromptType) -> str | None:
    """A prompt dict's "cache_salt" (a non-empty string), else None."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequestError("cache_salt must be a non-empty string")
    return salt


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (text, token ids, a dict) or a list of them, as a list."""
    if isinstance(prompts, str | dict) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _check_text(text: str, what: str) -> None:
    """InvalidRequestError if `text` holds a lone UTF-16 surrogate (not text: the tokenizer
    fails on it with a TypeError naming nothing)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{what} holds a lone UTF-16 surrogate ({ascii(text[exc.start])[1:-1]} at index "
            f"{exc.start}), which is not text"
        ) from None


class LLM:
    """Runs a model in this process with continuous batching over all submitted prompts.

    `LLM(model="default")` runs the embedded SmolLM2-135M-Instruct. Keyword arguments are
    `EngineArgs` fields (`max_num_batched_tokens=`, `num_gpu_blocks=`, `dtype=`, ...);
    `logits_processors=[...]` takes `LogitsProcessor` classes or "module:Class" strings.

    `shutdown()` (or leaving a `with LLM(...) as llm:` block) frees the engine's device memory
    (KV cache, CUDA graphs, weights); the LLM generates nothing afterwards.

    The engine is reached through an `InprocClient` (the same interface the services reach
    their engine process through); `engine` is the EngineCore itself, for inspection.
    """

    def __init__(self, model: str = "default", **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.engine = EngineCore(self.engine_args.create_engine_config())
        self.client = InprocClient(engine=self.engine)
        # With skip_tokenizer_init, and for random-weight presets (whose stand-in tokenizer
        # only serves), no tokenizer: prompts are token ids and outputs carry no text.
        self.no_tokenizer_reason = (
            "skip_tokenizer_init is set"
            if self.engine_args.skip_tokenizer_init
            else "a random-weight model has no tokenizer"
            if has_random_weights(self.engine.model_path)
            else None
        )
        self.tokenizer = (
            None if self.no_tokenizer_reason else load_tokenizer(self.engine.model_path)
        )
        self._output_processor = OutputProcessor(self.tokenizer)
        self._counter = itertools.count()
        # The model's default sampling parameters (vLLM's --generation-config): used where a
        # call passes no SamplingParams.
        self._sampling_defaults = sampling_defaults(
            self.engine.model_path, self.engine_args.generation_config
        )

    # ----------------------------------------------------------------- lifetime

    def shutdown(self) -> None:
        """Free the engine's KV cache, CUDA graphs and weights (idempotent)."""
        self.client.shutdown()

    close = shutdown

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    # ----------------------------------------------------------------- inputs

    def _to_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    f"a text prompt needs a tokenizer ({self.no_tokenizer_reason}): pass token "
                    'ids, e.g. {"prompt_token_ids": [...]}'
                )
            _check_text(prompt, "prompt")
            return prompt, list(self.tokenizer(prompt, add_special_tokens=True).input_ids)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._to_token_ids(prompt["prompt"])
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError(f"unsupported prompt type {type(prompt).__name__}")

    def _tokenize_bad_words(self, params: SamplingParams) -> SamplingParams:
        """`params` with its bad words tokenized (a copy; itself when there is nothing to do)."""
        if not params.bad_words or params.bad_words_token_ids is not None:
            return params
        if self.tokenizer is None:
            raise InvalidRequestError("bad_words need the model's tokenizer; this model has none")
        params = params.clone()
        params.update_from_tokenizer(self.tokenizer)
        return params

    # ----------------------------------------------------------------- API

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's defaults (its generation_config.json's temperature,
        top_p, top_k, min_p and repetition_penalty under `generation_config="auto"`, as
        vLLM's); what `generate` and `chat` use when given no SamplingParams."""
        return SamplingParams(**self._sampling_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of `prompts`.

        A prompt is a string, a list of token ids, or {"prompt_token_ids": [...]} or
        {"prompt": "..."}, either dict with an optional "cache_salt" (only prompts with the same
        salt share cached prefixes). A prompt whose structured-outputs spec does not compile
        fails the call with SamplingParamsError naming it (nothing of the call stays queued).
        """
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise InvalidRequestError(
                f"got {len(params_list)} sampling params for {len(prompts)} prompts"
            )
        if priority is not None and len(priority) != len(prompts):
            raise InvalidRequestError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        params_list = [self._tokenize_bad_words(p) for p in params_list]

        request_ids: list[str] = []
        added: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                text, token_ids = self._to_token_ids(prompt)
                salt = _cache_salt(prompt)
                if token_ids:  # before the detokenizer reads them (empty: the engine says)
                    check_prompt_token_ids(token_ids, self.client.info.vocab_size)
                rid = str(next(self._counter))
                children = self._output_processor.add_request(rid, text, token_ids, params)
                request_ids.append(rid)
                for cid, cparams in children:
                    self.client.add_request(
                        EngineCoreRequest(
                            request_id=cid,
                            prompt_token_ids=token_ids,
                            sampling_params=cparams,
                            eos_token_id=self.client.info.eos_token_id,
                            priority=0 if priority is None else priority[i],
                            cache_salt=salt,
                        )
                    )
                    added.append(cid)
        except Exception:
            # Leave the engine as it was: nothing of this call stays queued.
            self.client.abort_requests(added)
            for rid in request_ids:
                self._output_processor.abort(rid)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate. The template's
        options are vLLM's (tandem.engine.chat_template): the generation prompt added, or the
        final message continued; extra template variables; `tools` for the template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if self.tokenizer is None:
            raise InvalidRequestError(
                f"chat needs a tokenizer for its template ({self.no_tokenizer_reason})"
            )
        kwargs = dict(chat_template_kwargs or {})
        problem = template_options_problem(add_generation_prompt, continue_final_message, kwargs)
        if problem is not None:
            raise InvalidRequestError(problem[0])
        if tools:
            kwargs["tools"] = tools
        prompts: list[PromptType] = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(
                conv,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **kwargs,
            )
            _check_text(text, "the conversation")
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ----------------------------------------------------------------- loop

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (tandem.engine.beam_search): each prompt's `beam_width` best
        sequences, best first. A step runs every live beam as a one-token request through
        `generate`, the prefix cache giving back each beam's earlier blocks."""
        token_ids = [self._to_token_ids(p)[1] for p in _prompt_list(prompts)]
        for ids in token_ids:
            check_prompt_token_ids(ids, self.client.info.vocab_size)
        if 2 * params.beam_width > MAX_LOGPROBS:
            raise SamplingParamsError(
                f"beam_width must be at most {MAX_LOGPROBS // 2} (it reads the top "
                f"2 x beam_width logprobs), got {params.beam_width}"
            )

        def step(batch: list[list[int]], one: SamplingParams) -> list[list[tuple[int, float]]]:
            outs = self.generate([{"prompt_token_ids": ids} for ids in batch], one, False)
            return [
                [(t, lp.logprob) for t, lp in (o.outputs[0].logprobs or [{}])[0].items()]
                for o in outs
            ]

        tokenizer = self.tokenizer
        detokenize = (
            None
            if tokenizer is None
            else lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        )
        return beam_search(token_ids, params, step, self.client.info.eos_token_id, detokenize)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm, unit="req")
        try:
            while self._output_processor.num_unfinished:
                outputs = self.client.get_output()
                if not outputs and not self.client.has_unfinished_requests():
                    break
                finished, to_abort = self._output_processor.process_outputs(outputs)
                if to_abort:
                    self.client.abort_requests(to_abort)
                for ro in finished:
                    results[ro.request_id] = ro
                    errors = [
                        c.stop_reason for c in ro.outputs if c.finish_reason == FinishReason.ERROR
                    ]
                    if errors:
                        # A spec that did not compile: the call fails naming it (the rest of
                        # the call is aborted below); the engine keeps serving.
                        raise SamplingParamsError(
                            f"prompt {request_ids.index(ro.request_id)}: {errors[0]}"
                        )
                bar.update(len(finished))
        except BaseException:
            for rid in request_ids:
                if rid not in results:
                    self.client.abort_requests(self._output_processor.abort(rid))
            raise
        finally:
            bar.close()
        return [results[rid] for rid in request_ids]
