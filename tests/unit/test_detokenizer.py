"""Incremental detokenization against full decodes, and stop strings in streamed deltas."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from tandem.engine.detokenizer import IncrementalDetokenizer

REAL_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Émoji time: 🎉🤖👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵, then café, naïve, Übermaß.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "def f(x):\n    return x ** 2  # ∑ ∫ √ ≠ ≤\n\n\tλ → ∞",
    "Ελληνικά και русский текст, עברית, العربية, हिन्दी 🙂",
    "<|im_start|>assistant\nSure! 👍<|im_end|>",
]


def _train(model_kind: str) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if model_kind == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        alphabet = []
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(REAL_TEXTS * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def bytelevel_bpe() -> Any:
    """A small byte-level BPE trained here: every byte is a token, so characters split often."""
    return _train("bytelevel")


@pytest.fixture(scope="module")
def metaspace_bpe() -> Any:
    """A SentencePiece-style tokenizer whose decoder strips the space at the start of a decode."""
    return _train("metaspace")


class CountingTokenizer:
    """Wraps a tokenizer and records the longest id list ever decoded."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.max_decode_len = 0
        self.num_decodes = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        self.max_decode_len = max(self.max_decode_len, len(ids))
        self.num_decodes += 1
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


class PieceTokenizer:
    """Token i decodes to pieces[i]: token boundaries exactly where a test wants them."""

    def __init__(self, pieces: Sequence[str]) -> None:
        self.pieces = list(pieces)

    def encode(self, text: str) -> list[int]:
        """Greedy longest-match over the pieces (enough for the crafted tests)."""
        ids, i = [], 0
        while i < len(text):
            best = max(
                (j for j, p in enumerate(self.pieces) if text.startswith(p, i)),
                key=lambda j: len(self.pieces[j]),
            )
            ids.append(best)
            i += len(self.pieces[best])
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.pieces[i] for i in ids)


def run_stream(
    tokenizer: Any,
    prompt: Sequence[int],
    output: Sequence[int],
    chunks: Sequence[int] | None = None,
    *,
    skip_special_tokens: bool = True,
    stop: Sequence[str] = (),
    include_stop_str_in_output: bool = False,
) -> tuple[IncrementalDetokenizer, list[str], list[str | None]]:
    """Feed `output` in chunks (default: one token at a time); returns deltas, update results."""
    detok = IncrementalDetokenizer(
        tokenizer,
        list(prompt),
        skip_special_tokens=skip_special_tokens,
        stop=list(stop),
        include_stop_str_in_output=include_stop_str_in_output,
    )
    deltas: list[str] = []
    matches: list[str | None] = []
    chunks = chunks if chunks is not None else [1] * len(output)
    pos = 0
    for n in chunks:
        matches.append(detok.update(output[pos : pos + n]))
        pos += n
        deltas.append(detok.get_next_delta())
    detok.finish()
    deltas.append(detok.get_next_delta())
    return detok, deltas, matches


def random_chunks(rng: random.Random, total: int) -> list[int]:
    chunks = []
    while total > 0:
        n = min(total, rng.choice([1, 1, 1, 2, 3, 5]))
        chunks.append(n)
        total -= n
    return chunks


# ---------------------------------------------------------------- full-decode equality


@pytest.mark.parametrize("fixture", ["smollm2_tokenizer", "bytelevel_bpe"])
def test_random_ids_match_full_decode(fixture: str, request: pytest.FixtureRequest) -> None:
    tokenizer = request.getfixturevalue(fixture)
    vocab = len(tokenizer)
    rng = random.Random(0)
    for _ in range(300):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        skip = rng.random() < 0.5
        detok, deltas, _ = run_stream(
            tokenizer, prompt, output, random_chunks(rng, len(output)), skip_special_tokens=skip
        )
        want = tokenizer.decode(output, skip_special_tokens=skip)
        assert detok.output_text == want, (prompt, output, skip)
        assert "".join(deltas) == want
        assert detok.num_output_tokens == len(output)


def test_random_byte_tokens_match_full_decode(bytelevel_bpe: Any) -> None:
    # Only the 256 byte tokens and specials: most characters are split across tokens and many
    # sequences are broken UTF-8.
    rng = random.Random(1)
    byte_ids = list(range(2, 2 + 256))
    for _ in range(300):
        output = [rng.choice(byte_ids) for _ in range(rng.randrange(1, 30))]
        detok, deltas, _ = run_stream(bytelevel_bpe, [], output, random_chunks(rng, len(output)))
        want = bytelevel_bpe.decode(output, skip_special_tokens=True)
        assert detok.output_text == want == "".join(deltas), output


