"""Byte-level matching of JSON text against a compiled schema, and per-request token checks.

A parse stack is a linked list `(goal, rest)` of what must still be read, the next goal
first; `None` is the empty stack (the value is complete). A state is the frozenset of the
stacks the bytes so far may have left (a schema's choices, optional properties and the end
of a number keep several alive for a few bytes). Stacks share their tails, so a byte costs
a few small tuples whatever the nesting depth.

Goals:
    (WS, n, newline)                optional whitespace: n bytes read, whether one was "\n"
    (VALUE, node)                   one value of grammar node `node`
    (LIT, data, pos)                the rest of a fixed text, from `pos`
    (STR, node, count, esc, cont)   inside a string: characters so far, escape state
                                    (1 after a backslash, -k with k hex digits to go),
                                    and what a UTF-8 character still owes (`_UTF8_NEXT`)
    (NUM, integer, phase)           inside a number (phases: `_NUMBER_MOVES`)
    (BNUM, node, phase, text)       inside a number with bounds, its text so far
    (PSTR, node, count, states)     inside a string of a pattern: its automaton's states
    (ONEOF, node, state)            inside one of an enum's texts, at a state of its trie
    (ARR, node, count)              inside an array, `count` items read
    (OBJ, node, index, first)       inside an object, at property `index` of the schema's
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from functools import lru_cache
from typing import Any

from engine.structured.schema import (
    ANY,
    ANY_ALTERNATIVES,
    ARRAY,
    CHOICE,
    LITERAL,
    NUMBER,
    OBJECT,
    PATTERN,
    STRING,
    STRING_ID,
    TRIE,
    Grammar,
    grammar_for,
)

State = frozenset[Any]
WS, VALUE, LIT, STR, NUM, ARR, OBJ, PSTR, BNUM, ONEOF = range(10)

# whitespace allowed at one place: enough to pretty-print (one line break, indentation),
# too little for a model to loop on
MAX_WHITESPACE = 20
# choices nested in choices (a $ref to a choice, ...) are expanded this deep at most
MAX_EXPANSION = 32

_BLANKS = frozenset(b" \t")
_ESCAPES = frozenset(b'"\\/bfnrt')
_HEX = frozenset(b"0123456789abcdefABCDEF")
_DIGITS = b"0123456789"


def _moves(pairs: dict[bytes, int]) -> dict[int, int]:
    return {byte: phase for chars, phase in pairs.items() for byte in chars}


# number phases: 0 start, 1 after '-', 2 integer digits, 3 a leading zero, 4 after '.',
# 5 fraction digits, 6 after 'e', 7 after the exponent's sign, 8 exponent digits
_NUMBER_MOVES = (
    _moves({b"-": 1, b"0": 3, b"123456789": 2}),
    _moves({b"0": 3, b"123456789": 2}),
    _moves({_DIGITS: 2, b".": 4, b"eE": 6}),
    _moves({b".": 4, b"eE": 6}),
    _moves({_DIGITS: 5}),
    _moves({_DIGITS: 5, b"eE": 6}),
    _moves({b"+-": 7, _DIGITS: 8}),
    _moves({_DIGITS: 8}),
    _moves({_DIGITS: 8}),
)
_SPACE = (WS, 0, False)
_NEXT_BYTES_KEPT = 4096
_NUMBER_ENDS = frozenset({2, 3, 5, 8})

# well-formed UTF-8 inside strings (no overlong forms, surrogates or code points past
# U+10FFFF): a lead byte sets what the continuation bytes must be; each entry of
# _UTF8_NEXT is (lowest, highest, entry for the byte after)
_UTF8_NEXT = {
    1: (0x80, 0xBF, 0), 2: (0x80, 0xBF, 1), 3: (0x80, 0xBF, 2),
    4: (0xA0, 0xBF, 1), 5: (0x80, 0x9F, 1), 6: (0x90, 0xBF, 2), 7: (0x80, 0x8F, 2),
}  # fmt: skip
_UTF8_LEAD = (
    dict.fromkeys(range(0xC2, 0xE0), 1) | {0xE0: 4} | dict.fromkeys(range(0xE1, 0xF0), 2)
    | {0xED: 5, 0xF0: 6} | dict.fromkeys(range(0xF1, 0xF4), 3) | {0xF4: 7}
)  # fmt: skip
_NOT_INTEGER = frozenset({4, 6})
_EXPONENT = 6


class JsonMatcher:
    """The states of one grammar; states are plain values any caller may keep. Its only
    mutable part is a cache of each state's allowed next bytes."""

    def __init__(self, grammar: Grammar) -> None:
        self.nodes = grammar.nodes
        self.start: State = frozenset({(_SPACE, ((VALUE, grammar.root), None))})
        self._next_bytes: dict[State, list[bool]] = {}

    def advance(self, state: State, data: bytes) -> State | None:
        """The state after reading `data` from `state`; None if no valid text continues so."""
        for byte in data:
            out: set[Any] = set()
            for stack in state:
                if stack is not None:
                    self._read(stack, byte, out, 0)
            if not out:
                return None
            state = frozenset(out)
        return state

    def can_end(self, state: State) -> bool:
        """Whether the text read so far is a complete value."""
        for stack in state:
            while stack is not None and self._may_stop(stack[0]):
                stack = stack[1]
            if stack is None:
                return True
        return False

    def _may_stop(self, goal: Any) -> bool:
        """Whether `goal` may end before the next byte."""
        kind = goal[0]
        if kind == WS:
            return True
        if kind == NUM:
            return goal[2] in _NUMBER_ENDS
        if kind == ONEOF:
            return goal[2] in self.nodes[goal[1]][2]
        if kind == BNUM:
            _, node_id, phase, text = goal
            return phase in _NUMBER_ENDS and self.nodes[node_id][2].contains(
                Fraction(text.decode())
            )
        return False

    @staticmethod
    def is_final(state: State) -> bool:
        """Whether the value is complete and nothing may follow it."""
        return all(stack is None for stack in state)

    def next_bytes(self, state: State) -> list[bool]:
        """For each byte value, whether it may come next (kept for the states seen last)."""
        allowed = self._next_bytes.get(state)
        if allowed is None:
            if len(self._next_bytes) >= _NEXT_BYTES_KEPT:
                self._next_bytes.clear()
            allowed = [self.advance(state, bytes((b,))) is not None for b in range(256)]
            self._next_bytes[state] = allowed
        return allowed

    def _read(self, stack: Any, byte: int, out: set[Any], depth: int) -> None:
        """Add to `out` every stack `stack` becomes by reading `byte`."""
        goal, rest = stack
        kind = goal[0]
        if kind == STR:
            self._read_string(goal, rest, byte, out)
        elif kind == WS:
            if goal[1] < MAX_WHITESPACE and (byte in _BLANKS or (byte == 0x0A and not goal[2])):
                out.add(((WS, goal[1] + 1, goal[2] or byte == 0x0A), rest))
            if rest is not None:
                self._read(rest, byte, out, depth)
        elif kind == LIT:
            data, pos = goal[1], goal[2]
            if data[pos] == byte:
                out.add(rest if pos + 1 == len(data) else ((LIT, data, pos + 1), rest))
        elif kind == NUM:
            integer, phase = goal[1], goal[2]
            nxt = _NUMBER_MOVES[phase].get(byte)
            if nxt is not None and not (integer and nxt in _NOT_INTEGER):
                out.add(((NUM, integer, nxt), rest))
            if phase in _NUMBER_ENDS and rest is not None:
                self._read(rest, byte, out, depth)
        elif kind == PSTR:
            self._read_pattern(goal, rest, byte, out)
        elif kind == ONEOF:
            _, node_id, at = goal
            _, table, ends = self.nodes[node_id]
            nxt = table[at].get(byte)
            if nxt is not None:  # a text that ends here and goes no further is complete
                out.add(rest if nxt in ends and not table[nxt] else ((ONEOF, node_id, nxt), rest))
            if at in ends and rest is not None:  # a text that ended (others go on)
                self._read(rest, byte, out, depth)
        elif kind == BNUM:
            _, node_id, phase, text = goal
            nxt = _NUMBER_MOVES[phase].get(byte)
            integer, bounds = self.nodes[node_id][1:]
            if (
                nxt is not None
                and nxt != _EXPONENT
                and not (integer and nxt in _NOT_INTEGER)
                and bounds.can_reach(text + bytes((byte,)))
            ):
                out.add(((BNUM, node_id, nxt, text + bytes((byte,))), rest))
            if rest is not None and self._may_stop(goal):
                self._read(rest, byte, out, depth)
        elif kind == VALUE:
            self._read_value(goal[1], rest, byte, out, depth)
        elif kind == ARR:
            self._read_array(goal, rest, byte, out, depth)
        else:
            self._read_object(goal, rest, byte, out, depth)

    def _read_value(self, node_id: int, rest: Any, byte: int, out: set[Any], depth: int) -> None:
        node = self.nodes[node_id]
        tag = node[0]
        if tag in (CHOICE, ANY):
            if depth < MAX_EXPANSION:
                for alt in node[1] if tag == CHOICE else ANY_ALTERNATIVES:
                    self._read_value(alt, rest, byte, out, depth + 1)
        elif tag == STRING:
            if byte == 0x22:
                out.add(((STR, node_id, 0, 0, 0), rest))
        elif tag == OBJECT:
            if byte == 0x7B:
                out.add((_SPACE, ((OBJ, node_id, 0, True), rest)))
        elif tag == ARRAY:
            if byte == 0x5B:
                out.add((_SPACE, ((ARR, node_id, 0), rest)))
        elif tag == NUMBER:
            start = (NUM, node[1], 0) if node[2] is None else (BNUM, node_id, 0, b"")
            self._read((start, rest), byte, out, depth)
        elif tag == TRIE:
            self._read(((ONEOF, node_id, 0), rest), byte, out, depth)
        elif tag == PATTERN:
            if byte == 0x22:
                out.add(((PSTR, node_id, 0, node[1].start), rest))
        else:
            assert tag == LITERAL
            self._read(((LIT, node[1], 0), rest), byte, out, depth)

    def _read_string(self, goal: Any, rest: Any, byte: int, out: set[Any]) -> None:
        _, node_id, count, esc, cont = goal
        if cont:
            low, high, then = _UTF8_NEXT[cont]
            if low <= byte <= high:
                out.add(((STR, node_id, count, 0, then), rest))
        elif esc == 1:
            if byte in _ESCAPES:
                out.add(((STR, node_id, count, 0, 0), rest))
            elif byte == 0x75:  # \uXXXX
                out.add(((STR, node_id, count, -4, 0), rest))
        elif esc:
            if byte in _HEX:
                out.add(((STR, node_id, count, esc + 1, 0), rest))
        elif byte == 0x22:
            if count >= self.nodes[node_id][1]:
                out.add(rest)
        else:
            _, shortest, longest = self.nodes[node_id]
            if longest is not None:
                if count >= longest:
                    return
                count += 1
            elif shortest:
                count += 1
            # (a string without bounds counts nothing: its states repeat, and so do their
            # allowed bytes, which `next_bytes` keeps)
            if byte == 0x5C:
                out.add(((STR, node_id, count, 1, 0), rest))
            elif 0x20 <= byte < 0x80:
                out.add(((STR, node_id, count, 0, 0), rest))
            elif (owed := _UTF8_LEAD.get(byte)) is not None:
                out.add(((STR, node_id, count, 0, owed), rest))

    def _read_pattern(self, goal: Any, rest: Any, byte: int, out: set[Any]) -> None:
        _, node_id, count, states = goal
        _, pattern, shortest, longest = self.nodes[node_id]
        if byte == 0x22:
            if count >= shortest and pattern.can_end(states):
                out.add(rest)
            return
        if (shortest or longest is not None) and not 0x80 <= byte < 0xC0:  # a new character
            if longest is not None and count >= longest:
                return
            count += 1
        nxt = pattern.step(states, byte)
        if nxt:
            out.add(((PSTR, node_id, count, nxt), rest))

    def _read_array(self, goal: Any, rest: Any, byte: int, out: set[Any], depth: int) -> None:
        _, node_id, count = goal
        _, item, least, most = self.nodes[node_id]
        if byte == 0x5D and count >= least:
            out.add(rest)
        if most is not None and count >= most:
            return
        after = (_SPACE, ((ARR, node_id, count + 1), rest))
        if count == 0:
            self._read(((VALUE, item), after), byte, out, depth)
        elif byte == 0x2C:
            out.add((_SPACE, ((VALUE, item), after)))

    def _read_object(self, goal: Any, rest: Any, byte: int, out: set[Any], depth: int) -> None:
        _, node_id, index, first = goal
        _, members, additional, required_from = self.nodes[node_id]
        if byte == 0x7D and not required_from[index]:
            out.add(rest)
        if not first and byte != 0x2C:
            return
        # the members that may come next: each property up to the first required one, then
        # (when none is left required) any other member the schema allows
        choices: list[tuple[Any, int, int]] = []
        for i in range(index, len(members)):
            key, value, required = members[i]
            choices.append(((LIT, key, 0), value, i + 1))
            if required:
                break
        else:
            if additional is not None:
                choices.append(((VALUE, STRING_ID), additional, len(members)))
        for head, value, nxt in choices:
            after = (_SPACE, ((VALUE, value), (_SPACE, ((OBJ, node_id, nxt, False), rest))))
            member = (head, (_SPACE, ((LIT, b":", 0), after)))
            if first:
                self._read(member, byte, out, depth)
            else:
                out.add((_SPACE, member))


