"""Tool calls in generated text: one streaming parser per format.

A parser belongs to one choice. `feed(text)` takes the choice's next released text and
returns a `ParsedDelta`: the content the client may see now and tool-call deltas (a call's
first delta carries its id and name; later ones more of its arguments); `finish()` flushes
what was held back. Non-streaming responses accumulate the very same deltas, so a streamed
and a non-streamed answer agree by construction: each call's `arguments` is the raw JSON
text the model wrote for them, the concatenation of its deltas' arguments.

Formats (`--tool-call-parser`, vLLM's names)::

    hermes, qwen   content <tool_call>{"name": "f", "arguments": {...}}</tool_call> ...
                   (Hermes 2 Pro; Qwen2.5 and Qwen3 use these same tags)
    llama3_json    [<|python_tag|>]{"name": "f", "parameters": {...}}[; {...}]
                   (the whole output is calls, or it is all content)
    mistral        content [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
                   or (v11+ tokenizers) content [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]...
                   (with [CALL_ID]id before [ARGS] in some; [ARGS] left out in others)
    granite        content <|tool_call|>[{"name": "f", "arguments": {...}}, ...]
                   (or <tool_call>[...]: Granite 3.1 on)
    forced, by tool_choice (structured.py builds the grammar they assume):
    named          the whole output is the named function's arguments
    required       [{"name": "f", "arguments": {...}}, ...]

Content held back: text that may be the start of a tag (`<tool_` at the end), and trailing
whitespace (dropped when a call follows, released before any other text and at the end of an
output without calls), so an output without tool calls comes out as content unchanged.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tandem.core.outputs import FinishReason
from tandem_services.frontend.structured import ToolCalling
from tandem_services.frontend.types import ChoiceDelta, StepEvent, ToolCallDelta

_WS = " \t\n\r"
_ARGUMENT_KEYS = ("arguments", "parameters")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedDelta:
    """What one `feed` or `finish` released: content text and tool-call deltas (at most one
    per call)."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add_call(self, d: ToolCallDelta) -> None:
        for i, have in enumerate(self.tool_calls):
            if have.index == d.index:
                self.tool_calls[i] = have.then(d)
                return
        self.tool_calls.append(d)

    def then(self, later: ParsedDelta) -> ParsedDelta:
        out = ParsedDelta(self.content + later.content, list(self.tool_calls))
        for d in later.tool_calls:
            out.add_call(d)
        return out


class _ValueScanner:
    """Finds where one JSON value ends, fed incrementally (brackets and strings tracked; the
    value is not validated). A scalar ends at the first delimiter, or at the end of the text
    once no more comes (`final`)."""

    def __init__(self) -> None:
        self.kind = ""  # "nest" ({ or [), "str" or "scalar"
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.done = False

    def feed(self, buf: str, i: int, final: bool) -> int:
        """Scans from `buf[i]`; returns the index after the value (done) or len(buf)."""
        n = len(buf)
        if not self.kind:
            c = buf[i]
            if c in "{[":
                self.kind, self.depth = "nest", 1
                i += 1
            elif c == '"':
                self.kind, self.in_str = "str", True
                i += 1
            else:
                self.kind = "scalar"
        if self.kind == "scalar":
            while i < n and buf[i] not in ",}]" + _WS:
                i += 1
            self.done = i < n or final
            return i
        while i < n:
            c = buf[i]
            i += 1
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
                    if self.kind == "str":
                        self.done = True
                        return i
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i
        return i


