"""Strict config loading: YAML with duplicate-key rejection, dataclasses built from dicts.

Every component owns a ``@dataclass(kw_only=True, slots=True)`` config that lives
beside it and validates its own values in ``__post_init__`` (raising ``ValueError``
that names the field and the bad value). This module only turns plain YAML data
into those dataclasses, refusing unknown keys (with a did-you-mean hint) and
values of the wrong type, and naming the dotted config path of every problem.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or section is invalid; the message names the dotted key."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys instead of keeping the last."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            mark = key_node.start_mark
            raise ConfigError(f"duplicate key {key!r} in {mark.name} line {mark.line + 1}")
        seen[key] = True
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping from ``path``; duplicate keys and non-mapping roots are errors."""
    path = Path(path)
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.y*ml"))
        raise ConfigError(f"config {path} is a directory, not a YAML file"
                          + (f"; it holds {', '.join(found)}" if found else ""))
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    with path.open(encoding="utf-8") as f:
        try:
            data = yaml.load(f, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: no arbitrary objects
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from e
        except UnicodeDecodeError as e:  # a binary file, or a config saved in another encoding
            raise ConfigError(f"{path}: not a UTF-8 text file ({e.reason} at byte {e.start}); a config is YAML "
                              "text") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor (the root exists): where a directory at ``path`` would be made,
    and which must be a directory for that (a file there failed at the first write, with a traceback)."""
    return next(at for at in (path.absolute(), *path.absolute().parents) if at.exists())


def from_dict(cls: type[T], data: Mapping[str, Any] | None, where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, checking keys and types recursively.

    ``where`` is the dotted path of this section, used in error messages.
    """
    data = {} if data is None else data
    label = where or cls.__name__
    if not isinstance(data, Mapping):
        raise ConfigError(f"{label}: expected a mapping, got {type(data).__name__} ({data!r})")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        hint = difflib.get_close_matches(str(key), list(fields), n=1)
        suffix = f"; did you mean {hint[0]!r}?" if hint else f"; valid keys: {sorted(fields)}"
        raise ConfigError(f"unknown config key {_join(where, key)!r}{suffix}")
    hints = typing.get_type_hints(cls)
    kwargs = {k: _coerce(hints[k], v, _join(where, k)) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(_in_section(where, label, str(e))) from e


def _in_section(where: str, label: str, message: str) -> str:
    """A section's own check, placed: one that names its key from the section (``tensorize.max_rank must ...``)
    gets the full dotted key (``comera.tensorize.max_rank must ...``), any other the section's label."""
    short = where.rsplit(".", 1)[-1]
    if where and message.startswith(f"{short}."):
        return where + message[len(short):]
    return f"{label}: {message}"


def to_dict(obj: Any) -> Any:
    """Plain-data (YAML/JSON-ready) form of a config dataclass tree."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _join(where: str, key: Any) -> str:
    return f"{where}.{key}" if where else str(key)


def _coerce(tp: Any, value: Any, where: str) -> Any:
    """Check ``value`` against annotation ``tp``; build nested dataclasses."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {args}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} ({value!r})")
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__} ({value!r})")
        kt, vt = args or (Any, Any)
        return {_coerce(kt, k, where): _coerce(vt, v, _join(where, k)) for k, v in value.items()}
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string: take what is a number
            value = _number_or(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {type(value).__name__} ({value!r})")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {type(value).__name__} ({value!r})")
        return value
    if tp in (bool, str):
        if not isinstance(value, tp):
            raise ConfigError(f"{where}: expected {tp.__name__}, got {type(value).__name__} ({value!r})")
        return value
    return value


def _number_or(text: str) -> float | str:
    """``text`` as a float when it is a plain decimal number (``1e-3``, ``-2E5``), else ``text`` unchanged;
    ``nan``, ``inf`` and the like stay strings (refused by the type check)."""
    try:
        number = float(text)
    except ValueError:
        return text
    return number if math.isfinite(number) else text
