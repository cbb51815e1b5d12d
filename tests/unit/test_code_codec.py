"""The plain-data codec that carries calls and results between candidate and tests."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.sandbox.code_check import CODEC

codec: dict[str, Any] = {}
exec(CODEC, codec)
encode, decode = codec["encode"], codec["decode"]

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary()
keys = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
hashable = keys | st.tuples(keys, keys) | st.frozensets(keys, max_size=3)
plain = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner)
        | st.tuples(inner, inner)
        | st.dictionaries(hashable, inner)
        | st.sets(hashable)
    ),
    max_leaves=30,
)


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is dict:
        return len(a) == len(b) and all(k in b and _same(v, b[k]) for k, v in a.items())
    return a == b


@settings(max_examples=60, deadline=None)
@given(plain)
def test_round_trip_keeps_values_and_exact_types(value: Any) -> None:
    assert _same(decode(json.loads(json.dumps(encode(value)))), value)


class Sneaky(int):
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = int.__hash__


@pytest.mark.parametrize("value", [Sneaky(1), [Sneaky(2)], object(), {"k": lambda: 0}, 1j])
def test_anything_but_plain_builtins_is_refused(value: Any) -> None:
    with pytest.raises(TypeError):
        encode(value)


@pytest.mark.parametrize(
    "wire", [[1, 2], {"x": 1}, {"i": 5}, {"l": 3}, {"i": "1", "f": "0x1p0"}, 1.5]
)
def test_malformed_wire_values_are_refused(wire: Any) -> None:
    with pytest.raises((ValueError, TypeError)):
        decode(wire)
