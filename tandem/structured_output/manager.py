"""The engine's structured-output manager: grammars compiled on a thread pool, cached by spec.

    add_request ──▶ grammar_for(request) ──▶ a compile on the pool (or a cache hit)
                     └─ request.grammar: GrammarRequestState  (tandem.core.structured)
    schedule()  ──▶ poll(): COMPILING (passed over) / READY (matcher built from the output
                    tokens) / FAILED (the request ends with the error)
    step        ──▶ fill_bitmask(the step's structured rows)  (after the previous step's
                    tokens landed)  ──▶ the sampler masks those rows on the device
    update      ──▶ sync(): the matcher follows the output tokens; is_terminated() stops

One xgrammar `TokenizerInfo` per engine, built on the pool with the first compile (the
logits' width is the vocabulary: ids past the tokenizer's are never allowed). Compiles run
in a thread pool (xgrammar releases the GIL), so the step loop never waits for one. The cache
maps a spec's `key` to its compile (a future); `cache_size` compiled grammars are kept (least
recently used evicted). Every kind of spec has the time limit: a compile still running
`compile_timeout_s` after it started fails its requests ("did not compile within ...") and
later requests with the same spec fail at once; the thread itself cannot be stopped and
finishes in the background.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from tandem.config import StructuredOutputsConfig
from tandem.core.outputs import GrammarBitmask
from tandem.core.structured import GrammarStatus
from tandem.request import Request
from tandem.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# A batched bitmask fill uses one more thread per this many rows (see `_fill_threads`).
_MIN_ROWS_PER_FILL_THREAD = 32

_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class StructuredOutputError(ValueError):
    """An unusable structured-output spec; the message names the field and the problem."""


def spec_key(spec: StructuredOutputsParams) -> tuple[str, str]:
    """The cache key of a spec: its kind and a canonical text (a JSON schema given as a dict
    or as text compiles once)."""
    kind = spec.kind
    if kind == "json":
        value = spec.json
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                return kind, value  # invalid: fails to compile, under its own text
        return kind, json.dumps(value, sort_keys=True, separators=(",", ":"))
    if kind == "regex":
        return kind, str(spec.regex)
    if kind == "choice":
        return kind, json.dumps(list(spec.choice or ()))
    if kind == "grammar":
        return kind, str(spec.grammar)
    return kind, ""


# JSON-schema keywords xgrammar does not enforce (it would ignore them silently, and outputs
# would not validate): a schema using one is refused, naming it.
UNSUPPORTED_SCHEMA_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "dependentSchemas",
        "dependentRequired",
        "unevaluatedProperties",
        "unevaluatedItems",
        "contains",
        "minContains",
        "maxContains",
        "uniqueItems",
        "multipleOf",
        "propertyNames",
    }
)
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "additionalItems")


def unsupported_schema_feature(schema: Any, path: str = "") -> str | None:
    """The first schema keyword (with its location) that xgrammar would not enforce, or None:
    an unsupported keyword, or a `$ref` outside the schema itself."""
    if isinstance(schema, list):
        for i, sub in enumerate(schema):
            found = unsupported_schema_feature(sub, f"{path}/{i}")
            if found:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    for key in schema:
        if key in UNSUPPORTED_SCHEMA_KEYWORDS:
            return f"'{key}' at {path or '/'}"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"a $ref outside the schema ({ref!r}) at {path or '/'}"
    for key in _SUBSCHEMA_MAPS:
        subs = schema.get(key)
        if isinstance(subs, dict):
            for name, sub in subs.items():
                found = unsupported_schema_feature(sub, f"{path}/{key}/{name}")
                if found:
                    return found
    for key in _SUBSCHEMA_LISTS + _SUBSCHEMAS:
        if key in schema:
            found = unsupported_schema_feature(schema[key], f"{path}/{key}")
            if found:
                return found
    return None


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _clean(exc: BaseException) -> str:
    text = str(exc).strip()
    text = _XGR_PREFIX.sub("", text)
    return text.splitlines()[0] if text else type(exc).__name__


def _import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise StructuredOutputError(
            "structured_outputs need the xgrammar package: pip install 'tandem[serve]'"
        ) from exc
    return xgrammar


class _Compile:
    """One spec's compile: its future, when it started running, and its failure if any."""

    __slots__ = ("error", "future", "key", "started")

    def __init__(self, key: tuple[str, str]) -> None:
        self.key = key
        self.future: Future[Any] | None = None
        self.started: float | None = None
        self.error: str | None = None


