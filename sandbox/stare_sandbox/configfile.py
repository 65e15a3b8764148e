"""Typed configs from a YAML file and `a.b=c` overrides, validated against dataclasses.

A value comes from, in order of precedence: a command-line override, the YAML file, the root
dataclass's defaults (each written once, on its field). A key in the file or an override changes
exactly that key: the rest of its section keeps the default, including defaults a parent gives a
section (`optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))`). Types are
checked and converted by pydantic against the annotations, each dataclass's `__post_init__` checks
ranges, and every error names the key, what is allowed and where the value came from (file:line or
the override), with a suggestion for a misspelt key.

It lives in the `stare_sandbox` package because the sandbox is deployable on its own and never imports
`stare_agent`, while both read configs this way (`stare_agent.config` re-exports it).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import pydantic
import yaml

__all__ = ["ConfigError", "fields_of", "load_config"]

C = TypeVar("C")


class ConfigError(ValueError):
    """A config file or override is wrong; the message says which key, what is allowed and where."""


def load_config(
    cls: type[C],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    values: Mapping[str, tuple[Any, str]] | None = None,
) -> C:
    """Build a `cls` from its defaults, an optional YAML file and `a.b=c` overrides, validated.

    Each key given replaces that key only; everything else keeps the value `cls()` has. `values` maps
    dotted keys to (value, where it came from, e.g. "--port"), set last: for typed flags and environment
    variables (a secret among them never appears in an error, only its source).
    """
    data = dataclasses.asdict(cls())
    sources: dict[str, str] = {}
    if path is not None:
        given, lines = _read_yaml(Path(path))
        sources = {key: f"{path}:{line}" for key, line in lines.items()}
        _check_keys(cls, cls, given, sources, prefix="")
        _merge(cls, data, given)
    for item in overrides:
        keys, value = _parse_override(cls, item)
        _set_path(data, keys, value, where=f"override {item!r}")
        key = ".".join(keys)
        sources[key] = f"command-line override {item!r}"
    for key, (value, where) in (values or {}).items():
        _set_path(data, key.split("."), value, where=where)
        sources[key] = where
    try:
        return pydantic.TypeAdapter(cls).validate_python(data)
    except pydantic.ValidationError as exc:
        raise ConfigError(_describe(exc, sources, path)) from None


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """Mapping from the file, and the 1-based line of every (dotted) key in it."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections; got {type(data).__name__}")
    lines: dict[str, int] = {}

    def walk(n: yaml.Node, prefix: str) -> None:
        if isinstance(n, yaml.MappingNode):
            for key_node, value_node in n.value:
                key = f"{prefix}{key_node.value}"
                lines[key] = key_node.start_mark.line + 1
                walk(value_node, key + ".")

    walk(node, "")
    return data, lines