class _CallObject:
    """One `{"name": ..., "arguments" | "parameters": ...}` object parsed incrementally from
    `buf[start]` (a "{"). Records the name, where the arguments' raw text lies and the
    object's end; keys in any order, others ignored."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.pos = start + 1
        self.state = "key_or_end"  # key_or_end, key, in_key, colon, value, in_value, next
        self.scanner = _ValueScanner()
        self.tok_start = 0
        self.key = ""
        self.first_key: str | None = None
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.args_kind = ""
        self.done = False
        self.error = False
        self.end = 0
        # Emission (by the format parser): the call's index once committed, arguments sent.
        self.index: int | None = None
        self.sent = 0

    def advance(self, buf: str, final: bool) -> None:
        n = len(buf)
        while self.pos < n and not (self.done or self.error):
            c = buf[self.pos]
            st = self.state
            if st in ("key_or_end", "key", "colon", "value", "next") and c in _WS:
                self.pos += 1
            elif st in ("key_or_end", "key"):
                if c == '"':
                    self.scanner, self.tok_start, self.state = _ValueScanner(), self.pos, "in_key"
                elif c == "}" and st == "key_or_end":
                    self._close()
                else:
                    self.error = True
            elif st == "in_key":
                self.pos = self.scanner.feed(buf, self.pos, final)
                if not self.scanner.done:
                    return
                try:
                    self.key = json.loads(buf[self.tok_start : self.pos])
                except ValueError:
                    self.error = True
                    return
                if self.first_key is None:
                    self.first_key = self.key
                self.state = "colon"
            elif st == "colon":
                if c != ":":
                    self.error = True
                self.pos += 1
                self.state = "value"
            elif st == "value":
                self.scanner, self.tok_start, self.state = _ValueScanner(), self.pos, "in_value"
                if self.key in _ARGUMENT_KEYS and self.args_start is None:
                    self.args_start, self.args_kind = self.pos, c
            elif st == "in_value":
                self.pos = self.scanner.feed(buf, self.pos, final)
                if not self.scanner.done:
                    return
                self._value_done(buf)
                self.state = "next"
            else:  # next
                if c == ",":
                    self.pos += 1
                    self.state = "key"
                elif c == "}":
                    self._close()
                else:
                    self.error = True

    def _close(self) -> None:
        self.pos += 1
        self.done = True
        self.end = self.pos

    def _value_done(self, buf: str) -> None:
        raw = buf[self.tok_start : self.pos]
        if self.key == "name" and self.name is None:
            try:
                name = json.loads(raw)
            except ValueError:
                name = None
            if not isinstance(name, str):
                self.error = True
                return
            self.name = name
        elif self.args_start == self.tok_start:
            self.args_end = self.pos

    def arguments(self, buf: str) -> str:
        """The arguments text that can be sent now: an object's raw text as far as it came;
        a string's content or a scalar once complete; "{}" for none (null or absent)."""
        if self.args_start is None:
            return "{}" if self.done else ""
        if self.args_kind in "{[":
            return buf[self.args_start : self.args_end if self.args_end is not None else self.pos]
        if self.args_end is None:
            return ""
        raw = buf[self.args_start : self.args_end]
        if self.args_kind == '"':
            try:
                return str(json.loads(raw))
            except ValueError:
                return raw
        return "{}" if raw == "null" else raw


