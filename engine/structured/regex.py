"""JSON Schema `pattern`s (and the `format`s written as patterns) as byte automata.

The subset: literals, `.`, classes (`[a-z_]`, `[^,]`, with ASCII ranges), `\\d \\w \\s` and
their negations (ASCII meanings, as in ECMA-262), groups (`(...)`, `(?:...)`), `|`, the
quantifiers `* + ? {m} {m,} {m,n}` (lazy forms match the same strings), and `^` / `$` at
the ends of the pattern. A pattern without `^` may start anywhere in the string and one
without `$` may end anywhere, as JSON Schema says. Backreferences, lookaround, non-ASCII
ranges and non-ASCII members of negated classes are refused (SchemaError).

The automaton reads the string's raw bytes: it has no transitions on `"`, `\\` or control
bytes (so strings with a pattern contain no escapes), and every path spells whole UTF-8
characters. A state is the frozenset of live automaton states, so `step` never leads into
a string that could not finish.
"""

from __future__ import annotations

from typing import Any

from engine.structured.errors import SchemaError

MAX_STATES = 4096
_TEXT = frozenset(range(0x20, 0x80)) - {0x22, 0x5C}  # ASCII a pattern string may hold
_DIGITS = frozenset(b"0123456789")
_WORD = _DIGITS | frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
_SPACE = frozenset(b" ")  # of \s, a JSON string holds raw spaces only
_CLASS_ESCAPES = {"d": (_DIGITS, False), "w": (_WORD, False), "s": (_SPACE, False)}
# calendar dates (days per month, leap years) from 0001 to 9999; times to the microsecond
_YEAR = r"([1-9]\d{3}|0[1-9]\d\d|00[1-9]\d|000[1-9])"
_LEAP_YEAR = r"(\d\d(0[48]|[2468][048]|[13579][26])|([2468][048]|[13579][26]|0[48])00)"
_DATE = (
    rf"({_YEAR}-(0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|{_YEAR}-(0[469]|11)-(0[1-9]|[12]\d|30)"
    rf"|{_YEAR}-02-(0[1-9]|1\d|2[0-8])|{_LEAP_YEAR}-02-29)"
)
_TIME = r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,6})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
FORMATS = {
    "date": rf"^{_DATE}$",
    "time": rf"^{_TIME}$",
    "date-time": rf"^{_DATE}T{_TIME}$",
    "uuid": r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
    "email": r"^[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(\.[A-Za-z0-9-]{1,63}){1,8}$",
    "ipv4": r"^((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)$",
    "uri": r"^[A-Za-z][A-Za-z0-9+.-]*:[^ <>{}|^`]+$",
}

# a parsed pattern: ("set", bytes allowed, any non-ASCII character too), ("seq", [parts]),
# ("alt", [parts]), ("rep", part, least, most or None), ("bytes", literal UTF-8)
Part = tuple[Any, ...]


