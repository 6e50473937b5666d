"""Plain-data wire format between the judge and the submission's callee process (stdlib only).

Only exact builtin types cross: None, bool, int, float, str, bytes, list,
tuple, dict, set, frozenset (subclasses are refused, so an object with an
always-true `__eq__` cannot reach the judge). Everything else crosses through
a `Peer`, by the sender's policy:
- a callable as a handle (`{"c": id}`): the receiver gets a forwarder that calls it back;
- an object the sender shares (the judge: instances of the repository's classes,
  e.g. a test's `Square`) as `{"o": id}`: the receiver gets a `RemoteObject`
  whose attribute reads, writes and protocol operations (`OBJECT_OPS`) are
  answered by the owner with plain data or further handles;
- an instance of a class of a target module (`Token`) as its attribute state
  `{"i": [module, qualname, [[name, value], ...]]}`: the receiver rebuilds it as
  an instance of its own class of that name (`rebuild`: no constructor, no
  unpickling, only plain identifiers, never a dunder);
- one of the receiver's own handles, sent back, as `{"r": id}`: the receiver
  gets its original object (identity kept).
Values are tagged JSON, one message per line, bounded in size and depth. Both
sandboxed sides import this file read-only; the judge decodes into fresh
builtin objects (or its own classes' instances) and compares them with their own `==`.

`Peer` is one side of the connection: `request()` sends a message and, while
it waits for the reply, serves the other side's requests (callbacks nest).
Messages with an "op" are requests, the others replies.
"""

from __future__ import annotations

import json
import operator
import os
import select
import sys
from itertools import islice
from typing import Callable

MAX_MESSAGE = 8 << 20
MAX_DEPTH = 64
MAX_HANDLES = 10_000
MAX_ATTRS = 256
MAX_ITEMS = 100_000
# requests the other side may make while one of ours is open (a call storm ends the call)
MAX_REQUESTS = 20_000
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


class NotRebuildable(WireError):
    """Instance state of a class this side does not define (a helper class of the submission's): not plain data."""


class TooLarge(WireError):
    """A message of this side's over `MAX_MESSAGE` bytes: the wire's own bound, not something the other side sent."""


def encode(value: object, depth: int = 0, export: Callable[[object], dict] | None = None) -> object:
    """Tagged JSON of a plain value; with `export` (`Peer.export`), anything else gets the tag export gives."""
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
    if export is not None:
        tag = export(value)
        if "i" not in tag:
            return tag
        module, qualname, pairs = tag["i"]
        return {"i": [module, qualname, [[name, encode(v, depth + 1, export)] for name, v in pairs]]}
    raise WireError(f"a {t.__module__}.{t.__qualname__} cannot cross (plain builtin data only)")


def decode(obj: object, depth: int = 0, bind: Callable[[int], Callable] | None = None, peer: Peer | None = None) -> object:
    """Fresh builtins from tagged JSON; with `bind` or `peer`, handles become forwarders. Only WireError escapes."""
    if peer is not None:
        bind = peer
    try:
        return _decode(obj, depth, bind)
    except WireError:
        raise
    except Exception as exc:
        # bad hex, unhashable set members or keys, recursion: all malformed data
        raise WireError(f"malformed value ({type(exc).__name__})") from None


