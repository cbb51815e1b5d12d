"""Shared by the wire codec's tests: hypothesis strategies for every message, structural
equality, and helpers that encode, edit and expect a refusal."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st

from asyncrl.protocol.codec import SPECS, decode, encode
from asyncrl.protocol.messages import FINISH_REASONS, Group, ProtocolError, Trajectory

FAST = settings(max_examples=40, deadline=None)

# --- strategies ---------------------------------------------------------------------------------

ints = st.integers(-(2**63), 2**63 - 1)
texts = st.text(max_size=12)
floats = st.floats(allow_nan=False, allow_infinity=False)
plain = st.none() | st.booleans() | ints | floats | texts
values = st.recursive(
    plain, lambda c: st.lists(c, max_size=3) | st.dictionaries(texts, c, max_size=3), max_leaves=8
)
maps = st.dictionaries(texts, values, max_size=4)
KIND = {
    "int": ints,
    "float": floats,
    "str": texts,
    "bool": st.booleans(),
    "map": maps,
    "ints": st.lists(ints, max_size=5),
    "floats": st.lists(floats, max_size=5),
    "strs": st.lists(texts, max_size=5),
}


@st.composite
def groups(draw: st.DrawFn) -> Group:
    n = draw(st.integers(1, 4))
    prompt_lens = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    completion = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    trajectories = []
    for plen, clen in zip(prompt_lens, completion, strict=True):
        lo = draw(st.integers(0, 50))
        tokens = draw(
            st.lists(st.integers(0, 2**31 - 1), min_size=plen + clen, max_size=plen + clen)
        )
        mask = draw(st.lists(st.integers(0, 1), min_size=clen, max_size=clen))
        lp = draw(st.lists(st.floats(-50, 0, width=32), min_size=clen, max_size=clen))
        hi = lo + (draw(st.integers(0, 3)) if clen >= 2 else 0)
        spans = (0, lo, draw(st.integers(1, clen - 1)), hi) if hi > lo else ()
        trajectories.append(
            Trajectory(
                tokens=np.array(tokens, np.int32),
                prompt_len=plen,
                loss_mask=np.array(mask, np.uint8),
                behavior_logprobs=np.array(lp, np.float32),
                reward=draw(floats),
                min_policy_version=lo,
                max_policy_version=hi,
                finish_reason=draw(st.sampled_from(FINISH_REASONS)),
                trajectory_id=draw(texts),
                reward_failed=draw(texts),
                version_spans=spans,
            )
        )
    return Group.build(
        group_id=draw(texts),
        prompt_id=draw(texts),
        credit_id=draw(ints),
        actor_id=draw(texts),
        seq=draw(ints),
        trajectories=trajectories,
        metadata=draw(maps),
        timings=draw(st.dictionaries(texts, floats, max_size=3)),
        reward_components=draw(
            st.dictionaries(texts, st.lists(floats, min_size=n, max_size=n), max_size=3)
        ),
    )


def builds(cls: type) -> st.SearchStrategy[Any]:
    if cls is Group:
        return groups()
    fields: dict[str, Any] = {}
    for spec in SPECS[cls]:
        if spec.kind == "msgs":
            fields[spec.name] = st.lists(builds(spec.nested), max_size=2).map(tuple)
        elif spec.kind == "array":  # Scores: one float32 per sample
            one = st.floats(width=32, allow_nan=False, allow_infinity=False)
            fields[spec.name] = st.lists(one, max_size=6).map(lambda v: np.array(v, np.float32))
        else:
            fields[spec.name] = KIND[spec.kind]
    return st.builds(cls, **fields)


def same(a: Any, b: Any) -> bool:
    """Structural equality that compares arrays by dtype, shape and contents."""
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.array_equal(a, b)
        )
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(
            same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return type(a) is type(b) and a == b


def wire(msg: Any) -> list[bytes]:
    """Encode and copy every frame to bytes, as the receiving socket would see it."""
    return [bytes(memoryview(f)) for f in encode(msg)]


def header(msg: Any) -> dict[str, Any]:
    return msgpack.unpackb(wire(msg)[0])


def edited(msg: Any, **changes: Any) -> list[bytes]:
    frames = wire(msg)
    h = msgpack.unpackb(frames[0])
    h.update(changes)
    return [msgpack.packb(h), *frames[1:]]


def rejected(frames: list[Any], limit: int = 2**30) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(frames, limit)
    return info.value
