"""The wire schema of every message, computed once from its dataclass (asyncrl/messages.py):
each field's kind (int, float, str, bool, map, lists, array, nested messages), whether it is
required, its default, and for arrays their dtype and rank. asyncrl/protocol.py encodes and
decodes by these specs."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.messages import MESSAGE_TYPES, CreditItem


@dataclass(frozen=True)
class _Spec:
    name: str
    kind: str  # int float str bool map ints floats strs array msgs
    required: bool
    default: Any
    dtype: str = ""
    ndim: int = 0
    nested: type | None = None
    omit: bool = False  # an appended field left off the wire at its default


_SCALAR_KINDS = {int: "int", float: "float", str: "str", bool: "bool"}
_LIST_KINDS = {int: "ints", float: "floats", str: "strs"}


def _specs_of(cls: type) -> tuple[_Spec, ...]:
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        nested = None
        if hint in _SCALAR_KINDS:
            kind = _SCALAR_KINDS[hint]
        elif hint is np.ndarray:
            kind = "array"
        elif origin is dict:
            kind = "map"
        elif origin is list and args[0] in _LIST_KINDS:
            kind = _LIST_KINDS[args[0]]
        elif origin is tuple and dataclasses.is_dataclass(args[0]):
            kind, nested = "msgs", args[0]
        else:
            raise AssertionError(f"{cls.__name__}.{f.name}: unsupported wire type {hint!r}")
        has_default = (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        )
        required = not has_default or kind == "array"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory
        specs.append(
            _Spec(
                f.name,
                kind,
                required,
                default,
                dtype=f.metadata.get("dtype", ""),
                ndim=f.metadata.get("ndim", 0),
                nested=nested,
                omit=f.metadata.get("omit_default", False),
            )
        )
    return tuple(specs)


SPECS: dict[type, tuple[_Spec, ...]] = {cls: _specs_of(cls) for cls in (*MESSAGE_TYPES, CreditItem)}
BY_NAME: dict[str, type] = {cls.TYPE: cls for cls in MESSAGE_TYPES}
