"""Incremental detokenization of one request's output, with stop strings.

Each update decodes only a short window of token ids, never the whole output::

    token ids:  [ ... | ctx | held | new ... ]
                       ^ prefix_offset
                             ^ read_offset
    prefix_text = decode(ids[prefix_offset:read_offset])   (already emitted)
    new_text    = decode(ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]

A delta is taken only when `new_text` does not end in U+FFFD, i.e. when the last token does
not stop inside a multi-byte character; otherwise the tokens wait for the next update. Once
taken, `prefix_offset` moves to the old `read_offset` and `read_offset` to the end. Decoding
from a token of context (rather than from the delta's first token) keeps decoders that strip
a leading space at the start of a decode from stripping it from the delta.

For byte-level BPE tokenizers (GPT-2 family: Llama 3, Qwen2, SmolLM2) the concatenated deltas
equal `tokenizer.decode(output_ids, skip_special_tokens=...)` exactly once `finish()` ran.
The window starts in the last few prompt tokens (when they decode to whole characters), so for
decoders that strip a leading space the first output token keeps the space the prompt gives it.

Text flow: `update` appends the delta to `output_text` and looks for stop strings in the new
region only. `get_next_delta` hands out what callers have not seen yet, holding back the
last `len(longest stop) - 1` characters while unfinished, so no streamed delta ever shows the
start of a stop string that later completes. A stop match or `finish()` releases the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the first output token, as context for the first delta.
_NUM_CONTEXT_TOKENS = 5
# Tokens that may wait on an unfinished character before the window is cut anyway. No real
# character needs more than 4; only a stream of broken bytes gets here.
_MAX_PENDING_TOKENS = 16


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, a window at a time, and finds stop strings.

    `tokenizer` is any object with Hugging Face's `decode(ids, skip_special_tokens=...)`.
    After a stop string matched, `finished` is True and further `update`s are ignored.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        # A fast tokenizer's Rust backend decodes the same text without the Python wrapper's
        # per-call conversions (this runs for every request every step).
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend_decode = getattr(backend, "decode", None)
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._stop_holdback = max((len(s) for s in self.stop), default=1) - 1

        context = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        context_text = self._decode(context) if context else ""
        if context_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character: decoding from it would mix its bytes into
            # the output's first character. Start at the output instead.
            context, context_text = [], ""
        self._token_ids: list[int] = context
        self._num_context_tokens = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: str | None = context_text

        self._text = ""
        self._num_returned = 0
        self._finished = False
        self.matched_stop: str | None = None

    @property
    def output_text(self) -> str:
        """All text so far (including what `get_next_delta` still holds back), cut at a matched
        stop string: before it, or after it with `include_stop_str_in_output`."""
        return self._text

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def num_output_tokens(self) -> int:
        return len(self._token_ids) - self._num_context_tokens

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Add output tokens; return the stop string that matched, if one did now."""
        if self._finished or not new_token_ids:
            return None
        self._token_ids.extend(new_token_ids)
        return self._append(self._decode_window(final=False))

    def finish(self) -> str | None:
        """Flush tokens held for an unfinished character; from now on nothing is held back.

        Returns the stop string that matched in the flushed text, if one did."""
        if self._finished:
            return None
        matched = self._append(self._decode_window(final=True))
        self._finished = True
        return matched

    def get_next_delta(self) -> str:
        """The text not returned before, minus the hold-back while the request is unfinished."""
        end = len(self._text)
        if not self._finished:
            end = max(end - self._stop_holdback, self._num_returned)
        delta = self._text[self._num_returned : end]
        self._num_returned = end
        return delta

    def _decode(self, token_ids: Sequence[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(
                list(token_ids), skip_special_tokens=self.skip_special_tokens
            )
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_window(self, final: bool) -> str:
        ids = self._token_ids
        if self._read_offset == len(ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        prefix_text = self._prefix_text
        new_text = self._decode(ids[self._prefix_offset :])
        end = len(ids)
        if not final and new_text.endswith(_REPLACEMENT_CHAR):
            if end - self._read_offset <= _MAX_PENDING_TOKENS:
                return ""
            end, new_text = self._last_clean_split()
        if new_text == prefix_text:
            # The new tokens produced no text (skipped special tokens): nothing to emit, but
            # keep the window short.
            self._read_offset = end
            if self._read_offset - self._prefix_offset > _NUM_CONTEXT_TOKENS:
                self._prefix_offset = self._read_offset - _NUM_CONTEXT_TOKENS
                self._prefix_text = None
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = end
        self._prefix_text = None
        return delta

    def _last_clean_split(self) -> tuple[int, str]:
        """For a long run of tokens ending inside a character: the latest split point whose
        text ends on a whole character (else one token short of the end), and that text."""
        ids = self._token_ids
        for split in range(len(ids) - 1, self._read_offset, -1):
            text = self._decode(ids[self._prefix_offset : split])
            if not text.endswith(_REPLACEMENT_CHAR):
                return split, text
        split = len(ids) - 1
        return split, self._decode(ids[self._prefix_offset : split])

    def _append(self, delta: str) -> str | None:
        if not delta:
            return None
        prev_len = len(self._text)
        self._text += delta
        if not self.stop:
            return None
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop_str in self.stop:
            start = self._text.find(stop_str, max(0, prev_len - len(stop_str) + 1))
            if start < 0:
                continue
            candidate = (start + len(stop_str), start, stop_str)
            # The stop string completed first wins; on a tie, the longer one.
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return None
        end, start, stop_str = best
        self._text = self._text[: end if self.include_stop_str_in_output else start]
        self._finished = True
        self.matched_stop = stop_str
        return stop_str