def _decode(obj: object, depth: int, bind: Callable[[int], Callable] | Peer | None) -> object:
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
        if type(bind) is Peer:
            if tag in ("c", "o") and type(body) is int:
                return bind.bind(tag, body)
            if tag == "r":
                return bind.exported_value(body)
            if tag == "i" and type(body) is list and len(body) == 3 and type(body[2]) is list:
                if len(body[2]) > MAX_ATTRS or not all(type(p) is list and len(p) == 2 for p in body[2]):
                    raise WireError("instance state malformed or over the attribute limit")
                return bind.rebuild(body[0], body[1], [(k, _decode(v, depth + 1, bind)) for k, v in body[2]])
        elif tag == "c" and type(body) is int and bind is not None:
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
        raise TooLarge(f"message over {MAX_MESSAGE} bytes")
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

    serve(request) -> reply answers a request from the other side (it must not raise).
    Policy of this side: `share(value)` -> may a non-callable object cross as a
    proxy; `modules`: the target modules whose classes' instances cross as state.
    `forwarder(handle)` / `proxy(handle)` build this side's stand-ins for the
    other side's callables / objects (none: such a handle is malformed).
    """

    def __init__(self, in_fd: int, out_fd: int, serve: Callable[[dict], dict], timeout_s: float | None = None,
                 share: Callable[[object], bool] | None = None, modules: set[str] | None = None,
                 forwarder: Callable[[int], Callable] | None = None, proxy: Callable[[int], object] | None = None) -> None:
        self.reader, self.out_fd, self.serve, self.timeout_s = Reader(in_fd), out_fd, serve, timeout_s
        self.share, self.modules, self.forwarder, self.proxy = share, modules if modules is not None else set(), forwarder, proxy
        # this side's values the other side holds handles to, and their kind ("c" or "o")
        self.exported: list[object] = []
        self.kinds: list[str] = []
        # stand-ins for the other side's handles, one per handle: (kind, handle) <-> stand-in
        self.imported: dict[tuple[str, int], object] = {}
        self.imported_ids: dict[int, tuple[str, int]] = {}
        self.depth = self.served = 0

    def export(self, value: object) -> dict:
        """The tag of a value that is not plain data (`encode`); WireError when it may not cross."""
        key = self.imported_ids.get(id(value))
        if key is not None and self.imported[key] is value:
            return {"r": key[1]}
        # a callable (a target class's callable instance too) crosses as a handle
        pairs = None if callable(value) else state_of(value, self.modules)
        if pairs is not None:
            return {"i": [type(value).__module__, type(value).__qualname__, pairs]}
        if callable(value):
            kind = "c"
        elif self.share is not None and self.share(value):
            kind = "o"
        else:
            t = type(value)
            raise WireError(f"a {t.__module__}.{t.__qualname__} cannot cross (plain data, callables, shared objects)")
        if len(self.exported) >= MAX_HANDLES:
            raise WireError(f"more than {MAX_HANDLES} handles crossed")
        self.exported.append(value)
        self.kinds.append(kind)
        return {kind: len(self.exported) - 1}

    def exported_value(self, handle: object, kind: str | None = None) -> object:
        """This side's value behind `handle` (of `kind` when given); WireError for any other number."""
        if type(handle) is not int or not 0 <= handle < len(self.exported) or kind not in (None, self.kinds[handle]):
            raise WireError(f"unknown {'callable ' if kind == 'c' else ''}handle")
        return self.exported[handle]

    def exported_fn(self, handle: object) -> Callable:
        return self.exported_value(handle, "c")

    def bind(self, kind: str, handle: int) -> object:
        """The stand-in for the other side's handle (the same one each time)."""
        key = (kind, handle)
        if key not in self.imported:
            make = self.forwarder if kind == "c" else self.proxy
            if make is None or handle < 0 or len(self.imported) >= MAX_HANDLES:
                raise WireError(f"a handle of kind {kind!r} may not cross here")
            stand_in = make(handle)
            self.imported[key], self.imported_ids[id(stand_in)] = stand_in, key
        return self.imported[key]

    def rebuild(self, module: object, qualname: object, pairs: list) -> object:
        if module not in self.modules:
            raise WireError("an instance of a class outside the target modules")
        return rebuild(module, qualname, pairs)

    def request(self, message: dict) -> dict | None:
        """Send `message`, serve requests until the reply comes; None when the other side is gone."""
        if self.depth == 0:
            self.served = 0
        if self.served > MAX_REQUESTS:
            raise WireError(f"more than {MAX_REQUESTS} requests from the other side during one call")
        send(self.out_fd, message)
        self.depth += 1
        try:
            while (incoming := self.reader.recv(self.timeout_s)) is not None:
                if "op" not in incoming:
                    return incoming
                self.served += 1
                if self.served > MAX_REQUESTS:
                    raise WireError(f"more than {MAX_REQUESTS} requests from the other side during one call")
                send(self.out_fd, self.serve(incoming))
            return None
        finally:
            self.depth -= 1

    def serve_forever(self) -> None:
        """Answer requests until end of stream (the callee's main loop)."""
        while (incoming := self.reader.recv()) is not None:
            send(self.out_fd, self.serve(incoming))


def plain_name(name: object) -> bool:
    """An attribute name that may cross: an identifier, never a dunder."""
    return type(name) is str and name.isidentifier() and not name.startswith("__")


def state_of(value: object, modules: set[str]) -> list | None:
    """[(name, value)] of an instance of a target module's class (its `__dict__` and slots), else None."""
    cls = type(value)
    if cls.__module__ not in modules or isinstance(value, type) or _resolve(cls.__module__, cls.__qualname__) is not cls:
        return None
    pairs = list(getattr(value, "__dict__", {}).items())
    for name, desc in _slots(cls).items():
        try:
            pairs.append((name, desc.__get__(value, cls)))
        except AttributeError:
            pass
    return pairs


def _resolve(module: object, qualname: object) -> object:
    """The class `qualname` of the loaded module `module` (plain names only, no attribute hooks run), else None."""
    obj = sys.modules.get(module) if type(module) is str else None
    parts = qualname.split(".") if type(qualname) is str else [""]
    for part in parts:
        if obj is None or not plain_name(part):
            return None
        obj = vars(obj).get(part) if hasattr(obj, "__dict__") else None
    return obj