@pytest.mark.parametrize("text", REAL_TEXTS)
@pytest.mark.parametrize("fixture", ["smollm2_tokenizer", "bytelevel_bpe"])
def test_real_text_streams_whole_characters(
    text: str, fixture: str, request: pytest.FixtureRequest
) -> None:
    tokenizer = request.getfixturevalue(fixture)
    prompt = tokenizer.encode("Question: say something.\nAnswer:", add_special_tokens=False)
    output = tokenizer.encode(text, add_special_tokens=False)
    for skip in (True, False):
        want = tokenizer.decode(output, skip_special_tokens=skip)
        detok, deltas, _ = run_stream(tokenizer, prompt, output, skip_special_tokens=skip)
        assert detok.output_text == want
        assert "".join(deltas) == want
        # Valid text never streams a replacement character, and streamed text is never
        # taken back.
        assert all("\ufffd" not in d for d in deltas)
        streamed = ""
        for d in deltas:
            streamed += d
            assert want.startswith(streamed)


def test_real_text_really_splits_characters(smollm2_tokenizer: Any) -> None:
    # The emoji text must exercise characters split over tokens, or the tests above prove little.
    ids = smollm2_tokenizer.encode(REAL_TEXTS[1], add_special_tokens=False)
    assert sum(smollm2_tokenizer.decode([i]).endswith("\ufffd") for i in ids) >= 5


def test_window_stays_bounded(smollm2_tokenizer: Any) -> None:
    text = " ".join(REAL_TEXTS) * 6
    output = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert len(output) > 500
    counting = CountingTokenizer(smollm2_tokenizer)
    detok, _, _ = run_stream(counting, [1, 2, 3], output)
    assert detok.output_text == smollm2_tokenizer.decode(output, skip_special_tokens=True)
    assert counting.max_decode_len <= 8
    assert counting.num_decodes <= 2 * len(output) + 4


def test_long_broken_byte_run_stays_bounded(bytelevel_bpe: Any) -> None:
    # Token for byte 0xF0 (a 4-byte lead) over and over: every prefix ends inside a character.
    lead = bytelevel_bpe.convert_tokens_to_ids("ð")
    assert bytelevel_bpe.decode([lead]) == "\ufffd"
    emoji = bytelevel_bpe.encode("🎉", add_special_tokens=False)
    output = [lead] * 200 + emoji + [lead] * 50
    counting = CountingTokenizer(bytelevel_bpe)
    detok, deltas, _ = run_stream(counting, [], output)
    want = bytelevel_bpe.decode(output)
    assert detok.output_text == want == "".join(deltas)
    assert "🎉" in want
    assert counting.max_decode_len <= 40


def test_special_tokens_skipped_or_kept(smollm2_tokenizer: Any) -> None:
    output = [
        1,
        *smollm2_tokenizer.encode("Hi 🙂 there", add_special_tokens=False),
        2,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
    ]
    for skip in (True, False):
        counting = CountingTokenizer(smollm2_tokenizer)
        detok, deltas, _ = run_stream(counting, [], output, skip_special_tokens=skip)
        assert detok.output_text == smollm2_tokenizer.decode(output, skip_special_tokens=skip)
        assert "".join(deltas) == detok.output_text
        assert counting.max_decode_len <= 8
    assert "<|im_end|>" in smollm2_tokenizer.decode(output, skip_special_tokens=False)


def test_metaspace_first_token_keeps_the_prompt_space(metaspace_bpe: Any) -> None:
    prompt = metaspace_bpe.encode("hello world", add_special_tokens=False)
    output = metaspace_bpe.encode("hello the end", add_special_tokens=False)
    full = metaspace_bpe.decode(prompt + output)
    detok, deltas, _ = run_stream(metaspace_bpe, prompt, output)
    # Prompt text + output text reads as the whole; a bare decode of the output would lose
    # the space before its first word.
    assert metaspace_bpe.decode(prompt) + detok.output_text == full
    assert detok.output_text.startswith(" ")
    assert "".join(deltas) == detok.output_text
    # With no prompt, it is exactly the decode of the output.
    detok, _, _ = run_stream(metaspace_bpe, [], output)
    assert detok.output_text == metaspace_bpe.decode(output)


# ---------------------------------------------------------------------- stop strings

PIECES = ["Hel", "lo", " wor", "ld", ",", " the", " en", "d", ".", " More", " te", "xt", "\n"]


