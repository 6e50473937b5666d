"""Load user code named in a recipe: `'package.module:function'` entry points and `[job] python_path`.

Entry points are imported in whichever process needs them (the controller checks
them before placing any actor; each generator imports them again), so a plugin
is either an installed package or a folder listed in `[job] python_path`.
Errors name the config key, the module and the function.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any, Callable, Sequence


def add_python_path(folders: Sequence[str]) -> None:
    """Put `folders` first on this process's sys.path and on PYTHONPATH (inherited by actor processes)."""
    if not folders:
        return
    absolute = [os.path.abspath(f) for f in folders]
    for folder, given in zip(absolute, folders):
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"job.python_path: {given!r} is not a folder")
    for folder in reversed(absolute):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([*absolute, *([old] if old else [])])


def load_callable(spec: str, key: str) -> Callable[..., Any]:
    """The function `spec` = 'package.module:function' names (`key` is the config key, for errors)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{key} = {spec!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(
            f"{key} = {spec!r}: module {e.name!r} not found (install the package or add its folder to "
            f"job.python_path; sys.path[0] is {sys.path[0]!r})"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key} = {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{key} = {spec!r}: {attr!r} is a {type(obj).__name__}, not a function")
    return obj


def check_call(fn: Callable[..., Any], spec: str, key: str, positional: int, keywords: Sequence[str]) -> None:
    """Raise naming `key` unless `fn` accepts `positional` arguments and the keyword `keywords`."""
    try:
        inspect.signature(fn).bind(*([None] * positional), **{k: None for k in keywords})
    except TypeError as e:
        args = ", ".join(["<positional>"] * positional + [f"{k}=..." for k in keywords])
        raise ValueError(f"{key} = {spec!r}: cannot be called as {fn.__name__}({args}): {e}") from None
    except ValueError:  # builtins without a signature: checked when called
        return
