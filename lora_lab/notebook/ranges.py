"""The range of a notebook parameter: declared at the start of its comment in the `parameters` cell, and
checked before the notebook uses the value (`Record.start`).

    N_BLOCKS = 12  # int in [2, 64]: blocks in the residual MLP stack
    LR = 3e-3  # float in (0, 1]: the learning rate
    RANK = 8  # int in [1, HIDDEN]: a bound may name another parameter
    RESOLUTION = 1024  # int in [256, 2048], multiple of 64: the image side
    FORMAT = "nf4"  # one of "int8" | "nf4": the base's format
    BUDGET = "24GiB"  # str matching "[1-9][0-9]{0,3}GiB": the card's memory
    MODELS = ["sdxl"]  # list of 1..5 one of "sd15" | "sdxl": the models to plan
    VALIDATE = [["sd15", False]]  # list of 0..4 [one of "sd15" | "sdxl", bool]: each item a fixed record
    SWEEP = [512]  # list of 0..8 int in [256, 2048], only with MODELS: a non-empty sweep needs MODELS
    USE_X = True  # bool: ...

The grammar (the range ends at the first ':' or ';' after it, or at the end of the comment):

    declared := range [", only with" NAME]      (a value that is not empty or 0 needs NAME not empty or 0)
    range := "bool" | "int" [interval] [", multiple of" INT] | "float" [interval]
           | "one of" LITERAL ("|" LITERAL)* | "str matching" "REGEX" (fully matched, written as is)
           | "list of" INT ".." INT range | "[" range ("," range)* "]"
    interval := "in" ("[" | "(") bound "," bound ("]" | ")")       bound := a number, inf, -inf or a NAME

A comment that does not start with a complete range declares none (only the type check applies); every
notebook of this project declares one for each parameter (tests/notebook/test_ranges.py).
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass
from typing import Any

_TOKEN = re.compile(r"""\s*(?:
    (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<num>[-+]?(?:\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|inf\b))
  | (?P<name>[A-Za-z_]\w*)
  | (?P<op>\.\.|[\[\](),|:;]))""", re.VERBOSE)
_MAX_TEXT = 10_000  # a string parameter checked against a pattern: longer ones are refused unread


class RangeSyntaxError(ValueError):
    """A range that cannot be read, or a bound that names no numeric parameter (a notebook's mistake)."""


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            if text[pos:].strip() == "":
                break
            out.append(("rest", text[pos:]))  # free text after the range: never parsed
            break
        kind = m.lastgroup
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


@dataclass
class _Number:
    kind: type  # int or float
    low: Any = None  # a number or the NAME of another parameter; None: no interval
    high: Any = None
    low_open: bool = False
    high_open: bool = False
    multiple: int | None = None

    def why(self, value: Any, params: dict[str, Any]) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float) if self.kind is float else int):
            return f"not an {self.kind.__name__}" if self.kind is int else "not a number"
        if self.low is not None:
            low, high = _bound(self.low, params), _bound(self.high, params)
            below = value <= low if self.low_open else value < low
            above = value >= high if self.high_open else value > high
            if below or above or (isinstance(value, float) and math.isnan(value)):
                return "out of range"
        if self.multiple and value % self.multiple:
            return f"not a multiple of {self.multiple}"
        return None


def _bound(b: Any, params: dict[str, Any]) -> float:
    if isinstance(b, str):  # another parameter's value
        v = params.get(b)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RangeSyntaxError(f"the bound {b} names no numeric parameter")
        return v
    return b


@dataclass
class _Bool:
    def why(self, value: Any, params: dict[str, Any]) -> str | None:
        return None if isinstance(value, bool) else "not True or False"


@dataclass
class _OneOf:
    choices: tuple

    def why(self, value: Any, params: dict[str, Any]) -> str | None:
        ok = any(type(value) is type(c) and value == c for c in self.choices)
        return None if ok else "not one of the choices"


@dataclass
class _Matching:
    pattern: str

    def why(self, value: Any, params: dict[str, Any]) -> str | None:
        if not isinstance(value, str) or len(value) > _MAX_TEXT:
            return "not a string" if not isinstance(value, str) else "too long"
        return None if re.fullmatch(self.pattern, value) else "does not match"


@dataclass
class _ListOf:
    fewest: int
    most: int
    item: Any

    def why(self, value: Any, params: dict[str, Any]) -> str | None:
        if not isinstance(value, (list, tuple)):
            return "not a list"
        if not self.fewest <= len(value) <= self.most:
            return f"{len(value)} items, not {self.fewest} to {self.most}"
        for i, v in enumerate(value):
            why = self.item.why(v, params)
            if why:
                return f"item {i} ({v!r:.60}): {why}"
        return None


