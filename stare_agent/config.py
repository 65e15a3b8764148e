"""Configs: dataclasses, YAML files, `section.key=value` overrides, validation.

Each command has a root dataclass. A value comes from, in order of precedence: a command-line
override, the YAML file, the field's default (the only place a default is written). Types are
checked and converted by pydantic against the dataclass annotations, and each dataclass's
`__post_init__` checks ranges; every error names the key, the allowed values and where the value
came from (file:line or the override).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import difflib
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import pydantic
import yaml

from stare_agent.stare import StareConfig

__all__ = [
    "ConfigError",
    "RunConfig",
    "SimulateConfig",
    "StareConfig",
    "ToyTaskConfig",
    "load_config",
    "make_run_dir",
    "save_config",
    "to_dict",
]

C = TypeVar("C")


class ConfigError(ValueError):
    """A config file or override is wrong; the message says which key, what is allowed and where."""


@dataclass
class RunConfig:
    """Where a run writes and how it is seeded."""

    output_dir: str = "runs"
    """Parent folder of run directories."""
    name: str = ""
    """Run directory name under output_dir; empty means '<command>-<UTC timestamp>'."""
    seed: int = 0
    """Seed for every random number generator the run uses."""


@dataclass
class ToyTaskConfig:
    """The STARE dynamics toy: independent softmax positions with a verifiable reward.

    Each prompt has `length` positions, each a free softmax over `vocab` tokens (a tabular
    policy). At every position `valid_tokens` of the tokens are correct; a response earns
    reward 1 iff at most `max_wrong` of its positions hold a wrong token.
    """

    vocab: int = 16
    """Tokens per position."""
    length: int = 64
    """Positions per response (the response length)."""
    prompts: int = 64
    """Distinct prompts, each with its own logits."""
    valid_tokens: int = 4
    """Correct tokens at each position; more than one leaves room for diversity the reward does not need."""
    max_wrong: int = 0
    """A response is correct iff at most this many positions hold a wrong token."""
    init_std: float = 1.0
    """Std of the initial logits."""
    valid_bias: float = 5.5
    """Added to the initial logits of valid tokens, so the first policy already succeeds sometimes."""
    steps: int = 400
    """Optimizer steps per run."""
    batch_prompts: int = 16
    """Prompts per step."""
    group_size: int = 8
    """Responses sampled per prompt (the GRPO group)."""
    lr: float = 4000.0
    """SGD step on the logits; the loss is a token-level mean, so this is per-token step x tokens per batch."""

    def __post_init__(self) -> None:
        for name in ("vocab", "length", "prompts", "steps", "batch_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 for group-normalized advantages; got {self.group_size}")
        if not 1 <= self.valid_tokens < self.vocab:
            raise ValueError(f"valid_tokens must be in [1, vocab); got {self.valid_tokens} with vocab={self.vocab}")
        if not 0 <= self.max_wrong < self.length:
            raise ValueError(f"max_wrong must be in [0, length); got {self.max_wrong} with length={self.length}")
        if self.batch_prompts > self.prompts:
            raise ValueError(f"batch_prompts must be <= prompts={self.prompts}; got {self.batch_prompts}")
        if not (self.lr > 0 and self.init_std >= 0):
            raise ValueError(f"lr must be > 0 and init_std >= 0; got lr={self.lr}, init_std={self.init_std}")


@dataclass
class SimulateConfig:
    """`stare-agent simulate`: GRPO vs STARE on the toy task, entropy over steps."""

    run: RunConfig = field(default_factory=RunConfig)
    toy: ToyTaskConfig = field(default_factory=ToyTaskConfig)
    stare: StareConfig = field(default_factory=StareConfig)
    """Base STARE settings; the sweeps below vary w and the gate on top of them."""
    open_loop_w: list[float] = field(default_factory=lambda: [1.01, 1.05, 1.1, 1.5, 2.0, 4.0])
    """W values for op O1 with the gate off."""
    gated_w: list[float] = field(default_factory=lambda: [1.05, 1.1, 1.5, 2.0, 4.0])
    """W values for op O1 with stare.gate (batch unless set) at stare.target_entropy."""

    def __post_init__(self) -> None:
        bad = [w for w in [*self.open_loop_w, *self.gated_w] if w < 1.0]
        if bad:
            raise ValueError(f"open_loop_w and gated_w values must be >= 1; got {bad}")


# ----------------------------------------------------------------------------------------------
# loading


def load_config(cls: type[C], path: str | Path | None = None, overrides: Sequence[str] = ()) -> C:
    """Build a `cls` from defaults, an optional YAML file and `a.b=c` overrides, validated."""
    data: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if path is not None:
        data, lines = _read_yaml(Path(path))
        sources = {key: f"{path}:{line}" for key, line in lines.items()}
        _check_keys(cls, data, sources, prefix="")
    for item in overrides:
        key, value = _parse_override(cls, item)
        _set_path(data, key, value, where=f"override {item!r}")
        sources[key] = f"command-line override {item!r}"
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


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unknown(key: str, known: Sequence[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{where}: unknown key {key!r}{hint}; allowed here: {', '.join(known)}")


def _check_keys(cls: type, data: dict[str, Any], sources: dict[str, str], prefix: str) -> None:
    fields = _fields(cls)
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            raise _unknown(dotted, list(fields), sources.get(dotted, "config"))
        if dataclasses.is_dataclass(fields[key]) and isinstance(value, dict):
            _check_keys(fields[key], value, sources, dotted + ".")


def _parse_override(cls: type, item: str) -> tuple[str, Any]:
    """`section.key=value` -> (dotted key, value converted by the field's type)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    target: Any = cls
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if not (isinstance(target, type) and dataclasses.is_dataclass(target)):
            raise ConfigError(f"override {item!r}: {'.'.join(parts[:depth])} has no sub-keys")
        fields = _fields(target)
        if part not in fields:
            raise _unknown(".".join(parts[: depth + 1]), list(fields), f"override {item!r}")
        target = fields[part]
    if dataclasses.is_dataclass(target):
        raise ConfigError(f"override {item!r}: {key} is a section; set one of its keys, e.g. {key}.<key>=...")
    return key, _convert(raw, target)


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


def _set_path(data: dict[str, Any], key: str, value: Any, where: str) -> None:
    *parents, leaf = key.split(".")
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
    return "invalid config:\n  " + "\n  ".join(lines)


# ----------------------------------------------------------------------------------------------
# saving


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def save_config(config: Any, run_dir: str | Path) -> Path:
    """Write the resolved config as `config.yaml` in the run directory; it loads back to an equal config."""
    out = Path(run_dir) / "config.yaml"
    out.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    return out


def make_run_dir(run: RunConfig, command: str) -> Path:
    name = run.name or f"{command}-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M%S}"
    path = Path(run.output_dir) / name
    path.mkdir(parents=True, exist_ok=True)
    return path