class ToolParser(ABC):
    """The per-choice streaming parser (see the module docstring). Subclasses implement
    `_advance`, moving `pos` through `buf` and reporting through `_text` and `_sync`.

    `TAGS`: the format's marker strings; where the tokenizer makes them special tokens, the
    request is detokenized with them (skip_special_tokens off), or the parser never sees them.
    """

    TAGS: tuple[str, ...] = ()

    def __init__(self, tool_names: Sequence[str] = ()) -> None:
        self.tool_names = frozenset(tool_names)
        self.buf = ""
        self.pos = 0
        self.num_calls = 0
        self._held_ws = ""
        self._out = ParsedDelta()

    def feed(self, text: str) -> ParsedDelta:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> ParsedDelta:
        out = self._run(final=True)
        if self._held_ws and not self.num_calls:
            out.content += self._held_ws
        self._held_ws = ""
        return out

    def _run(self, final: bool) -> ParsedDelta:
        self._out = ParsedDelta()
        self._advance(final)
        out, self._out = self._out, ParsedDelta()
        return out

    @abstractmethod
    def _advance(self, final: bool) -> None: ...

    # ------------------------------------------------------------------ helpers

    def _text(self, s: str) -> None:
        """Content from the model (outside any call)."""
        if not s:
            return
        s = self._held_ws + s
        body = s.rstrip(_WS)
        self._held_ws = s[len(body) :]
        self._out.content += body

    def _call_starts(self) -> None:
        self._held_ws = ""

    def _skip_ws(self) -> None:
        while self.pos < len(self.buf) and self.buf[self.pos] in _WS:
            self.pos += 1

    def _commit(self, call: _CallObject | _ArgumentsValue) -> None:
        if call.index is None and call.name is not None:
            call.index = self.num_calls
            self.num_calls += 1
            self._out.add_call(ToolCallDelta(call.index, new_call_id(), call.name))

    def _advance_call(self, call: _CallObject | _ArgumentsValue, final: bool) -> None:
        """Scans `call` on; once its name is known it becomes a call (its first delta), and
        its new arguments go out."""
        call.advance(self.buf, final)
        if call.name is not None and call.index is None:
            self._call_starts()
            self._commit(call)
        self._sync(call)

    def _sync(self, call: _CallObject | _ArgumentsValue) -> None:
        """Sends a committed call's new arguments."""
        if call.index is None:
            return
        args = call.arguments(self.buf)
        if len(args) > call.sent:
            self._out.add_call(ToolCallDelta(call.index, arguments=args[call.sent :]))
            call.sent = len(args)

    def _pending_tag(self, tag: str, final: bool) -> int:
        """Where text that may be the start of `tag` begins at the end of `buf` (len(buf)
        if none, or when `final`)."""
        n = len(self.buf)
        if final:
            return n
        for k in range(min(len(tag) - 1, n - self.pos), 0, -1):
            if tag.startswith(self.buf[n - k :]):
                return n - k
        return n


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, any number, among content
    (Hermes 2 Pro, Qwen2.5, Qwen3)."""

    START = "<tool_call>"
    END = "</tool_call>"
    TAGS = (START, END)

    def __init__(self, tool_names: Sequence[str] = ()) -> None:
        super().__init__(tool_names)
        self.state = "text"  # text, pre_call, call, post_call
        self.tag_start = 0
        self.call: _CallObject | None = None

    def _advance(self, final: bool) -> None:
        buf = self.buf
        while True:
            if self.state == "text":
                j = buf.find(self.START, self.pos)
                if j < 0:
                    k = self._pending_tag(self.START, final)
                    self._text(buf[self.pos : k])
                    self.pos = k
                    return
                self._text(buf[self.pos : j])
                self.tag_start, self.pos, self.state = j, j + len(self.START), "pre_call"
            elif self.state == "pre_call":
                self._skip_ws()
                if self.pos == len(buf):
                    if final:
                        self._text(buf[self.tag_start :])
                    return
                if buf[self.pos] != "{":
                    self._text(buf[self.tag_start : self.pos])
                    self.state = "text"
                    continue
                self.call, self.state = _CallObject(self.pos), "call"
            elif self.state == "call":
                call = self.call
                assert call is not None
                self._advance_call(call, final)
                if call.error or (final and not call.done):
                    # Not a call after all (or cut short): content, unless already sent.
                    if call.index is None:
                        self._text(buf[self.tag_start : call.pos])
                    self.pos, self.state = call.pos, "text"
                    continue
                if not call.done:
                    return
                self.pos, self.state = call.end, "post_call"
            else:  # post_call
                self._skip_ws()
                rest = buf[self.pos :]
                if rest.startswith(self.END):
                    self.pos += len(self.END)
                elif not final and self.END.startswith(rest):
                    return
                self.state = "text"


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1-3.3's JSON calls: the output is `{"name": ..., "parameters": ...}` (after an
    optional `<|python_tag|>`), several separated by ";". An output that does not start with
    a call to one of the tools (first key "name", a known name) is all content."""

    PYTHON_TAG = "<|python_tag|>"
    TAGS = (PYTHON_TAG,)

    def __init__(self, tool_names: Sequence[str] = ()) -> None:
        super().__init__(tool_names)
        self.state = "start"  # start, call, sep, text
        self.seg_start = 0
        self.call: _CallObject | None = None

    def _fallback(self) -> None:
        """What looked like a call is content, from its segment's start on."""
        self.pos, self.state = self.seg_start, "text"

    def _advance(self, final: bool) -> None:
        buf = self.buf
        while True:
            if self.state == "text":
                self._text(buf[self.pos :])
                self.pos = len(buf)
                return
            if self.state == "start":
                self._skip_ws()
                rest = buf[self.pos :]
                if rest.startswith(self.PYTHON_TAG):
                    self.pos += len(self.PYTHON_TAG)
                    continue
                if not rest or (not final and self.PYTHON_TAG.startswith(rest)):
                    if final:
                        self._fallback()
                        continue
                    return
                if rest[0] != "{":
                    self._fallback()
                    continue
                self.call, self.state = _CallObject(self.pos), "call"
            elif self.state == "call":
                call = self.call
                assert call is not None
                call.advance(buf, final)
                if call.index is None:
                    known = call.name is not None and (
                        not self.tool_names or call.name in self.tool_names
                    )
                    wrong = call.first_key is not None and call.first_key != "name"
                    if wrong or call.error or (call.name is not None and not known):
                        self._fallback()
                        continue
                    if known:
                        self._call_starts()
                        self._commit(call)
                self._sync(call)
                if call.done:
                    self.pos, self.state = call.end, "sep"
                    continue
                if call.error or final:
                    if call.index is None:
                        self._fallback()
                        continue
                    self.pos, self.state = call.pos, "text"
                    continue
                return
            else:  # sep
                self._skip_ws()
                if self.pos == len(buf):
                    return
                if buf[self.pos] == ";":
                    self.pos += 1
                    self.seg_start, self.state = self.pos, "start"
                else:
                    self.state = "text"


