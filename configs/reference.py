"""The configuration reference (Markdown), generated from the schema's field docs."""

from __future__ import annotations

import dataclasses
import typing

from composer_mesh.configs.schema import JobConfig


def render_reference() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the schema by `composer-mesh config reference`; do not edit by hand.",
        "Every key can be set in a recipe's `[section]` or on the command line as `--section.key=value`.",
        "",
    ]
    # annotations are strings (PEP 563)
    hints = typing.get_type_hints(JobConfig)
    for f in dataclasses.fields(JobConfig):
        _section(hints[f.name], f.name, lines)
    return "\n".join(lines) + "\n"


def _section(cls: type, name: str, lines: list[str]) -> None:
    doc = (cls.__doc__ or "").strip().splitlines()
    lines += [f"## [{name}]", ""]
    if doc and not doc[0].startswith(cls.__name__ + "("):
        lines += [doc[0], ""]
    hints = typing.get_type_hints(cls)
    nested = []
    rows = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        # a type hint is a class or a typing form, never a dataclass instance: isinstance only narrows it for mypy
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            nested.append((tp, f"{name}.{f.name}"))
            continue
        rows.append(f"| `{f.name}` | `{_type(tp)}` | `{_default(f)}` | {_constraints(f.metadata)}{f.metadata.get('doc', '')} |")
    if rows:
        lines += ["| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    for tp, sub in nested:
        _section(tp, sub, lines)


def _type(tp: typing.Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return repr(f.default_factory())
    return "required"


def _constraints(meta: typing.Mapping[str, typing.Any]) -> str:
    parts = [f"{sym} {meta[k]}" for k, sym in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")) if meta.get(k) is not None]
    if meta.get("choices"):
        parts.append("one of " + ", ".join(map(str, meta["choices"])))
    if meta.get("secret_env"):
        parts.append("environment-variable name")
    return f"({'; '.join(parts)}) " if parts else ""
