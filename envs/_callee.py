"""The submission's side of a split grade: import the rebuilt modules, answer calls, nothing else.

Started by `envs.grading` in its own sandbox (the agent's sources, no tests) as
`python -E -s -P -B _callee.py <in fd> <out fd> <repo>`. Requests from the judge:
{"op": "describe", "module"} -> the module's public names (functions, plain
values, or "opaque"); {"op": "call", "module", "name" | "handle", "args", "kwargs"} ->
{"ok": value, "warnings"?}, {"raise": exception name, "text"}, or {"unplain": type name}
when the result is not plain data (an always-equal object, a str subclass, ...).
Callables cross as handles both ways (`_wire.Peer`): a callback the test passes is
called back in the judge. The test's objects arrive as `_wire.RemoteObject`
proxies (each operation asked of the judge); instances of the described target
modules' classes leave as attribute state, which the judge rebuilds as its own
class's. Whatever this process does, its only output that matters is what
crosses the wire, as plain data.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
import warnings


def main() -> None:
    in_fd, out_fd, repo = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    # a pool worker imported it before any job ran (`_zygote.py`); else before the repository is on the path
    wire = sys.modules.get("_composer_wire") or importlib.import_module("_wire")
    sys.path.insert(0, repo)
    peer = wire.Peer(in_fd, out_fd, lambda request: answer(wire, peer, request),
                     forwarder=lambda h: remote(wire, peer, {"op": "call", "handle": h}),
                     proxy=lambda h: wire.RemoteObject(remote(wire, peer, {"op": "object", "handle": h})))
    peer.serve_forever()


class Unplain(Exception):
    """The called function returned a value that may not cross the wire (its type name)."""


def answer(wire: types.ModuleType, peer, request: dict) -> dict:
    """The reply to one request; everything a call raises goes back as data.

    A module that fails to import ends this process instead: its traceback on
    stderr is how the sandbox names a limit the import hit (MemoryError, File too large).
    """
    if request.get("op") == "describe":
        return handle(wire, peer, request)
    try:
        return handle(wire, peer, request)
    except Unplain as exc:
        return {"unplain": str(exc)[:200]}
    except BaseException as exc:
        try:
            return {"raise": type(exc).__name__, "text": str(exc)[:2000]}
        except BaseException:
            return {"raise": "RuntimeError", "text": "unprintable exception"}


def handle(wire: types.ModuleType, peer, request: dict) -> dict:
    if request.get("op") == "describe":
        module = importlib.import_module(str(request["module"]))
        # its classes' instances cross as state from now on
        peer.modules.add(module.__name__)
        names = {}
        for name, value in vars(module).items():
            if name.startswith("__"):
                continue
            if callable(value) and not isinstance(value, type):
                names[name] = ["function"]
            else:
                try:
                    wire.encode(value)
                    names[name] = ["value", value]
                except wire.WireError:
                    names[name] = ["opaque"]
        return {"ok": wire.encode(names)}
    if request.get("op") != "call":
        raise ValueError(f"unknown request {str(request.get('op'))[:40]!r}")
    if "handle" in request:
        fn = peer.exported_fn(request["handle"])
    else:
        fn = getattr(importlib.import_module(str(request["module"])), str(request["name"]))
    args, kwargs = wire.decode(request["args"], peer=peer), wire.decode(request["kwargs"], peer=peer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    try:
        reply = {"ok": wire.encode(result, export=peer.export)}
    except wire.WireError:
        raise Unplain(type(result).__qualname__) from None
    if caught:
        reply["warnings"] = [[w.category.__name__, str(w.message)[:500]] for w in caught[:20]]
    return reply


def remote(wire: types.ModuleType, peer, head: dict):
    """Asks the judge about one of its handles: a call (`head` {"op": "call", "handle"}) or an object operation.

    For an object, the first argument is the operation's name (`_wire.OBJECT_OPS`).
    """

    def ask(*args, **kwargs):
        if head["op"] == "object":
            message = {**head, "action": args[0], "args": wire.encode(list(args[1:]), export=peer.export)}
        else:
            message = {**head, "args": wire.encode(list(args), export=peer.export), "kwargs": wire.encode(kwargs, export=peer.export)}
        reply = peer.request(message)
        if reply is None:
            raise RuntimeError("the judge is gone")
        if "ok" in reply:
            return wire.decode(reply["ok"], peer=peer)
        raise wire.exception_from(reply.get("raise"), reply.get("text"))

    return ask


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the judge is gone: skip tearing the interpreter down
    os._exit(0)