def _slots(cls: type) -> dict:
    """name -> member descriptor of every `__slots__` entry along the class's bases."""
    out = {}
    for base in reversed(cls.__mro__):
        slots = base.__dict__.get("__slots__", ())
        for name in (slots,) if type(slots) is str else slots:
            if type(name) is str and plain_name(name) and type(base.__dict__.get(name)).__name__ == "member_descriptor":
                out[name] = base.__dict__[name]
    return out


def rebuild(module: object, qualname: object, pairs: list) -> object:
    """An instance of this side's class `module.qualname` with the attribute state `pairs`; runs none of its code.

    Plain attribute names only (never a dunder), none that hides a class attribute;
    a dataclass needs exactly its fields.
    """
    names = [name for name, _ in pairs]
    if not all(plain_name(n) for n in names) or len(names) > MAX_ATTRS:
        raise WireError("instance state names an attribute that is not a plain identifier")
    if type(qualname) is not str or not all(plain_name(part) for part in qualname.split(".")):
        raise WireError("class name is not a dotted plain identifier")
    cls = _resolve(module, qualname)
    if type(cls) is not type or cls.__module__ != module:
        raise NotRebuildable(f"{module}.{qualname}"[:200])
    fields = cls.__dict__.get("__dataclass_fields__")
    if type(fields) is dict and set(names) != set(fields):
        raise WireError("instance state does not match the dataclass fields")
    # TypeError for classes with a builtin base other than object: decode reports it as malformed
    obj = object.__new__(cls)
    slots = _slots(cls)
    try:
        state = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        state = None
    for name, value in pairs:
        if name in slots:
            slots[name].__set__(obj, value)
        elif type(fields) is not dict and any(name in vars(base) for base in cls.__mro__):
            # an instance attribute would hide the class's method or descriptor (`key` replaced by a forwarder)
            raise WireError(f"instance state {name!r} shadows an attribute of the class")
        elif type(state) is dict:
            state[name] = value
        else:
            raise WireError(f"{name!r} is not an attribute of the class")
    return obj


def _iterate(obj: object) -> list:
    """The items of `obj`; WireError past `MAX_ITEMS` (the wire's bound, not an error of `obj`)."""
    items = list(islice(iter(obj), MAX_ITEMS + 1))
    if len(items) > MAX_ITEMS:
        raise WireError(f"more than {MAX_ITEMS} items to iterate over across the wire")
    return items


# What a RemoteObject forwards to its owner: name -> the owner's operation on (its object, *args).
OBJECT_OPS: dict[str, Callable] = {
    "getattr": getattr, "setattr": setattr, "delattr": delattr,
    "len": len, "iter": _iterate, "getitem": operator.getitem, "setitem": operator.setitem, "contains": operator.contains,
    "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
    "hash": hash, "bool": bool, "str": str, "repr": repr, "int": int, "float": float, "index": operator.index,
    "neg": operator.neg, "pos": operator.pos, "abs": abs,
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow,
    "radd": lambda o, x: x + o, "rsub": lambda o, x: x - o, "rmul": lambda o, x: x * o,
    "rtruediv": lambda o, x: x / o, "rfloordiv": lambda o, x: x // o, "rmod": lambda o, x: x % o, "rpow": lambda o, x: x**o,
}
# operations whose first argument is an attribute name
NAMED_OPS = frozenset({"getattr", "setattr", "delattr"})


class RemoteObject:
    """The other side's object: every operation is asked of its owner (`ask(action, *args)`)."""

    __slots__ = ("_wire_ask", "__weakref__")

    def __init__(self, ask: Callable) -> None:
        object.__setattr__(self, "_wire_ask", ask)

    def __getattr__(self, name: str) -> object:
        # dunders are looked up by libraries all the time: answered here, never asked
        if not plain_name(name):
            raise AttributeError(name)
        return self._wire_ask("getattr", name)

    def __setattr__(self, name: str, value: object) -> None:
        if not plain_name(name):
            raise AttributeError(f"cannot set {name!r} on a remote object")
        self._wire_ask("setattr", name, value)

    def __delattr__(self, name: str) -> None:
        if not plain_name(name):
            raise AttributeError(f"cannot delete {name!r} on a remote object")
        self._wire_ask("delattr", name)

    def __iter__(self):
        return iter(self._wire_ask("iter"))


def _forwarding(action: str) -> Callable:
    def method(self, *args):
        return object.__getattribute__(self, "_wire_ask")(action, *args)

    method.__name__ = f"__{action}__"
    return method


for _action in set(OBJECT_OPS) - NAMED_OPS - {"iter"}:
    setattr(RemoteObject, f"__{_action}__", _forwarding(_action))


def exception_from(name: object, text: object) -> BaseException:
    """The judge-side exception for a callee's error: the builtin of that name, else RuntimeError."""
    cls = _EXCEPTIONS.get(name) if type(name) is str else None
    return (cls or RuntimeError)(str(text)[:2000] if cls else f"{str(name)[:100]}: {str(text)[:2000]}")
