"""TOML recipe → frozen `JobConfig`, with includes, CLI overrides and validation.

Precedence, lowest first: dataclass defaults < `base = "..."` recipe(s) < the
recipe file < overrides: CLI items `--section.key=value` (TOML literals) or a
mapping of dotted key -> Python value (`{"trainer.steps": 4}`), validated by the
schema like any recipe value. Every error names the file (or "override"), the
dotted key, what was expected and what was found, and for an unknown key the
nearest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping

import tomli
import tomli_w

from composer_mesh.configs.schema import JobConfig

CONFIG_DIR = Path(__file__).resolve().parent
_BASE_KEY = "base"


class ConfigError(ValueError):
    """A recipe, include or override that does not fit the schema."""


def resolve_config_path(path: str | os.PathLike) -> Path:
    """A recipe path as given, or else a recipe shipped in `configs/` by file name."""
    p = Path(path)
    if p.is_file():
        return p.resolve()
    shipped = CONFIG_DIR / p.name
    if not p.parent.parts or p.parent.name == "configs":
        if shipped.is_file():
            return shipped
    raise ConfigError(f"{path}: no such config file (shipped recipes: {', '.join(list_recipes())})")


def list_recipes() -> list[str]:
    return sorted(p.name for p in CONFIG_DIR.glob("*.toml"))


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Iterable[str] | Mapping[str, Any] = (),
    *,
    environ: Mapping[str, str] | None = None,
) -> JobConfig:
    """Load a recipe (or only defaults when `path` is None), apply overrides, validate.

    overrides: CLI items `["--trainer.steps=4"]`, or typed `{"trainer.steps": 4}` (dotted key -> value).
    """
    data: dict[str, Any] = {}
    sources: dict[tuple[str, ...], str] = {}
    if path is not None:
        data = _read_with_bases(resolve_config_path(path), chain=(), sources=sources)
    if isinstance(overrides, Mapping):
        items = [(_override_key(str(dotted), repr(dotted)), value) for dotted, value in overrides.items()]
    else:
        items = [_parse_override(item) for item in overrides]
    for key, value in items:
        _set_path(data, key, value, sources)
    return from_dict(JobConfig, data, sources=sources, environ=os.environ if environ is None else environ)


def loads_config(text: str, *, environ: Mapping[str, str] | None = None, name: str = "<string>") -> JobConfig:
    """Load a recipe from TOML text (no `base` includes)."""
    data = _parse_toml(text, name)
    sources: dict[tuple[str, ...], str] = {}
    _record_sources(data, (), name, sources)
    if _BASE_KEY in data:
        raise ConfigError(f"{name}: key 'base' needs a file on disk to resolve against")
    return from_dict(JobConfig, data, sources=sources, environ=os.environ if environ is None else environ)


def dump_config(cfg: Any) -> str:
    """The resolved config as TOML (secrets are env-var names, so nothing to redact)."""
    return tomli_w.dumps(_to_plain(cfg))


def to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain dicts/lists (e.g. for metrics and run manifests)."""
    return _to_plain(cfg)


# ----------------------------------------------------------------------------- reading


def _parse_toml(text: str, name: str) -> dict[str, Any]:
    try:
        return tomli.loads(text)
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"{name}: invalid TOML: {e}") from None


def _read_with_bases(path: Path, chain: tuple[Path, ...], sources: dict) -> dict[str, Any]:
    if path in chain:
        cycle = " -> ".join(p.name for p in (*chain, path))
        raise ConfigError(f"{path}: key 'base': include cycle {cycle}")
    data = _parse_toml(path.read_text(encoding="utf-8"), str(path))
    base = data.pop(_BASE_KEY, None)
    merged: dict[str, Any] = {}
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{path}: key 'base': expected a file name (str), got {_show(base)}")
        base_path = (path.parent / base).resolve()
        if not base_path.is_file():
            raise ConfigError(f"{path}: key 'base': included file {base_path} does not exist")
        merged = _read_with_bases(base_path, (*chain, path), sources)
    _record_sources(data, (), str(path), sources)
    _deep_merge(merged, data)
    return merged


def _deep_merge(into: dict[str, Any], new: Mapping[str, Any]) -> None:
    """Tables merge key by key; scalars and arrays replace."""
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


def _record_sources(data: Mapping[str, Any], prefix: tuple[str, ...], source: str, sources: dict) -> None:
    for key, value in data.items():
        sources[(*prefix, key)] = source
        if isinstance(value, dict):
            _record_sources(value, (*prefix, key), source, sources)


def _parse_override(item: str) -> tuple[tuple[str, ...], Any]:
    text = item[2:] if item.startswith("--") else item
    if "=" not in text:
        raise ConfigError(f"override {item!r}: expected --section.key=value")
    dotted, raw = text.split("=", 1)
    key = _override_key(dotted, repr(item))
    # a TOML literal (numbers, booleans, arrays, quoted strings) ...
    try:
        value: Any = tomli.loads(f"v = {raw}")["v"]
    except tomli.TOMLDecodeError:  # ... or a bare string
        value = raw
    return key, value