class StructuredOutputManager:
    """Compiles, caches and matches the grammars of one engine's requests (see the module
    docstring). `load_tokenizer` returns the Hugging Face tokenizer (called once, on the
    pool); `vocab_size` is the logits' width; `stop_token_ids` end a grammar's output."""

    def __init__(
        self,
        config: StructuredOutputsConfig,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        max_num_seqs: int,
        stop_token_ids: Sequence[int] = (),
        pin_memory: bool = False,
    ) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.bitmask_words = -(-vocab_size // 32)
        self._load_tokenizer = load_tokenizer
        self._stop_token_ids = list(stop_token_ids)
        self._pin_memory = pin_memory
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: Future[Any] | None = None
        self._cache: OrderedDict[tuple[str, str], _Compile] = OrderedDict()
        self._lock = threading.Lock()
        self._buffers: list[torch.Tensor] = []
        self._next_buffer = 0
        self._batch_matchers: dict[int, Any] = {}
        # Host time spent filling bitmasks, and how many fills (for the benchmark).
        self.fill_seconds = 0.0
        self.num_fills = 0

    # ------------------------------------------------------------------ compiles

    def _ensure_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=max(self.config.compile_threads, 1), thread_name_prefix="grammar"
            )
            self._compiler = self._pool.submit(self._build_compiler)
        return self._pool

    def _build_compiler(self) -> Any:
        xgr = _import_xgrammar()
        t0 = time.perf_counter()
        tokenizer = self._load_tokenizer()
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer,
            vocab_size=self.vocab_size,
            stop_token_ids=self._stop_token_ids or None,
        )
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        logger.info("structured outputs: tokenizer info in %.2fs", time.perf_counter() - t0)
        return compiler

    def compiler(self) -> Any:
        """The engine's `GrammarCompiler` (waits for the tokenizer info on first use)."""
        self._ensure_pool()
        assert self._compiler is not None
        return self._compiler.result()

    def _compile(self, entry: _Compile, spec: StructuredOutputsParams) -> Any:
        assert self._compiler is not None
        compiler = self._compiler.result()  # the tokenizer info, first (not timed)
        entry.started = time.monotonic()
        kind = spec.kind
        whitespace = not self.config.disable_any_whitespace
        try:
            if kind == "json":
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                try:
                    parsed = json.loads(schema)
                except (ValueError, RecursionError) as exc:
                    raise StructuredOutputError(
                        f"structured_outputs.json: the schema is not valid JSON: {exc}"
                    ) from None
                if not isinstance(parsed, dict | bool):
                    raise StructuredOutputError(
                        "structured_outputs.json: a JSON schema must be an object"
                    )
                unsupported = unsupported_schema_feature(parsed)
                if unsupported:
                    raise StructuredOutputError(
                        f"structured_outputs.json: unsupported JSON schema feature {unsupported}"
                    )
                return compiler.compile_json_schema(schema, any_whitespace=whitespace)
            if kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_ebnf(spec.choice or ()))
            return compiler.compile_grammar(spec.grammar)
        except StructuredOutputError:
            raise
        except Exception as exc:
            raise StructuredOutputError(
                f"structured_outputs.{kind}: invalid {_WHAT[kind]}: {_clean(exc)}"
            ) from exc

    def submit(self, spec: StructuredOutputsParams) -> _Compile:
        """The compile of `spec`: from the cache, or started now on the pool."""
        key = spec_key(spec)
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                return entry
            entry = _Compile(key)
            entry.future = self._ensure_pool().submit(self._compile, entry, spec)
            self._cache[key] = entry
            while len(self._cache) > max(self.config.grammar_cache_size, 1):
                self._cache.popitem(last=False)
        return entry

    def status(self, entry: _Compile) -> GrammarStatus:
        """READY, COMPILING, or FAILED (with `entry.error`): an invalid spec, or one still
        compiling `compile_timeout_s` after its compile started."""
        if entry.error is not None:
            return GrammarStatus.FAILED
        future = entry.future
        assert future is not None
        if future.done():
            exc = future.exception()
            if exc is None:
                return GrammarStatus.READY
            entry.error = str(exc) if isinstance(exc, StructuredOutputError) else _clean(exc)
            return GrammarStatus.FAILED
        started = entry.started
        limit = self.config.compile_timeout_s
        if started is not None and limit > 0 and time.monotonic() - started > limit:
            entry.error = (
                f"structured_outputs.{entry.key[0]}: the grammar did not compile within "
                f"{limit:g} s (--structured-outputs-compile-timeout)"
            )
            logger.warning("%s", entry.error)
            return GrammarStatus.FAILED
        return GrammarStatus.COMPILING

    def wait_any(self, timeout: float) -> None:
        """Block up to `timeout` seconds until some compile still running finishes (the
        engine calls this when nothing could run because every request waits for one)."""
        with self._lock:
            running = [
                e.future
                for e in self._cache.values()
                if e.future is not None and not e.future.done() and e.error is None
            ]
        if running:
            wait_futures(running, timeout=timeout, return_when="FIRST_COMPLETED")

    def grammar_for(self, request: Request) -> GrammarRequestState:
        """The grammar state of a request with structured outputs (its compile started)."""
        spec = request.sampling_params.structured_outputs
        assert spec is not None
        return GrammarRequestState(self, self.submit(spec), request)

    # ------------------------------------------------------------------ bitmasks

    def _buffer(self, rows: int) -> torch.Tensor:
        """A host int32 `[rows, words]` buffer from a rotation of two (a step's bitmask is
        copied to the device while the next is filled)."""
        if not self._buffers or self._buffers[0].shape[0] < rows:
            size = max(self.max_num_seqs, rows, 1)
            self._buffers = [
                torch.empty(
                    (size, self.bitmask_words), dtype=torch.int32, pin_memory=self._pin_memory
                )
                for _ in range(2)
            ]
        buf = self._buffers[self._next_buffer % 2]
        self._next_buffer += 1
        return buf[:rows]

    def fill_bitmask(
        self, req_ids: Sequence[str], requests: Mapping[str, Request]
    ) -> GrammarBitmask:
        """The allowed next tokens of `req_ids` (a step's structured rows), in that order.

        A request no longer in `requests` (it finished after the step was planned: its token
        will be dropped) gets a full row; a terminated grammar allows only its stop tokens."""
        t0 = time.perf_counter()
        xgr = _import_xgrammar()
        bitmask = self._buffer(len(req_ids))
        matchers: list[Any] = []
        indices: list[int] = []
        for i, rid in enumerate(req_ids):
            request = requests.get(rid)
            state = request.grammar if request is not None else None
            matcher = state.matcher if isinstance(state, GrammarRequestState) else None
            if matcher is None or matcher.is_terminated():
                bitmask[i].fill_(-1)  # its token is dropped: the request has finished
                continue
            matchers.append(matcher)
            indices.append(i)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, indices[0])
        elif matchers:
            threads = self._fill_threads(len(matchers))
            batch = self._batch_matchers.get(threads)
            if batch is None:
                batch = self._batch_matchers[threads] = xgr.BatchGrammarMatcher(threads)
            batch.batch_fill_next_token_bitmask(matchers, bitmask, indices)
        self.fill_seconds += time.perf_counter() - t0
        self.num_fills += 1
        return GrammarBitmask(list(req_ids), bitmask)

    def _fill_threads(self, rows: int) -> int:
        """Threads for a batched fill: waking threads costs more than a few rows' masks."""
        if self.config.bitmask_threads:
            return self.config.bitmask_threads
        if rows < _MIN_ROWS_PER_FILL_THREAD * 2:
            return 1
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        return max(1, min(8, cores // 2, rows // _MIN_ROWS_PER_FILL_THREAD))

    def shutdown(self) -> None:
        """Stop the pool (compiles still running finish in the background)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON grammar",
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "EBNF grammar",
}


class GrammarRequestState:
    """One request's grammar: its compile and, once compiled, its matcher, which follows the
    request's output token ids (`tandem.core.structured.GrammarState`)."""

    def __init__(self, manager: StructuredOutputManager, entry: _Compile, request: Request):
        self._manager = manager
        self._entry = entry
        # The request's own list: appended to by the scheduler, read here.
        self._tokens = request.output_token_ids
        eos = request.eos_token_id
        ignore_eos = request.sampling_params.ignore_eos
        self._stop_tokens = [eos] if eos is not None and not ignore_eos else None
        self.matcher: Any = None
        self._num_accepted = 0
        self._error: str | None = None

    @property
    def error(self) -> str | None:
        return self._error or self._entry.error

    def poll(self) -> GrammarStatus:
        if self.matcher is not None:
            return GrammarStatus.READY
        if self._error is not None:
            return GrammarStatus.FAILED
        status = self._manager.status(self._entry)
        if status != GrammarStatus.READY:
            return status
        self._build()
        if not self.sync():
            self._error = (
                "structured_outputs: the output so far does not follow the grammar "
                f"(token {self._tokens[self._num_accepted]} at {self._num_accepted})"
            )
            self.matcher = None
            return GrammarStatus.FAILED
        return GrammarStatus.READY

    def _build(self) -> None:
        xgr = _import_xgrammar()
        assert self._entry.future is not None
        self.matcher = xgr.GrammarMatcher(
            self._entry.future.result(),
            override_stop_tokens=self._stop_tokens,
        )
        self._num_accepted = 0

    def sync(self) -> bool:
        matcher = self.matcher
        if matcher is None:
            return True  # not compiled yet (or reset): the tokens are replayed when it is
        tokens = self._tokens
        n = len(tokens)
        if n < self._num_accepted:
            self.rollback(self._num_accepted - n)
        while self._num_accepted < n:
            if not matcher.accept_token(tokens[self._num_accepted]):
                return False
            self._num_accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens (xgrammar keeps every step)."""
        if num_tokens <= 0 or self.matcher is None:
            return
        num_tokens = min(num_tokens, self._num_accepted)
        self.matcher.rollback(num_tokens)
        self._num_accepted -= num_tokens

    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()

    def reset(self) -> None:
        if self.matcher is not None:
            self.matcher = None
            self._num_accepted = 0
