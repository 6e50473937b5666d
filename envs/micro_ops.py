"""The operation vocabulary of micro coding tasks: small typed operations with words and a plausible bug.

An `Op` maps a main input `x` (and an optional second parameter `y`) to a
value. Its `expr` is the Python of the operation, `phrases` three ways of
saying it in a docstring, `names` three function names, `bug` a plausible
mistake (the starting code of a "failing visible test" function), and
`block` an optional statement form (`if`/`else`) used inside longer bodies.
Ops of one kind are listed simplest first: `[env.coding] ops_per_kind` takes
a prefix, so a small setting stays small. `draw_value` makes test inputs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

# types: int, str, list (of int), dict (str -> int), key (a one-letter str, dict lookups), bool
KINDS = ("arithmetic", "strings", "lists", "dicts", "control")


@dataclass(frozen=True)
class Op:
    """One operation: input types `x` (and `y`), output type `out`, its Python, words, names and bug."""

    id: str
    kind: str
    x: str
    y: str | None
    out: str
    expr: str
    phrases: tuple[str, str, str]
    names: tuple[str, str, str]
    bug: str
    block: tuple[str, ...] = ()


def _op(id: str, kind: str, sig: str, expr: str, phrases: tuple[str, str, str], names: tuple[str, str, str],
        bug: str, block: tuple[str, ...] = ()) -> Op:
    """`sig` is "x,y->out" or "x->out"."""
    ins, out = sig.split("->")
    x, _, y = ins.partition(",")
    return Op(id, kind, x, y or None, out, expr, phrases, names, bug, block)


_IF_ELSE = ("if {c}:", "    {o} = {a}", "else:", "    {o} = {b}")

OPS: tuple[Op, ...] = (
    _op("add", "arithmetic", "int,int->int", "{x} + {y}",
        ("the sum of {x} and {y}", "{x} plus {y}", "{x} added to {y}"), ("add", "plus", "total"), "{x} - {y}"),
    _op("sub", "arithmetic", "int,int->int", "{x} - {y}",
        ("{x} minus {y}", "the difference {x} - {y}", "{y} taken from {x}"), ("sub", "minus", "diff"), "{y} - {x}"),
    _op("mul", "arithmetic", "int,int->int", "{x} * {y}",
        ("the product of {x} and {y}", "{x} times {y}", "{x} multiplied by {y}"), ("mul", "times", "product"),
        "{x} + {y}"),
    _op("max", "arithmetic", "int,int->int", "max({x}, {y})",
        ("the larger of {x} and {y}", "the maximum of {x} and {y}", "the bigger one of {x} and {y}"),
        ("larger", "maximum", "bigger"), "min({x}, {y})"),
    _op("min", "arithmetic", "int,int->int", "min({x}, {y})",
        ("the smaller of {x} and {y}", "the minimum of {x} and {y}", "the lesser one of {x} and {y}"),
        ("smaller", "minimum", "lesser"), "max({x}, {y})"),
    _op("double", "arithmetic", "int->int", "{x} * 2",
        ("twice {x}", "{x} doubled", "two times {x}"), ("double", "twice", "dbl"), "{x} + 2"),
    _op("square", "arithmetic", "int->int", "{x} * {x}",
        ("the square of {x}", "{x} squared", "{x} times itself"), ("square", "sq", "squared"), "{x} * 2"),
    _op("concat", "strings", "str,str->str", "{x} + {y}",
        ("{x} followed by {y}", "{x} joined to {y}", "the concatenation of {x} and {y}"),
        ("concat", "join2", "glue"), "{y} + {x}"),
    _op("upper", "strings", "str->str", "{x}.upper()",
        ("{x} in upper case", "{x} upper-cased", "{x} in capital letters"), ("upper", "shout", "caps"),
        "{x}.lower()"),
    _op("reverse", "strings", "str->str", "{x}[::-1]",
        ("{x} reversed", "the reverse of {x}", "{x} backwards"), ("reverse", "flip", "backwards"), "{x}"),
    _op("length", "strings", "str->int", "len({x})",
        ("the length of {x}", "the number of characters in {x}", "how many characters {x} has"),
        ("length", "size", "nchars"), "len({x}) - 1"),
    _op("repeat", "strings", "str,int->str", "{x} * {y}",
        ("{x} repeated {y} times", "{y} copies of {x}", "{x} written {y} times"), ("repeat", "copies", "again"),
        "{x} * ({y} + 1)"),
    _op("first", "strings", "str->str", "{x}[:1]",
        ("the first character of {x}", "the start of {x}, one character", "{x} cut to one character"),
        ("first", "head", "initial"), "{x}[-1:]"),
    _op("total", "lists", "list->int", "sum({x})",
        ("the sum of the items of {x}", "the total of {x}", "{x} added up"), ("total", "sum_all", "added"),
        "len({x})"),
    _op("count", "lists", "list->int", "len({x})",
        ("the number of items in {x}", "how many items {x} has", "the count of {x}"), ("count", "num", "howmany"),
        "sum({x})"),
    _op("largest", "lists", "list->int", "max({x}, default=0)",
        ("the largest item of {x} (0 if empty)", "the maximum of {x} or 0 when empty",
         "the biggest item in {x}, else 0"), ("largest", "top", "peak"), "min({x}, default=0)"),
    _op("sorted", "lists", "list->list", "sorted({x})",
        ("{x} sorted in increasing order", "the items of {x} from small to large", "{x} in ascending order"),
        ("sort", "ordered", "ascending"), "sorted({x}, reverse=True)"),
    _op("append", "lists", "list,int->list", "{x} + [{y}]",
        ("{x} with {y} added at the end", "{x} then {y}", "{x} extended by {y}"), ("append", "push", "extend1"),
        "[{y}] + {x}"),
    _op("lookup", "dicts", "dict,key->int", "{x}.get({y}, 0)",
        ("the value of key {y} in {x}, or 0", "{x} at {y}, 0 if missing", "what {x} maps {y} to (else 0)"),
        ("lookup", "get", "fetch"), "{x}.get({y}, 1)"),
    _op("size", "dicts", "dict->int", "len({x})",
        ("the number of keys in {x}", "how many entries {x} has", "the size of {x}"), ("size", "nkeys", "entries"),
        "len({x}) + 1"),
    _op("has", "dicts", "dict,key->bool", "{y} in {x}",
        ("whether {x} has the key {y}", "True if {y} is a key of {x}", "if {y} is in {x}"),
        ("has", "contains", "haskey"), "{y} not in {x}"),
    _op("values", "dicts", "dict->int", "sum({x}.values())",
        ("the sum of the values of {x}", "the total of {x}'s values", "{x}'s values added up"),
        ("values_sum", "vsum", "valtotal"), "len({x})"),
    _op("abs", "control", "int->int", "{x} if {x} >= 0 else -{x}",
        ("the absolute value of {x}", "{x} without its sign", "{x}, or -{x} if {x} is negative"),
        ("absolute", "magnitude", "unsigned"), "{x}", _IF_ELSE),
    _op("clamp", "control", "int->int", "{x} if {x} > 0 else 0",
        ("{x} if it is positive, else 0", "{x} clamped at 0 from below", "max of {x} and 0"),
        ("clamp", "relu", "positive"), "{x}", _IF_ELSE),
    _op("parity", "control", "int->str", "'even' if {x} % 2 == 0 else 'odd'",
        ("'even' if {x} is even, else 'odd'", "the parity of {x} ('even' or 'odd')", "whether {x} is 'even' or 'odd'"),
        ("parity", "evenodd", "oddness"), "'odd' if {x} % 2 == 0 else 'even'", _IF_ELSE),
    _op("evens", "control", "list->list", "[i for i in {x} if i % 2 == 0]",
        ("the even items of {x}", "{x} without its odd items", "only the even numbers in {x}"),
        ("evens", "keep_even", "even_items"), "[i for i in {x} if i % 2]"),
    _op("positives", "control", "list->int", "len([i for i in {x} if i > 0])",
        ("how many items of {x} are positive", "the number of positive items in {x}", "the count of {x} above 0"),
        ("positives", "npos", "count_pos"), "len([i for i in {x} if i < 0])"),
)
BY_ID = {op.id: op for op in OPS}
# the branches of `block` (condition, then-value, else-value) per op with one
_BRANCHES = {
    "abs": ("{x} >= 0", "{x}", "-{x}"),
    "clamp": ("{x} > 0", "{x}", "0"),
    "parity": ("{x} % 2 == 0", "'even'", "'odd'"),
}


def block_lines(op: Op, x: str, out: str) -> list[str]:
    """The statement form of `op` assigning `out` (ops with a `block` only)."""
    c, a, b = (s.format(x=x) for s in _BRANCHES[op.id])
    return [line.format(c=c, a=a, b=b, o=out) for line in op.block]


def vocabulary(kinds: tuple[str, ...], ops_per_kind: int) -> list[Op]:
    """Ops of `kinds`, the first `ops_per_kind` of each (0 = all), in vocabulary order."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"env.coding.kinds: unknown kind(s) {unknown}; kinds: {', '.join(KINDS)}")
    out = []
    for kind in kinds:
        ops = [op for op in OPS if op.kind == kind]
        out += ops[:ops_per_kind] if ops_per_kind else ops
    return out


def draw_value(kind: str, rng: random.Random) -> Any:
    """A small test input of type `kind`."""
    if kind == "int":
        return rng.randint(-9, 9)
    if kind == "str":
        return "".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 4)))
    if kind == "key":
        return rng.choice("abcd")
    if kind == "list":
        return [rng.randint(-9, 9) for _ in range(rng.randint(1, 4))]
    if kind == "dict":
        return {k: rng.randint(0, 9) for k in rng.sample("abcd", rng.randint(1, 3))}
    raise ValueError(f"no inputs of type {kind!r}")
