"""The submission's side of a split grade: import the rebuilt modules, answer calls, nothing else.

Started by `envs.grading` in its own sandbox (the agent's sources, no tests) as
`python -E -s -P -B _callee.py <in fd> <out fd> <repo>`. Requests from the judge:
{"op": "describe", "module"} -> the module's public names (functions, plain
values, or "opaque"); {"op": "call", "module", "name", "args", "kwargs"} ->
{"ok": value} or {"raise": exception name, "text"}. Whatever this process does,
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
        except BaseException as exc:  # everything a call raises goes back as data
            try:
                wire.send(out_fd, {"raise": type(exc).__name__, "text": str(exc)[:2000]})
            except BaseException:
                wire.send(out_fd, {"raise": "RuntimeError", "text": "unprintable exception"})


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
    return wire.encode(fn(*args, **kwargs))


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    main()