# TaggedListToolParser's own states (a format's others go to `_advance_other`).
_LIST_STATES = frozenset(("text", "open", "elem", "call", "next", "after"))


class TaggedListToolParser(ToolParser):
    """A marker, then a JSON list of `{"name": ..., "arguments": ...}` calls, after any
    content (Mistral's `[TOOL_CALLS]`, Granite's `<|tool_call|>` / `<tool_call>`). A marker
    not followed by a list (or a single call object) is content; text after the list is
    content."""

    STARTS: tuple[str, ...] = ()

    def __init__(self, tool_names: Sequence[str] = ()) -> None:
        super().__init__(tool_names)
        self.state = "text"  # text, open, elem, call, next, after
        self.tag_start = 0
        self.in_list = False
        self.call: _CallObject | _ArgumentsValue | None = None

    def _find_start(self) -> tuple[int, str] | None:
        found = [(j, t) for t in self.STARTS if (j := self.buf.find(t, self.pos)) >= 0]
        return min(found) if found else None

    def _fallback(self) -> None:
        """The marker and what followed it are content (no call was sent from them)."""
        self._text(self.buf[self.tag_start : self.pos])
        self.state = "after" if self.num_calls else "text"

    def _open_other(self, c: str) -> bool:
        """After the marker, a character that starts no list or object: True when the
        format reads it its own way (`_advance_other`), else it is content."""
        return False

    def _advance_other(self, final: bool) -> bool:
        """A state of the format's own; True: go on, False: wait for more text."""
        raise AssertionError(self.state)

    def _advance(self, final: bool) -> None:
        buf = self.buf
        while True:
            if self.state not in _LIST_STATES:
                if self._advance_other(final):
                    continue
                return
            if self.state in ("text", "after"):
                start = self._find_start() if self.state == "text" else None
                if start is None:
                    k = min((self._pending_tag(t, final) for t in self.STARTS), default=len(buf))
                    k = len(buf) if self.state == "after" else k
                    self._text(buf[self.pos : k])
                    self.pos = k
                    return
                j, tag = start
                self._text(buf[self.pos : j])
                self.tag_start, self.pos, self.state = j, j + len(tag), "open"
                continue
            if self.state == "call":
                call = self.call
                assert isinstance(call, _CallObject)
                self._advance_call(call, final)
                if call.done:
                    self.pos, self.state = call.end, "next" if self.in_list else "after"
                    continue
                if call.error or final:
                    if call.index is None:
                        self.pos = len(buf) if final else call.pos
                        self._fallback()
                    else:
                        self.pos, self.state = call.pos, "after"
                    continue
                return
            self._skip_ws()
            if self.pos == len(buf):
                if final and self.state in ("open", "elem"):
                    self._fallback()
                    continue
                return
            c = buf[self.pos]
            if self.state == "open":
                if c == "[":
                    self.pos, self.in_list, self.state = self.pos + 1, True, "elem"
                elif c == "{":
                    self.in_list, self.state = False, "elem"
                elif not self._open_other(c):
                    self._fallback()
            elif self.state == "elem":
                if c == "{":
                    self.call, self.state = _CallObject(self.pos), "call"
                else:
                    self._fallback()
            else:  # next
                self.pos += 1
                self.state = "elem" if c == "," else "after"


