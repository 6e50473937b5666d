"""Plain-data wire format between the judge and the submission's callee process (stdlib only).

Only exact builtin types cross: None, bool, int, float, str, bytes, list,
tuple, dict, set, frozenset (subclasses are refused, so an object with an
always-true `__eq__` cannot reach the judge). A callable crosses as a handle
(`{"c": id}`): the receiving side gets a forwarder that calls it back over the
wire, so tests that pass callbacks and solutions that return functions work.
Values are tagged JSON, one message per line, bounded in size and depth. Both
sandboxed sides import this file read-only; the judge decodes into fresh
builtin objects and compares them with the builtins' own `==`.

`Peer` is one side of the connection: `request()` sends a message and, while
it waits for the reply, serves the other side's requests (callbacks nest).
Messages with an "op" are requests, the others replies.
"""

from __future__ import annotations

import json
import os
import select
from typing import Callable

MAX_MESSAGE = 8 << 20
MAX_DEPTH = 64
MAX_HANDLES = 10_000
_SCALARS = (type(None), bool, int, float, str)
_EXCEPTIONS = {
    e.__name__: e for e in (
        ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, ArithmeticError, LookupError,
        AttributeError, RuntimeError, NotImplementedError, RecursionError, OverflowError, AssertionError,
        StopIteration, UnicodeError, OSError, SyntaxError, IndentationError, NameError, UnboundLocalError,
        FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError, TimeoutError,
        EOFError, ImportError, ModuleNotFoundError, FloatingPointError, BufferError,
    )
}


class WireError(Exception):
    """A value that may not cross, or a message that is malformed, oversized or late."""


def encode(value: object, depth: int = 0, export: Callable[[Callable], int] | None = None) -> object:
    """Tagged JSON of a plain value; with `export`, a callable becomes a handle."""
    if depth > MAX_DEPTH:
        raise WireError("value nested too deeply")
    t = type(value)
    if t in _SCALARS:
        return value
    if t is bytes:
        return {"b": value.hex()}
    if t is list:
        return [encode(v, depth + 1, export) for v in value]
    if t is tuple:
        return {"t": [encode(v, depth + 1, export) for v in value]}
    if t in (set, frozenset):
        return {"s" if t is set else "f": [encode(v, depth + 1, export) for v in value]}
    if t is dict:
        return {"d": [[encode(k, depth + 1, export), encode(v, depth + 1, export)] for k, v in value.items()]}
    if export is not None and callable(value):
        return {"c": export(value)}
    raise WireError(f"a {t.__module__}.{t.__qualname__} cannot cross (plain builtin data only)")


def decode(obj: object, depth: int = 0, bind: Callable[[int], Callable] | None = None) -> object:
    """Fresh builtins from tagged JSON; with `bind`, a handle becomes a forwarder. Only WireError escapes."""
    try:
        return _decode(obj, depth, bind)
    except WireError:
        raise
    except Exception as exc:
        # bad hex, unhashable set members or keys, recursion: all malformed data
        raise WireError(f"malformed value ({type(exc).__name__})") from None


def _decode(obj: object, depth: int, bind: Callable[[int], Callable] | None) -> object:
    if depth > MAX_DEPTH:
        raise WireError("value nested too deeply")
    if type(obj) in _SCALARS:
        return obj
    if type(obj) is list:
        return [_decode(v, depth + 1, bind) for v in obj]
    if type(obj) is dict and len(obj) == 1:
        (tag, body), = obj.items()
        if tag == "b" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "c" and type(body) is int and bind is not None:
            return bind(body)
        if type(body) is list:
            items = [_decode(v, depth + 1, bind) for v in body] if tag != "d" else None
            if tag == "t":
                return tuple(items)
            if tag == "s":
                return set(items)
            if tag == "f":
                return frozenset(items)
            if tag == "d" and all(type(p) is list and len(p) == 2 for p in body):
                return {_decode(k, depth + 1, bind): _decode(v, depth + 1, bind) for k, v in body}
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
        except Exception:
            # not JSON, not UTF-8, or nested past the parser's recursion limit
            raise WireError("message is not JSON") from None
        if type(message) is not dict:
            raise WireError("message is not an object")
        return message


class Peer:
    """One end of the judge-callee connection: requests out, the other side's requests served meanwhile.

    serve(request) -> reply answers a request from the other side (it must not raise);
    exported callables are kept by handle so the other side can call them back.
    """

    def __init__(self, in_fd: int, out_fd: int, serve: Callable[[dict], dict], timeout_s: float | None = None) -> None:
        self.reader, self.out_fd, self.serve, self.timeout_s = Reader(in_fd), out_fd, serve, timeout_s
        self.exported: list[Callable] = []

    def export(self, fn: Callable) -> int:
        if len(self.exported) >= MAX_HANDLES:
            raise WireError(f"more than {MAX_HANDLES} callables crossed")
        self.exported.append(fn)
        return len(self.exported) - 1

    def exported_fn(self, handle: object) -> Callable:
        if type(handle) is not int or not 0 <= handle < len(self.exported):
            raise WireError("unknown callable handle")
        return self.exported[handle]

    def request(self, message: dict) -> dict | None:
        """Send `message`, serve requests until the reply comes; None when the other side is gone."""
        send(self.out_fd, message)
        while (incoming := self.reader.recv(self.timeout_s)) is not None:
            if "op" not in incoming:
                return incoming
            send(self.out_fd, self.serve(incoming))
        return None

    def serve_forever(self) -> None:
        """Answer requests until end of stream (the callee's main loop)."""
        while (incoming := self.reader.recv()) is not None:
            send(self.out_fd, self.serve(incoming))


def exception_from(name: object, text: object) -> BaseException:
    """The judge-side exception for a callee's error: the builtin of that name, else RuntimeError."""
    cls = _EXCEPTIONS.get(name) if type(name) is str else None
    return (cls or RuntimeError)(str(text)[:2000] if cls else f"{str(name)[:100]}: {str(text)[:2000]}")
