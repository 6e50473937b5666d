"""The submission's side of a split grade: import the rebuilt modules, answer calls, nothing else.

Started by `envs.grading` in its own sandbox (the agent's sources, no tests) as
`python -E -s -P -B _callee.py <in fd> <out fd> <repo>`. Requests from the judge:
{"op": "describe", "module"} -> the module's public names (functions, plain
values, or "opaque"); {"op": "call", "module", "name", "args", "kwargs"} ->
{"ok": value}, {"raise": exception name, "text"}, or {"unplain": type name} when
the result is not plain data (an always-equal object, a str subclass, ...). Whatever this process does,
its only output that matters is what crosses the wire, as plain data.
"""

from __future__ import annotations

import importlib
import sys
import types


def main() -> None:
    in_fd, out_fd, repo = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    wire = importlib.import_module("_wire")  # before the repository is on the path
    sys.path.insert(0, repo)
    reader = wire.Reader(in_fd)
    while (request := reader.recv()) is not None:
        if request.get("op") == "describe":  # an import that fails ends this process (its traceback names why)
            wire.send(out_fd, {"ok": handle(wire, request)})
            continue
        try:
            wire.send(out_fd, {"ok": handle(wire, request)})
        except Unplain as exc:
            wire.send(out_fd, {"unplain": str(exc)[:200]})
        except BaseException as exc:  # everything a call raises goes back as data
            try:
                wire.send(out_fd, {"raise": type(exc).__name__, "text": str(exc)[:2000]})
            except BaseException:
                wire.send(out_fd, {"raise": "RuntimeError", "text": "unprintable exception"})


class Unplain(Exception):
    """The called function returned a value that may not cross the wire (its type name)."""


def handle(wire: types.ModuleType, request: dict) -> object:
    module = importlib.import_module(str(request["module"]))
    if request["op"] == "describe":
        names = {}
        for name, value in vars(module).items():
            if name.startswith("__"):
                continue
            if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
                names[name] = ["function"]
            else:
                try:
                    wire.encode(value)
                    names[name] = ["value", value]
                except wire.WireError:
                    names[name] = ["opaque"]
        return wire.encode(names)
    fn = getattr(module, str(request["name"]))
    args = wire.decode(request["args"])
    kwargs = wire.decode(request["kwargs"])
    result = fn(*args, **kwargs)
    try:
        return wire.encode(result)
    except wire.WireError:
        raise Unplain(type(result).__qualname__) from None


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    main()