class MistralToolParser(TaggedListToolParser):
    """Mistral's `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v0.3 tokenizers),
    and the v11+ form, one marker per call with its name first: `[TOOL_CALLS]name[ARGS]
    {...}`, `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` or `[TOOL_CALLS]name{...}`. A name that
    is not a plain identifier, or no arguments after it, leaves the marker and what follows
    as content."""

    STARTS = ("[TOOL_CALLS]",)
    TAGS = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
    _AFTER_NAME = ("[ARGS]", "[CALL_ID]", "{")

    def __init__(self, tool_names: Sequence[str] = ()) -> None:
        super().__init__(tool_names)
        self.name_start = 0
        self.name = ""

    def _open_other(self, c: str) -> bool:
        if not _is_name_char(c):
            return False
        self.name_start, self.state = self.pos, "name"
        return True

    def _advance_other(self, final: bool) -> bool:
        buf = self.buf
        if self.state == "name":  # up to [ARGS], [CALL_ID] or the arguments' "{"
            i = self.pos
            while i < len(buf) and _is_name_char(buf[i]):
                i += 1
            self.pos = i
            rest = buf[i:]
            marker = next((m for m in self._AFTER_NAME if rest.startswith(m)), None)
            if marker is None:
                partial = any(m.startswith(rest) for m in self._AFTER_NAME)
                if final or not partial:
                    self.pos = len(buf) if final else i
                    self._fallback()
                    return True
                return False  # the name or a marker may go on
            self.name = buf[self.name_start : i]
            self.pos = i if marker == "{" else i + len(marker)
            self.state = "call_id" if marker == "[CALL_ID]" else "args"
            return True
        if self.state == "call_id":  # the model's own id, up to [ARGS]
            j = buf.find("[ARGS]", self.pos)
            if j < 0:
                if final:
                    self.pos = len(buf)
                    self._fallback()
                    return True
                return False
            self.pos, self.state = j + len("[ARGS]"), "args"
            return True
        if self.state == "args":
            self._skip_ws()
            if self.pos == len(buf):
                if final:
                    self._fallback()
                    return True
                return False
            if buf[self.pos] not in "{[":
                self._fallback()
                return True
            self.call, self.state = _ArgumentsValue(self.name, self.pos), "value"
            return True
        # value: the arguments as they come; then another call may follow
        call = self.call
        assert isinstance(call, _ArgumentsValue)
        self._advance_call(call, final)
        if call.done or final:
            self.pos, self.state = call.pos, "text"
            return True
        return False


def _is_name_char(c: str) -> bool:
    return c.isalnum() or c in "_-."


class GraniteToolParser(TaggedListToolParser):
    """Granite 3.x's `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]` (3.0's special
    token, or the `<tool_call>` text of later releases)."""

    STARTS = ("<|tool_call|>", "<tool_call>")
    TAGS = STARTS


class RequiredToolParser(ToolParser):
    """`tool_choice: "required"`: the output is `[{"name": ..., "arguments": ...}, ...]`
    (generated under structured.required_schema); nothing is content."""

    def __init__(self, tool_names: Sequence[str] = ()) -> None:
        super().__init__(tool_names)
        self.state = "start"  # start, elem, call, next, end
        self.call: _CallObject | None = None

    def _advance(self, final: bool) -> None:
        buf = self.buf
        while self.state != "end":
            if self.state == "call":
                call = self.call
                assert call is not None
                call.advance(buf, final)
                self._commit(call)
                self._sync(call)
                if call.error:
                    self.state = "end"
                elif call.done:
                    self.pos, self.state = call.end, "next"
                else:
                    return
                continue
            self._skip_ws()
            if self.pos == len(buf):
                return
            c = buf[self.pos]
            if self.state == "start":
                self.pos += 1
                self.state = "elem" if c == "[" else "end"
            elif self.state == "elem":
                if c == "{":
                    self.call, self.state = _CallObject(self.pos), "call"
                else:
                    self.state = "end"
            else:  # next
                self.pos += 1
                self.state = "elem" if c == "," else "end"


