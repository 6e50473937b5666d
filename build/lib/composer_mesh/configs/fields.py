"""`option()`: a dataclass field that carries its doc string and its valid range.

Every config section is a frozen dataclass whose fields are made with `option`,
so the loader can validate values (naming the key) and the docs can be generated
from the schema.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

_MISSING: Any = dataclasses.MISSING


def option(
    default: Any = _MISSING,
    *,
    doc: str,
    default_factory: Callable[[], Any] | Any = _MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: Sequence[Any] | None = None,
    secret_env: bool = False,
) -> Any:
    """A config field.

    doc: one line for the configuration reference.
    ge/gt/le/lt: numeric bounds checked by the loader.
    choices: the allowed values (strings usually).
    secret_env: the value is the *name* of an environment variable that holds a
        secret; the loader checks the variable exists when the name is non-empty,
        and the value itself never leaves the process.
    """
    metadata = {
        "doc": doc,
        "ge": ge,
        "gt": gt,
        "le": le,
        "lt": lt,
        "choices": tuple(choices) if choices is not None else None,
        "secret_env": secret_env,
    }
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)