class Pattern:
    """The automaton of one pattern. `start`, `step` and `can_end` work on frozensets of
    states; steps are remembered (the automaton is small and strings revisit states)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.edges: list[list[tuple[frozenset[int], int]]] = []
        self.eps: list[list[int]] = []
        anchored_start, anchored_end = source.startswith("^"), source.endswith("$")
        body = source[1 if anchored_start else 0 : len(source) - (1 if anchored_end else 0)]
        part = _Parser(body, source).parse()
        anything: Part = ("rep", ("set", _TEXT, True), 0, None)
        part = ("seq", [*[anything] * (not anchored_start), part, *[anything] * (not anchored_end)])
        first, self.final = self._state(), self._state()
        self._build(part, first, self.final)
        live = self._live()
        self._closures = [self._closure(s, live) for s in range(len(self.edges))]
        self.start = self._closures[first]
        self._steps: dict[tuple[frozenset[int], int], frozenset[int]] = {}

    def step(self, states: frozenset[int], byte: int) -> frozenset[int]:
        key = (states, byte)
        nxt = self._steps.get(key)
        if nxt is None:
            targets = [t for s in states for label, t in self.edges[s] if byte in label]
            nxt = frozenset().union(*(self._closures[t] for t in targets))
            if len(self._steps) > 65536:
                self._steps.clear()
            self._steps[key] = nxt
        return nxt

    def can_end(self, states: frozenset[int]) -> bool:
        return self.final in states

    def _state(self) -> int:
        if len(self.edges) >= MAX_STATES:
            raise SchemaError(f"pattern {self.source!r} is too large")
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def _build(self, part: Part, src: int, dst: int) -> None:
        """Add states and edges that lead from `src` to `dst` through strings of `part`."""
        kind = part[0]
        if kind == "set":
            if part[1]:
                self.edges[src].append((part[1], dst))
            if part[2]:
                self._any_multibyte(src, dst)
        elif kind == "bytes":
            for i, byte in enumerate(part[1]):
                nxt = dst if i == len(part[1]) - 1 else self._state()
                self.edges[src].append((frozenset({byte}), nxt))
                src = nxt
        elif kind == "seq":
            for i, sub in enumerate(part[1]):
                nxt = dst if i == len(part[1]) - 1 else self._state()
                self._build(sub, src, nxt)
                src = nxt
            if not part[1]:
                self.eps[src].append(dst)
        elif kind == "alt":
            for sub in part[1]:
                self._build(sub, src, dst)
        else:
            _, sub, least, most = part
            for _ in range(least):
                nxt = self._state()
                self._build(sub, src, nxt)
                src = nxt
            if most is None:  # then any number more: a loop through one state
                loop = self._state()
                self.eps[src].append(loop)
                self._build(sub, loop, loop)
                self.eps[loop].append(dst)
                return
            for _ in range(most - least):
                self.eps[src].append(dst)
                nxt = self._state()
                self._build(sub, src, nxt)
                src = nxt
            self.eps[src].append(dst)

    def _any_multibyte(self, src: int, dst: int) -> None:
        """Edges from `src` to `dst` through every well-formed UTF-8 character of 2-4 bytes."""
        one, two, three = self._state(), self._state(), self._state()
        cont = frozenset(range(0x80, 0xC0))
        self.edges[one].append((cont, dst))
        self.edges[two].append((cont, one))
        self.edges[three].append((cont, two))
        for leads, first, then in (
            (range(0xC2, 0xE0), None, one),
            ([*range(0xE1, 0xED), 0xEE, 0xEF], None, two),
            ([0xE0], range(0xA0, 0xC0), one),
            ([0xED], range(0x80, 0xA0), one),
            (range(0xF1, 0xF4), None, three),
            ([0xF0], range(0x90, 0xC0), two),
            ([0xF4], range(0x80, 0x90), two),
        ):
            if first is None:
                self.edges[src].append((frozenset(leads), then))
            else:
                mid = self._state()
                self.edges[src].append((frozenset(leads), mid))
                self.edges[mid].append((frozenset(first), then))

    def _live(self) -> set[int]:
        """The states from which the final state can be reached."""
        back: list[list[int]] = [[] for _ in self.edges]
        for s, edges in enumerate(self.edges):
            for _, t in edges:
                back[t].append(s)
            for t in self.eps[s]:
                back[t].append(s)
        live, todo = {self.final}, [self.final]
        while todo:
            for s in back[todo.pop()]:
                if s not in live:
                    live.add(s)
                    todo.append(s)
        return live

    def _closure(self, state: int, live: set[int]) -> frozenset[int]:
        seen, todo = {state}, [state]
        while todo:
            for t in self.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen & live)


class _Parser:
    def __init__(self, text: str, source: str) -> None:
        self.text, self.source, self.pos = text, source, 0

    def fail(self, what: str) -> SchemaError:
        return SchemaError(f"pattern {self.source!r}: {what}")

    def parse(self) -> Part:
        part = self.alternation()
        if self.pos != len(self.text):
            raise self.fail(f"unexpected {self.text[self.pos]!r}")
        return part

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def alternation(self) -> Part:
        parts = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            parts.append(self.sequence())
        return parts[0] if len(parts) == 1 else ("alt", parts)

    def sequence(self) -> Part:
        parts = []
        while self.peek() not in ("", "|", ")"):
            parts.append(self.quantified(self.atom()))
        return ("seq", parts)

    def quantified(self, part: Part) -> Part:
        while True:
            char = self.peek()
            if char in ("*", "+", "?"):
                self.pos += 1
                least, most = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
            elif char == "{" and (bounds := self.braces()) is not None:
                least, most = bounds
            else:
                return part
            if self.peek() == "?":  # lazy: the same strings
                self.pos += 1
            part = ("rep", part, least, most)

    def braces(self) -> tuple[int, int | None] | None:
        end = self.text.find("}", self.pos)
        inner = self.text[self.pos + 1 : end] if end > 0 else ""
        low, comma, high = inner.partition(",")
        if not low.isdigit() or not (high.isdigit() or high == ""):
            return None  # a literal "{", as in ECMA-262's annex B
        least = int(low)
        most = least if not comma else int(high) if high else None
        if most is not None and most < least:
            raise self.fail(f"{{{inner}}} counts down")
        if max(least, most or 0) > 256:
            raise self.fail("repetition counts above 256 are not supported")
        self.pos = end + 1
        return least, most

    def atom(self) -> Part:
        char = self.text[self.pos]
        self.pos += 1
        if char == "(":
            if self.text.startswith("?:", self.pos):
                self.pos += 2
            elif self.peek() == "?":
                raise self.fail("lookaround and named groups are not supported")
            part = self.alternation()
            if self.peek() != ")":
                raise self.fail("a group is not closed")
            self.pos += 1
            return part
        if char == "[":
            return self.char_class()
        if char == ".":
            return ("set", _TEXT, True)
        if char == "\\":
            return self.escape()
        if char in "^$":
            raise self.fail(f"{char!r} is supported only at the ends of the pattern")
        if char in "*+?)":
            raise self.fail(f"nothing to repeat or close at {char!r}")
        return _literal(char)

    def escape(self) -> Part:
        char = self.peek()
        if not char:
            raise self.fail("it ends with a backslash")
        self.pos += 1
        if char.lower() in _CLASS_ESCAPES:
            allowed, _ = _CLASS_ESCAPES[char.lower()]
            return ("set", _TEXT - allowed, True) if char.isupper() else ("set", allowed, False)
        if char.isdigit() or char in "bBkpPux" or (char.isalpha() and char not in "tnrfv"):
            raise self.fail(f"\\{char} is not supported")
        if char in "tnrfv":  # control characters, which a JSON string never holds raw
            return ("set", frozenset(), False)
        return _literal(char)

    def char_class(self) -> Part:
        negated = self.peek() == "^"
        self.pos += negated
        allowed: set[int] = set()
        wide: list[Part] = []  # non-ASCII members, as their bytes
        first = True
        while self.peek() != "]" or first:
            first = False
            if not self.peek():
                raise self.fail("a class is not closed")
            low = self.class_member()
            if self.peek() == "-" and self.text[self.pos + 1 : self.pos + 2] not in ("]", ""):
                self.pos += 1
                high = self.class_member()
                if not isinstance(low, int) or not isinstance(high, int) or high < low:
                    raise self.fail("bad range in a class (non-ASCII ranges are not supported)")
                allowed |= set(range(low, high + 1))
            elif isinstance(low, int):
                allowed.add(low)
            elif isinstance(low, frozenset):
                allowed |= low
            else:
                wide.append(("bytes", low))
        self.pos += 1
        chosen = frozenset(allowed) & _TEXT
        if negated:
            if wide:
                raise self.fail("non-ASCII characters in negated classes are not supported")
            return ("set", _TEXT - chosen, True)
        return ("alt", [("set", chosen, False), *wide]) if wide else ("set", chosen, False)

    def class_member(self) -> int | frozenset[int] | bytes:
        """One member: a byte, a set of bytes (an escape such as \\d) or a non-ASCII
        character's bytes."""
        char = self.text[self.pos]
        self.pos += 1
        if char == "\\":
            part = self.escape()
            if part[0] == "set":
                return frozenset(part[1])
            return int(part[1][0]) if len(part[1]) == 1 else bytes(part[1])
        return ord(char) if ord(char) <= 0x7F else char.encode()


def _literal(char: str) -> Part:
    data = char.encode()
    if len(data) == 1 and data[0] not in _TEXT:
        return ("set", frozenset(), False)  # a quote, backslash or control: never matched
    return ("bytes", data)
