"""Config knobs declared once: a component's settings dataclass names the config field each of its fields comes
from, and that field's rule; the default and the comment are the config file's (``config/schema.py``).

    @dataclasses.dataclass(frozen=True)
    class UpdateConfig:
        clip_c: float = knobs.knob("actor.clip_c", algos.DUAL_CLIP)   # default 3.0 from the schema, rule "> 1"
        b1: float = 0.9                                                # not a config field: a plain default

        def __post_init__(self):
            knobs.validate(self)

``from_config(UpdateConfig, cfg, temperature=...)`` builds it from an experiment config by those names;
``problems(cls, flat)`` is what the config loader (``arpo_jax.assemble.validate``) reports for the same rules, named
by config field, so a launch still lists every mistake at once. Adding a knob: a line in schema.py and a ``knob``
field where it is used.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Rule:
    """What a value must satisfy: ``ok(value)``, described for messages as ``allowed``."""

    ok: Callable[[Any], bool]
    allowed: str
    problem: str = "is out of range"  # said after the value: "1.0 is out of range (allowed: > 1)"
    values: tuple = ()  # an enum's allowed values (``one_of``)

    def message(self, value: Any) -> str:
        """The problem text: "<value> <problem> (allowed: <allowed>)"."""
        return f"{value!r} {self.problem} (allowed: {self.allowed})"

    def enforce(self, name: str, value: Any) -> None:
        """Raises ValueError("<name>=<value> <problem> (allowed: ...)") when `value` fails."""
        if not self.ok(value):
            raise ValueError(f"{name}={self.message(value)}")


def fmt(values: Sequence) -> str:
    return " | ".join(repr(v) if v == "" else str(v) for v in values)


def one_of(values: Sequence) -> Rule:
    """The value must be one of `values` (an enum's tuple, owned by the module that acts on it)."""
    values = tuple(values)
    return Rule(lambda v: v in values, fmt(values), "is not a known value", values)


def at_least(low: float, allowed: str | None = None) -> Rule:
    return Rule(lambda v: v >= low, allowed or f">= {low}")


POSITIVE = Rule(lambda v: v > 0, "> 0")
NONNEG = Rule(lambda v: v >= 0, ">= 0")
UNIT = Rule(lambda v: 0 <= v <= 1, "0 <= x <= 1")


@functools.cache
def _base() -> dict[str, Any]:
    from arpo_jax.config import schema  # ml_collections only: no cycle

    return schema.get_config().to_dict()


def _at(tree, path: str) -> Any:
    """The value at dotted `path` of a config or dict (a missing part raises KeyError naming it); lists as tuples."""
    for part in path.split("."):
        tree = tree[part]
    return tuple(tree) if isinstance(tree, list) else tree


def default(path: str) -> Any:
    """The config file's default of `path` ("actor.clip_c")."""
    return _at(_base(), path)


def knob(path: str, rule: Rule | None = None) -> Any:
    """A dataclass field read from config field `path`, with its default from the schema and an optional `rule`."""
    return dataclasses.field(default=default(path), metadata={"path": path, "rule": rule})


def knob_fields(cls) -> list[tuple[str, str, Rule | None]]:
    """(field name, config path, rule) of each knob field of dataclass `cls`."""
    return [(f.name, f.metadata["path"], f.metadata["rule"]) for f in dataclasses.fields(cls) if "path" in f.metadata]


def validate(obj) -> None:
    """Raises one ValueError naming every field of `obj` that breaks its rule (`__post_init__` calls this)."""
    name = type(obj).__name__
    bad = [f"{name}.{field}={rule.message(getattr(obj, field))}"
           for field, _, rule in knob_fields(type(obj)) if rule is not None and not rule.ok(getattr(obj, field))]
    if bad:
        raise ValueError("; ".join(bad))


def problems(cls, flat: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(config path, "<value> <problem> (allowed: ...)") for each knob of `cls` whose value in `flat` (the config
    as {"a.b": value}) breaks its rule; fields absent from `flat` or None (already reported) are skipped."""
    out = []
    for _, path, rule in knob_fields(cls):
        value = flat.get(path)
        if rule is not None and value is not None and not rule.ok(value):
            out.append((path, rule.message(value)))
    return out


def from_config(cls, cfg, **overrides):
    """`cls` built from the experiment config `cfg`: each knob field from its config path, `overrides` by field
    name (for values the config does not hold as such: a resolved mode, a seed); other fields keep their defaults."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {', '.join(unknown)}")
    values = {field: _at(cfg, path) for field, path, _ in knob_fields(cls) if field not in overrides}
    return cls(**values, **overrides)