@lru_cache(maxsize=64)
def json_matcher(schema_text: str) -> JsonMatcher:
    """The matcher of a JSON Schema given as text, shared by the requests that use it (and
    with it, its cache of allowed bytes). Raises SchemaError."""
    return JsonMatcher(grammar_for(schema_text))


class TokenMatcher:
    """One request's progress through its grammar, checked a token at a time.

    `token_bytes[id]` is the text token `id` adds (None for special tokens: never allowed);
    `stop_ids` may end the output once it is a complete value. Mutated only by `accept`.
    """

    def __init__(
        self, matcher: JsonMatcher, token_bytes: Sequence[bytes | None], stop_ids: frozenset[int]
    ) -> None:
        self.matcher = matcher
        self.token_bytes = token_bytes
        self.stop_ids = stop_ids
        self.state = matcher.start
        self.stuck = False  # set when no token could continue: the request fails
        self._checked: tuple[int, State | None] | None = None  # the last token tried

    @property
    def can_end(self) -> bool:
        return self.matcher.can_end(self.state)

    @property
    def is_final(self) -> bool:
        """Complete, and nothing may follow: the request ends here."""
        return self.matcher.is_final(self.state)

    def allows(self, token_id: int) -> bool:
        if token_id in self.stop_ids:
            return self.can_end
        return self._next(token_id) is not None

    def accept(self, token_id: int) -> None:
        """Advance past `token_id`, which `allows`. A stop token leaves the state final."""
        nxt = frozenset({None}) if token_id in self.stop_ids else self._next(token_id)
        assert nxt is not None and self.allows(token_id), f"token {token_id} is not allowed"
        self.state = nxt
        self._checked = None

    def next_bytes(self) -> list[bool]:
        return self.matcher.next_bytes(self.state)

    def _next(self, token_id: int) -> State | None:
        if self._checked is not None and self._checked[0] == token_id:
            return self._checked[1]
        data = self.token_bytes[token_id] if token_id < len(self.token_bytes) else None
        nxt = self.matcher.advance(self.state, data) if data else None
        self._checked = (token_id, nxt)
        return nxt