class _ArgumentsValue:
    """A call whose name came before its arguments (Mistral v11+): the arguments' JSON value
    from `buf[start]`, scanned as it comes; the format parser's call protocol (`name`,
    `index`, `sent`, `arguments`)."""

    def __init__(self, name: str, start: int) -> None:
        self.name = name
        self.start = start
        self.scanner = _ValueScanner()
        self.pos = start
        self.done = False
        self.index: int | None = None
        self.sent = 0

    def advance(self, buf: str, final: bool) -> None:
        if self.pos < len(buf) and not self.done:
            self.pos = self.scanner.feed(buf, self.pos, final)
            self.done = self.scanner.done

    def arguments(self, buf: str) -> str:
        return buf[self.start : self.pos]


class NamedToolParser(ToolParser):
    """`tool_choice` naming a function: the whole output is its arguments."""

    def __init__(self, function: str) -> None:
        super().__init__((function,))
        self.function = function

    def _advance(self, final: bool) -> None:
        if not self.num_calls:
            self.num_calls = 1
            self._out.add_call(ToolCallDelta(0, new_call_id(), self.function))
        if self.pos < len(self.buf):
            self._out.add_call(ToolCallDelta(0, arguments=self.buf[self.pos :]))
            self.pos = len(self.buf)


# vLLM's --tool-call-parser names -> the format's parser.
AUTO_TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "granite": GraniteToolParser,
}


def render_tool_calls(parser: str | None, calls: Sequence[tuple[str, str]]) -> str:
    """(name, arguments JSON) calls as the text a model of `parser`'s format writes (Hermes
    tags by default): for chat templates that do not render `tool_calls` themselves."""
    if parser == "llama3_json":
        return "; ".join(f'{{"name": {json.dumps(n)}, "parameters": {a}}}' for n, a in calls)
    if parser in ("mistral", "granite"):
        listed = ", ".join(f'{{"name": {json.dumps(n)}, "arguments": {a}}}' for n, a in calls)
        return f"{AUTO_TOOL_PARSERS[parser].TAGS[0]}[{listed}]"
    return "\n".join(
        f'<tool_call>\n{{"name": {json.dumps(n)}, "arguments": {a}}}\n</tool_call>'
        for n, a in calls
    )


def parser_factory(calling: ToolCalling, auto_parser: str | None) -> Callable[[], ToolParser]:
    """A new parser per choice for a request's tool calling."""
    names = calling.names
    if calling.mode == "named":
        function = calling.function
        assert function is not None
        return lambda: NamedToolParser(function)
    if calling.mode == "required":
        return lambda: RequiredToolParser(names)
    if auto_parser not in AUTO_TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {auto_parser!r}")
    cls = AUTO_TOOL_PARSERS[auto_parser]
    return lambda: cls(names)


class ToolCallExtractor:
    """A request's choices' text turned into content and tool-call deltas, event by event;
    a choice that ended with STOP and held tool calls finishes with TOOL_CALLS."""

    def __init__(self, make_parser: Callable[[], ToolParser]) -> None:
        self.make_parser = make_parser
        self.parsers: dict[int, ToolParser] = {}

    def apply(self, event: StepEvent) -> StepEvent:
        for d in event.deltas:
            self._apply(d)
        return event

    def _apply(self, d: ChoiceDelta) -> None:
        parser = self.parsers.get(d.index)
        if parser is None:
            parser = self.parsers[d.index] = self.make_parser()
        out = parser.feed(d.text)
        if d.finish_reason is not None:
            out = out.then(parser.finish())
            if d.finish_reason == FinishReason.STOP and parser.num_calls:
                d.finish_reason = FinishReason.TOOL_CALLS
        d.text = out.content
        d.tool_calls = out.tool_calls or None
