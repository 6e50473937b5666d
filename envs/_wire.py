"""Plain-data wire format between the judge and the submission's callee process (stdlib only).

Only exact builtin types cross: None, bool, int, float, str, bytes, list,
tuple, dict, set, frozenset (subclasses are refused, so an object with an
always-true `__eq__` cannot reach the judge). Values are tagged JSON, one
message per line, bounded in size and depth. Both sandboxed sides import this
file read-only; the judge decodes into fresh builtin objects and compares them
with the builtins' own `==`.
"""

from __future__ import annotations

import json
import os
import select

MAX_MESSAGE = 8 << 20
MAX_DEPTH = 64
_SCALARS = (type(None), bool, int, float, str)
_EXCEPTIONS = {
    e.__name__: e for e in (
        ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, ArithmeticError, LookupError,
        AttributeError, RuntimeError, NotImplementedError, RecursionError, OverflowError, AssertionError,
        StopIteration, UnicodeError, OSError,
    )
}


class WireError(Exception):
    """A value that may not cross, or a message that is malformed, oversized or late."""


def encode(value: object, depth: int = 0) -> object:
    if depth > MAX_DEPTH:
        raise WireError("value nested too deeply")
    t = type(value)
    if t in _SCALARS:
        return value
    if t is bytes:
        return {"b": value.hex()}
    if t is list:
        return [encode(v, depth + 1) for v in value]
    if t is tuple:
        return {"t": [encode(v, depth + 1) for v in value]}
    if t in (set, frozenset):
        return {"s" if t is set else "f": [encode(v, depth + 1) for v in value]}
    if t is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    raise WireError(f"a {t.__module__}.{t.__qualname__} cannot cross (plain builtin data only)")


def decode(obj: object, depth: int = 0) -> object:
    if depth > MAX_DEPTH:
        raise WireError("value nested too deeply")
    if type(obj) in _SCALARS:
        return obj
    if type(obj) is list:
        return [decode(v, depth + 1) for v in obj]
    if type(obj) is dict and len(obj) == 1:
        (tag, body), = obj.items()
        if tag == "b" and type(body) is str:
            return bytes.fromhex(body)
        if type(body) is list:
            items = [decode(v, depth + 1) for v in body] if tag != "d" else None
            if tag == "t":
                return tuple(items)
            if tag == "s":
                return set(items)
            if tag == "f":
                return frozenset(items)
            if tag == "d" and all(type(p) is list and len(p) == 2 for p in body):
                return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
    raise WireError("malformed value")


def send(fd: int, message: dict) -> None:
    data = (json.dumps(message) + "\n").encode()
    if len(data) > MAX_MESSAGE:
        raise WireError(f"message over {MAX_MESSAGE} bytes")
    while data:
        data = data[os.write(fd, data):]


class Reader:
    """Line reader over a pipe fd with a size bound and an optional timeout per message."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buf = fd, b""

    def recv(self, timeout_s: float | None = None) -> dict | None:
        """The next message, None at end of stream; WireError when malformed, oversized or late."""
        while b"\n" not in self.buf:
            if len(self.buf) > MAX_MESSAGE:
                raise WireError(f"message over {MAX_MESSAGE} bytes")
            if timeout_s is not None and not select.select([self.fd], [], [], timeout_s)[0]:
                raise WireError(f"no answer within {timeout_s:.0f} s")
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            message = json.loads(line)
        except ValueError as exc:
            raise WireError("message is not JSON") from exc
        if type(message) is not dict:
            raise WireError("message is not an object")
        return message


def exception_from(name: object, text: object) -> BaseException:
    """The judge-side exception for a callee's error: the builtin of that name, else RuntimeError."""
    cls = _EXCEPTIONS.get(name) if type(name) is str else None
    return (cls or RuntimeError)(str(text)[:2000] if cls else f"{str(name)[:100]}: {str(text)[:2000]}")
