"""Engine options: each field of the engine's config (engine/config.py) declares how the command
line sets it (`option(...)`) or why nothing does (`not_an_option(...)`), and the `strata`
commands' options are built from those declarations: `add_options`, `config_from_args`, and
`argv_from_args` for a process that parses them again. Imports neither argparse nor the engine.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

_KEY = "strata.option"
_VALUES = (int, float, str)

T = TypeVar("T")


@dataclass(frozen=True)
class InUnits:
    """An integer field set in a larger unit: `--kv-cache-gb 0.5` sets 1 << 29 bytes. Values
    round down, to no less than `at_least`."""

    size: int
    at_least: int = 0

    def to_field(self, value: float) -> int:
        return max(self.at_least, int(value * self.size))

    def to_cli(self, value: int) -> float:
        return value / self.size


GIB = InUnits(1 << 30)


@dataclass(frozen=True)
class Option:
    """A field's command-line option: its flag, its help, and for a str field the values it
    takes (an enum field takes its members' values)."""

    flag: str
    help: str
    choices: tuple[str, ...] | None = None
    unit: InUnits | None = None

    @property
    def dest(self) -> str:
        """The attribute of the parsed arguments that holds it: `--kv-cache-gb` -> kv_cache_gb."""
        return self.flag.removeprefix("--").replace("-", "_")


@dataclass(frozen=True)
class NotAnOption:
    """A field no command line sets directly, and why."""

    reason: str


def option(
    default: Any,
    flag: str,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    unit: InUnits | None = None,
) -> Any:
    """A config field with its default, set by `flag` and described by `help`:
    `block_size: int = option(16, "--block-size", "tokens per KV block")`. The field's type
    gives the option's kind: an int, float or str takes a value (a None default leaves it
    unset), an enum one of its values, a bool is a switch that turns the default around
    (`--enforce-eager`, `--no-prefix-caching`); `unit` sets an int in a larger unit."""
    return dataclasses.field(default=default, metadata={_KEY: Option(flag, help, choices, unit)})


def not_an_option(default: Any, reason: str) -> Any:
    """A config field with its default that no option sets, for `reason`."""
    return dataclasses.field(default=default, metadata={_KEY: NotAnOption(reason)})


def declaration(f: dataclasses.Field[Any]) -> Option | NotAnOption | None:
    """What a config field declares: its option, why it has none, or (None) nothing."""
    declared = f.metadata.get(_KEY)
    return declared if isinstance(declared, Option | NotAnOption) else None


@dataclass(frozen=True)
class FieldOption:
    """One leaf field's option, resolved: where the field is (`cache.block_size`), its kind
    (int, float, str, bool or an enum class) and default, and the conversions between the
    field's values and the command line's."""

    path: str
    option: Option
    kind: type
    default: Any

    @property
    def dest(self) -> str:
        return self.option.dest

    @property
    def is_switch(self) -> bool:
        return self.kind is bool

    @property
    def cli_default(self) -> Any:
        return False if self.is_switch else self.to_cli(self.default)

    def to_cli(self, value: Any) -> Any:
        """A field value as the parsed arguments hold it (not for switches)."""
        if value is None:
            return None
        if self.option.unit is not None:
            return self.option.unit.to_cli(value)
        return value.value if isinstance(value, enum.Enum) else value

    def to_field(self, value: Any) -> Any:
        """A parsed value as the field holds it; a switch's value says whether it was given."""
        if self.is_switch:
            return not self.default if value else self.default
        if value is None:
            return None
        if self.option.unit is not None:
            return self.option.unit.to_field(value)
        return self.kind(value) if issubclass(self.kind, enum.Enum) else value

    def choices(self) -> list[str] | None:
        if issubclass(self.kind, enum.Enum):
            return [member.value for member in self.kind]
        return None if self.option.choices is None else list(self.option.choices)


def leaf_fields(root: type) -> Iterator[tuple[str, dataclasses.Field[Any], Any]]:
    """Every field of a config dataclass that is not itself a config dataclass, depth first
    in declaration order: (path, field, resolved type)."""
    hints = typing.get_type_hints(root)
    for f in dataclasses.fields(root):
        kind = hints[f.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            for path, sub, sub_kind in leaf_fields(kind):
                yield f"{f.name}.{path}", sub, sub_kind
        else:
            yield f.name, f, kind


def options_of(root: type) -> tuple[FieldOption, ...]:
    """The options of a config tree; TypeError names a field that declares neither an option
    nor why it has none, or whose type no option can set."""
    out = []
    for path, f, hint in leaf_fields(root):
        declared = declaration(f)
        if isinstance(declared, NotAnOption):
            continue
        where = f"{root.__name__}.{path}"
        if not isinstance(declared, Option):
            raise TypeError(f"{where}: declare option(...) or not_an_option(...) in its metadata")
        if f.default is dataclasses.MISSING:
            raise TypeError(f"{where}: an option's field needs a default")
        out.append(FieldOption(path, declared, _kind(hint, where), f.default))
    flags = [o.option.flag for o in out]
    if len(set(flags)) < len(flags):
        raise TypeError(f"{root.__name__}: an option flag is declared twice: {flags}")
    return tuple(out)


def _kind(hint: Any, where: str) -> type:
    """The kind of value a field takes, None aside: `int | None` -> int."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else None
    if hint is bool or hint in _VALUES or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return typing.cast(type, hint)
    raise TypeError(f"{where}: no command-line option takes a {hint!r}")


class ArgumentAdder(Protocol):
    """An argparse parser or argument group."""

    def add_argument(self, *name_or_flags: str, **kwargs: Any) -> Any: ...


def add_options(group: ArgumentAdder, root: type) -> None:
    """Declare every option of the config tree `root` on `group`."""
    for o in options_of(root):
        if o.is_switch:
            group.add_argument(o.option.flag, dest=o.dest, action="store_true", help=o.option.help)
            continue
        choices = o.choices()
        kind = float if o.option.unit is not None else str if choices else o.kind
        group.add_argument(
            o.option.flag,
            dest=o.dest,
            type=kind,
            default=o.cli_default,
            choices=choices,
            help=o.option.help,
        )


def config_from_args(root: type[T], args: object, defaults: Mapping[str, Any] | None = None) -> T:
    """`root` built from parsed arguments (one attribute per option, as `add_options` named
    it). `defaults`, by field path: the values of what the command line leaves unset, fields
    that are not options and options left at None."""
    values = {o.path: o.to_field(getattr(args, o.dest)) for o in options_of(root)}
    for path, value in (defaults or {}).items():
        if values.get(path) is None:
            values[path] = value
    config = _build(root, values, "")
    if values:
        raise KeyError(f"{root.__name__} has no fields {sorted(values)}")
    return typing.cast(T, config)


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    """`cls` from `values` by field path, taking out the ones it uses; nested configs first."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        path, kind = prefix + f.name, hints[f.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            kwargs[f.name] = _build(kind, values, f"{path}.")
        elif path in values:
            kwargs[f.name] = values.pop(path)
    return cls(**kwargs)


def argv_from_args(root: type, args: object) -> list[str]:
    """The options of `root` in parsed arguments that differ from their defaults, as command
    line arguments that parse back to the same values."""
    argv = []
    for o in options_of(root):
        value = getattr(args, o.dest)
        if value == o.cli_default:
            continue
        argv.append(o.option.flag if o.is_switch else f"{o.option.flag}={value}")
    return argv
