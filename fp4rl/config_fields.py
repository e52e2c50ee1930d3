"""Validated dataclass fields: the rules every config section follows.

A section is a dataclass deriving from `_Section` whose fields come from `_knob(default, doc, **rules)`:
a one-line doc and its rules in the field's metadata ("choices", "ge", "gt", "le", "lt", and "inf" for a
knob where inf means no limit). On construction `validate_fields` checks each value against its type hint
(ints widen to float where a float is expected; lists and tables are checked item by item) and its rules,
and raises `ConfigError` naming the key and what is allowed; then the section's `check()` applies its
cross-field rules. Sections and loading: fp4rl.config.
"""

from __future__ import annotations

import math
import operator
import types
import typing
from dataclasses import dataclass, field, fields
from typing import ClassVar


class ConfigError(ValueError):
    """A config key is unknown or its value is invalid; the message names the key."""


_RULES = (
    ("ge", operator.ge, ">="),
    ("gt", operator.gt, ">"),
    ("le", operator.le, "<="),
    ("lt", operator.lt, "<"),
)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check_type(key: str, value, tp):
    """Return value (ints widened to float where a float is expected) or raise ConfigError."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check_type(key, value, inner)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} = {value!r}: expected a list of {_type_name(args[0])}")
        return [_check_type(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} = {value!r}: expected a table, e.g. {{name = value}}")
        return dict(value)
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, tp)
    if not ok:
        raise ConfigError(f"{key} = {value!r}: expected {_type_name(tp)}")
    return value


def validate_fields(obj, section: str) -> None:
    """Check every field of dataclass `obj` against its type and metadata rules (in place)."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        key = f"{section}.{f.name}"
        value = _check_type(key, getattr(obj, f.name), hints[f.name])
        object.__setattr__(obj, f.name, value)
        meta = f.metadata
        if "choices" in meta and value not in meta["choices"]:
            allowed = ", ".join(repr(c) for c in meta["choices"])
            raise ConfigError(f"{key} = {value!r}: allowed values are {allowed}")
        items = value if isinstance(value, list) else [value]
        inf_ok = meta.get("inf", False)  # a knob where inf means "no limit"
        if any(isinstance(v, float) and (math.isnan(v) or math.isinf(v) and not inf_ok) for v in items):
            raise ConfigError(f"{key} = {value!r}: must be a finite number")
        for rule, op, text in _RULES:
            if rule in meta and value is not None:
                items = value if isinstance(value, list) else [value]
                if (
                    isinstance(value, float)
                    and math.isnan(value)
                    or not all(op(v, meta[rule]) for v in items)
                ):
                    raise ConfigError(f"{key} = {value!r}: must be {text} {meta[rule]}")


def _knob(default, doc: str, **rules):
    """A field with a one-line doc and validation rules; mutable defaults are copied."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc, **rules})
    return field(default=default, metadata={"doc": doc, **rules})


@dataclass
class _Section:
    SECTION: ClassVar[str] = ""

    def __post_init__(self):
        validate_fields(self, self.SECTION)
        self.check()

    def check(self) -> None:
        """Cross-field rules of the section (overridden where needed)."""