@dataclass
class _OnlyWith:
    spec: Any
    other: str  # the parameter a non-empty value needs non-empty

    def why(self, value: Any, params: dict[str, Any]) -> str | None:
        why = self.spec.why(value, params)
        if why is None and value and not params.get(self.other):
            return f"needs {self.other} (empty here)"
        return why


@dataclass
class _Record:
    items: list

    def why(self, value: Any, params: dict[str, Any]) -> str | None:
        if not isinstance(value, (list, tuple)) or len(value) != len(self.items):
            return f"not a list of {len(self.items)} items"
        for i, (spec, v) in enumerate(zip(self.items, value)):
            why = spec.why(v, params)
            if why:
                return f"item {i} ({v!r:.60}): {why}"
        return None


class _Parser:
    def __init__(self, text: str):
        self.toks, self.i = _tokens(text), 0

    def peek(self, ahead: int = 0) -> tuple[str, str]:
        j = self.i + ahead
        return self.toks[j] if j < len(self.toks) else ("end", "")

    def take(self, *values: str) -> str:
        kind, v = self.peek()
        if values and v not in values:
            raise RangeSyntaxError(f"expected {' or '.join(values)}, found {v!r:.40}")
        self.i += 1
        return v

    def number(self) -> Any:
        kind, v = self.peek()
        if kind == "name" and v.isupper():
            self.i += 1
            return v
        if kind != "num":
            raise RangeSyntaxError(f"expected a number, found {v!r:.40}")
        self.i += 1
        return float(v) if any(c in v for c in ".eEn") else int(v)

    def spec(self):
        word = self.take()
        if word == "bool":
            return _Bool()
        if word in ("int", "float"):
            out = _Number(int if word == "int" else float)
            if self.peek()[1] == "in":
                self.take("in")
                out.low_open = self.take("[", "(") == "("
                out.low = self.number()
                self.take(",")
                out.high = self.number()
                out.high_open = self.take("]", ")") == ")"
            if self.peek() == ("op", ",") and self.peek(1)[1] == "multiple":
                self.take(",")
                self.take("multiple")
                self.take("of")
                out.multiple = self.number()
                if not isinstance(out.multiple, int) or out.multiple < 1:
                    raise RangeSyntaxError(f"multiple of {out.multiple!r}: must be an int at least 1")
            return out
        if word == "one":
            self.take("of")
            choices = [self.literal()]
            while self.peek()[1] == "|":
                self.take("|")
                choices.append(self.literal())
            return _OneOf(tuple(choices))
        if word == "str":
            self.take("matching")
            kind, quoted = self.peek()
            if kind != "str":
                raise RangeSyntaxError(f"expected a quoted pattern, found {quoted!r:.40}")
            self.i += 1
            pattern = quoted[1:-1]  # as written between the quotes: a regex, no string escapes
            try:
                re.compile(pattern)
            except re.error as e:
                raise RangeSyntaxError(f"pattern {pattern!r:.40}: {e}") from None
            return _Matching(pattern)
        if word == "list":
            self.take("of")
            fewest = self.number()
            self.take("..")
            return _ListOf(fewest, self.number(), self.spec())
        if word == "[":
            items = [self.spec()]
            while self.peek()[1] == ",":
                self.take(",")
                items.append(self.spec())
            self.take("]")
            return _Record(items)
        raise RangeSyntaxError(f"{word!r:.40} does not start a range")

    def literal(self) -> Any:
        kind, v = self.peek()
        if kind not in ("str", "num") or v.endswith("inf"):
            raise RangeSyntaxError(f"expected a quoted string or a number, found {v!r:.40}")
        self.i += 1
        return ast.literal_eval(v)


def parse_range(comment: str):
    """The range a parameter's comment declares, or None if the comment does not start with a complete one
    (ended by ':', ';' or the comment's end): old comments such as `float > 0` declare none."""
    p = _Parser(comment)
    try:
        spec = p.spec()
        if p.peek()[1] == "," and p.peek(1)[1] == "only":
            p.take(",")
            p.take("only")
            p.take("with")
            kind, other = p.peek()
            if not (kind == "name" and other.isupper()):
                return None
            p.i += 1
            spec = _OnlyWith(spec, other)
    except (RangeSyntaxError, ValueError, SyntaxError):  # ast.literal_eval of a choice
        return None
    return spec if p.peek()[1] in (":", ";", "") else None


def range_error(spec, value: Any, params: dict[str, Any]) -> str | None:
    """Why `value` is outside the range `spec` (a bound may name another parameter in `params`), or None."""
    return spec.why(value, params)