def _override_key(dotted: str, shown: str) -> tuple[str, ...]:
    """`section.key` (or deeper) as a key path; `shown` is how the error names the override."""
    key = tuple(dotted.strip().split("."))
    if len(key) < 2 or not all(key):
        raise ConfigError(f"override {shown}: expected --section.key=value")
    return key


def _set_path(data: dict[str, Any], key: tuple[str, ...], value: Any, sources: dict) -> None:
    node = data
    for i, part in enumerate(key[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override: key '{'.'.join(key[: i + 1])}' is not a table")
        node = child
    node[key[-1]] = value
    sources[key] = "override"


# ----------------------------------------------------------------------------- building


def from_dict(
    cls: type,
    data: Mapping[str, Any],
    *,
    sources: Mapping[tuple[str, ...], str] | None = None,
    environ: Mapping[str, str] | None = None,
    _prefix: tuple[str, ...] = (),
) -> Any:
    """Build dataclass `cls` from plain data, validating every value against the schema."""
    sources = sources or {}
    environ = os.environ if environ is None else environ
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    for name in data:
        if name not in fields:
            where = _where(sources, (*_prefix, name))
            near = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys: {', '.join(fields)}"
            raise ConfigError(f"{where}unknown key '{_dotted((*_prefix, name))}'{hint}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = (*_prefix, name)
        f = fields[name]
        converted = _convert(hints[name], value, key, sources, environ)
        _check_meta(f.metadata, converted, key, sources, environ)
        kwargs[name] = converted
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        where = _where(sources, (*_prefix, next(iter(data), "")) if data else _prefix)
        section = _dotted(_prefix) or "<root>"
        raise ConfigError(f"{where}[{section}] {e}") from None


def _convert(tp: Any, value: Any, key: tuple[str, ...], sources: Mapping, environ: Mapping) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    def fail(expected: str) -> typing.NoReturn:
        raise ConfigError(f"{_where(sources, key)}key '{_dotted(key)}': expected {expected}, got {_show(value)}")

    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() == "none" and type(None) in args):
            return None
        for arg in non_none:
            try:
                return _convert(arg, value, key, sources, environ)
            except ConfigError:
                continue
        fail(" or ".join(_type_name(a) for a in non_none))
    if origin is Literal:
        if value not in args:
            fail("one of " + ", ".join(repr(a) for a in args))
        return value
    # a type hint is a class or a typing form, never a dataclass instance: isinstance only narrows it for mypy
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            fail(f"a table [{_dotted(key)}]")
        return from_dict(tp, value, sources=sources, environ=environ, _prefix=key)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            fail(f"an array of {_type_name(args[0]) if args else 'values'}")
        if origin is tuple and args and (len(args) != 2 or args[1] is not Ellipsis):
            if len(value) != len(args):
                fail(f"an array of {len(args)} items")
            items = [_convert(a, v, (*key, str(i)), sources, environ) for i, (a, v) in enumerate(zip(args, value))]
        else:
            item_tp = args[0] if args else Any
            items = [_convert(item_tp, v, (*key, str(i)), sources, environ) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            fail("a table")
        key_tp, val_tp = args or (str, Any)
        return {str(k): _convert(val_tp, v, (*key, str(k)), sources, environ) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            fail("bool (true/false)")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail("int")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail("float")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            fail("str")
        return value
    raise ConfigError(f"key '{_dotted(key)}': unsupported schema type {tp!r}")


def _check_meta(meta: Mapping[str, Any], value: Any, key: tuple[str, ...], sources: Mapping, environ: Mapping) -> None:
    if not meta:
        return
    where = f"{_where(sources, key)}key '{_dotted(key)}'"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for name, ok, word in (
            ("ge", lambda v, b: v >= b, ">="),
            ("gt", lambda v, b: v > b, ">"),
            ("le", lambda v, b: v <= b, "<="),
            ("lt", lambda v, b: v < b, "<"),
        ):
            bound = meta.get(name)
            if bound is not None and not ok(value, bound):
                raise ConfigError(f"{where}: expected a value {word} {bound}, got {value!r}")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{where}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
    if meta.get("secret_env") and value:
        if not isinstance(value, str) or not value.replace("_", "").isalnum():
            raise ConfigError(f"{where}: expected the *name* of an environment variable, not a secret value")
        if value not in environ:
            raise ConfigError(f"{where}: environment variable {value!r} (named by this key) is not set")


# ----------------------------------------------------------------------------- helpers


def _where(sources: Mapping[tuple[str, ...], str], key: tuple[str, ...]) -> str:
    for n in range(len(key), 0, -1):
        if key[:n] in sources:
            return f"{sources[key[:n]]}: "
    return ""


def _dotted(key: tuple[str, ...]) -> str:
    return ".".join(key)


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (tuple, list):
        return "array"
    if origin is dict:
        return "table"
    return getattr(tp, "__name__", str(tp))


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): _to_plain(v) for k, v in obj.items()}
    # TOML has no null; optional fields read "none" back as None
    if obj is None:
        return "none"
    return obj