def fields_of(cls: type) -> dict[str, Any]:
    """Field name -> resolved type annotation of a dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unknown(root: type, key: str, known: Sequence[str], where: str, cls: type | None = None) -> ConfigError:
    """The error for an unknown key, suggesting a close name at this level or the same name in another section.

    A key the dataclass `cls` lists in its RENAMED_KEYS ({old name: new name}) gets the new name instead, and one
    it lists in its REPLACED_KEYS ({old name: what to do instead}) that text.
    """
    leaf = key.rsplit(".", 1)[-1]
    replaced = getattr(cls, "REPLACED_KEYS", {}).get(leaf)
    if replaced is not None:
        return ConfigError(f"{where}: {key!r} is gone: {replaced}")
    renamed = getattr(cls, "RENAMED_KEYS", {}).get(leaf)
    if renamed is not None:
        new = key.rsplit(".", 1)[0] + "." + renamed if "." in key else renamed
        return ConfigError(f"{where}: {key!r} was renamed to {new!r}; use that key instead")
    close = difflib.get_close_matches(leaf, known, n=1)
    elsewhere = [path for path in _dotted_keys(root) if path.rsplit(".", 1)[-1] == leaf]
    guess = elsewhere or close  # the same name in another section is the likelier intent
    hint = f" (did you mean {guess[0]!r}?)" if guess else ""
    return ConfigError(f"{where}: unknown key {key!r}{hint}; allowed here: {', '.join(known)}")


def _dotted_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for name, annotation in fields_of(cls).items():
        keys.append(prefix + name)
        if dataclasses.is_dataclass(annotation):
            keys += _dotted_keys(annotation, f"{prefix}{name}.")
    return keys


def _check_keys(root: type, cls: type, data: dict[str, Any], sources: dict[str, str], prefix: str) -> None:
    fields = fields_of(cls)
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            raise _unknown(root, dotted, list(fields), sources.get(dotted, "config"), cls)
        if dataclasses.is_dataclass(fields[key]) and isinstance(value, dict):
            _check_keys(root, fields[key], value, sources, dotted + ".")


def _merge(cls: type, base: dict[str, Any], given: dict[str, Any]) -> None:
    """Write `given` into `base` key by key, descending into sections (an empty section changes nothing).

    A field that is not a dataclass (a list, a dict such as eval.k_per_benchmark) is replaced whole.
    """
    fields = fields_of(cls)
    for key, value in given.items():
        section = fields[key]
        if dataclasses.is_dataclass(section) and isinstance(base.get(key), dict):
            if value is None:
                continue
            if isinstance(value, dict):
                _merge(section, base[key], value)
                continue
        base[key] = value  # a wrong type (a number for a section) is left for validation to report


def _parse_override(cls: type, item: str) -> tuple[list[str], Any]:
    """`section.key=value` -> (path of keys, value converted by the field's type).

    Below a mapping field (`dict[str, X]`) the rest of the dotted key is one entry's key, dots and all:
    `openrlhf.vllm.num_engines=8` sets the entry "vllm.num_engines" of the field `openrlhf`.
    """
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    target: Any = cls
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if get_origin(target) is dict and depth < len(parts):
            entry = ".".join(parts[depth:])
            return [*parts[:depth], entry], _convert(raw, get_args(target)[1])
        if not (isinstance(target, type) and dataclasses.is_dataclass(target)):
            raise ConfigError(f"override {item!r}: {'.'.join(parts[:depth])} has no sub-keys")
        fields = fields_of(target)
        if part not in fields:
            raise _unknown(cls, ".".join(parts[: depth + 1]), list(fields), f"override {item!r}", target)
        target = fields[part]
    if dataclasses.is_dataclass(target):
        raise ConfigError(f"override {item!r}: {key} is a section; set one of its keys, e.g. {key}.<key>=...")
    return parts, _convert(raw, target)


def _convert(raw: str, annotation: Any) -> Any:
    """Text from the command line -> a value for a field of this type (pydantic then checks it)."""
    try:
        parsed = yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        parsed = raw
    if (
        _admits_str(annotation)
        and not isinstance(parsed, (dict, list))
        and not (parsed is None and _admits_none(annotation))
    ):
        return raw  # "123" stays a name, "1e-3" stays text, for str-typed fields
    return parsed


def _members(annotation: Any) -> tuple[Any, ...]:
    origin = get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        return get_args(annotation)
    return (annotation,)


def _admits_str(annotation: Any) -> bool:
    for member in _members(annotation):
        if member is str or (get_origin(member) is Literal and all(isinstance(a, str) for a in get_args(member))):
            return True
    return False


def _admits_none(annotation: Any) -> bool:
    return type(None) in _members(annotation)


def _set_path(data: dict[str, Any], path: Sequence[str], value: Any, where: str) -> None:
    *parents, leaf = path
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{where}: {part} is set to a value, not a section, in the config file")
        node = child
    node[leaf] = value


def _describe(exc: pydantic.ValidationError, sources: dict[str, str], path: str | Path | None) -> str:
    """One line per wrong key: where it came from, the key, what is allowed, what was given."""
    lines, seen = [], set()
    for err in exc.errors():
        # Drop pydantic's union-member tags ("literal['O1',...]") and "[key]" markers from the location.
        parts = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or "(" in p))]
        key = ".".join(parts)
        if key in seen:
            continue
        seen.add(key)
        if err["type"] == "value_error":  # a whole-section check (__post_init__): cite what set keys in it
            inside = [src for k, src in sources.items() if not key or k.startswith(key + ".")]
            where = ", ".join(sorted(set(inside))) or sources.get(key) or (str(path) if path else "defaults")
        else:
            where = sources.get(key, str(path) if path else "defaults")
        message = err["msg"].removeprefix("Value error, ")
        given = "" if err["type"] == "value_error" else f" (got {err['input']!r})"
        lines.append(f"{where}: {key or '<root>'}: {message}{given}")
    if len(lines) == 1:
        return f"invalid config: {lines[0]}"
    return "invalid config:\n  " + "\n  ".join(lines)