def test_stop_string_across_token_boundaries() -> None:
    tok = PieceTokenizer(PIECES)
    output = tok.encode("Hello world, the end. More text")
    for include, want in [(False, "Hello world,"), (True, "Hello world, the end")]:
        detok, deltas, matches = run_stream(
            tok, [], output, stop=[" the end"], include_stop_str_in_output=include
        )
        # Matched on the token that completes it (" the" " en" "d"), not before.
        end_idx = output.index(PIECES.index("d"))
        assert matches[end_idx] == " the end"
        assert all(m is None for m in matches[:end_idx])
        assert all(m is None for m in matches[end_idx + 1 :])
        assert detok.output_text == want and detok.finished
        assert detok.matched_stop == " the end"
        assert "".join(deltas) == want


def test_deltas_never_show_part_of_a_stop_string() -> None:
    tok = PieceTokenizer(PIECES)
    output = tok.encode("Hello world, the end. More text")
    detok = IncrementalDetokenizer(tok, [], True, [" the end"], False)
    shown = ""
    for t in output:
        detok.update([t])
        shown += detok.get_next_delta()
        # " the en" arrives before "d" completes the stop string; none of it may show.
        assert "Hello world,".startswith(shown)
    assert shown == "Hello world,"


def test_update_after_stop_is_ignored() -> None:
    tok = PieceTokenizer(PIECES)
    detok = IncrementalDetokenizer(tok, [], True, ["ld"], False)
    assert detok.update(tok.encode("Hello wor")) is None
    assert detok.update(tok.encode("ld")) == "ld"
    assert detok.update(tok.encode(", the end")) is None
    assert detok.finish() is None
    assert detok.output_text == "Hello wor"
    assert detok.get_next_delta() == "Hello wor"
    assert detok.get_next_delta() == ""


def test_earliest_completed_stop_wins() -> None:
    tok = PieceTokenizer(["abcdef", "a", "b", "c", "d", "e", "f"])
    # All in one token: "cd" completes (at 4) before "bcde" (at 5) and "ef" (at 6).
    detok = IncrementalDetokenizer(tok, [], True, ["ef", "bcde", "cd"], False)
    assert detok.update([0]) == "cd"
    assert detok.output_text == "ab"
    # Same end: the longer one (earlier start) wins.
    detok = IncrementalDetokenizer(tok, [], True, ["de", "bcde"], True)
    assert detok.update([0]) == "bcde"
    assert detok.output_text == "abcde"


def test_stop_at_start_and_no_stop() -> None:
    tok = PieceTokenizer(PIECES)
    detok, deltas, _ = run_stream(tok, [], tok.encode("Hello world"), stop=["Hel"])
    assert detok.output_text == "" and "".join(deltas) == ""
    detok, deltas, matches = run_stream(tok, [], tok.encode("Hello world"), stop=["xyz!"])
    assert matches == [None] * len(matches)
    assert detok.output_text == "Hello world" == "".join(deltas)
    # Held back while running: the last len("xyz!") - 1 = 3 characters.
    assert deltas[-1] == "rld"


@pytest.mark.parametrize("fixture", ["smollm2_tokenizer", "bytelevel_bpe"])
def test_random_stop_strings_on_real_text(fixture: str, request: pytest.FixtureRequest) -> None:
    tokenizer = request.getfixturevalue(fixture)
    rng = random.Random(2)
    for trial in range(120):
        text = rng.choice(REAL_TEXTS)
        output = tokenizer.encode(text, add_special_tokens=False)
        full = tokenizer.decode(output, skip_special_tokens=True)
        stops = []
        for _ in range(rng.randrange(1, 3)):
            a = rng.randrange(len(full))
            stops.append(full[a : a + rng.randrange(1, 6)])
        if trial % 5 == 0:
            stops.append("never appears ☃")
        include = rng.random() < 0.5
        detok = IncrementalDetokenizer(tokenizer, [], True, stops, include)
        shown = ""
        matched = None
        pos = 0
        for n in random_chunks(rng, len(output)):
            matched = detok.update(output[pos : pos + n]) or matched
            pos += n
            shown += detok.get_next_delta()
            # Nothing shown is ever taken back.
            assert detok.output_text.startswith(shown)
        detok.finish()
        shown += detok.get_next_delta()
        assert shown == detok.output_text

        # Reference: cut the full text at the stop string that completes first.
        ends = [
            (full.find(s) + len(s), full.find(s), s) for s in stops if full.find(s) >= 0 and s != ""
        ]
        if not ends:
            assert matched is None and detok.output_text == full
            continue
        end, start, stop_str = min(ends, key=lambda e: (e[0], e[1]))
        assert matched == stop_str == detok.matched_stop
        assert detok.output_text == (full[:end] if include else full[:start])
