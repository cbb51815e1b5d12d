"""A packed Batch (asyncrl/protocol/codec.py) decodes exactly as the unpacked one, arrays aligned;
the hub's threshold decides; a packed message that does not add up is refused naming `packed`."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from wire_cases import FAST, groups, rejected, same

from asyncrl.protocol.codec import ALIGN, decode, encode
from asyncrl.protocol.messages import Batch, Group, Trajectory, Version


def batch_of(gs: list[Group]) -> Batch:
    return Batch(request_id=3, policy_version=1, groups=tuple(gs), dropped_stale=2, wait_s=0.5)


def a_group(length: int, prompt: int = 3) -> Group:
    """A valid group of two trajectories whose arrays have odd byte lengths."""
    rng = np.random.default_rng(length)
    trajs = [
        Trajectory(
            tokens=rng.integers(0, 100, length, dtype=np.int32),
            prompt_len=prompt,
            loss_mask=np.ones(length - prompt, np.uint8),
            behavior_logprobs=-rng.random(length - prompt, dtype=np.float32),
            reward=1.0,
            min_policy_version=0,
            max_policy_version=0,
            finish_reason="stop",
        )
        for _ in range(2)
    ]
    return Group.build(
        group_id="g", prompt_id="p", credit_id=1, actor_id="a", seq=length, trajectories=trajs
    )


def flat(frames: list[Any]) -> list[bytes]:
    return [bytes(memoryview(f)) for f in frames]


@FAST
@given(st.lists(groups(), min_size=1, max_size=5), st.booleans())
def test_a_packed_batch_decodes_as_the_unpacked_one(gs: list[Group], values: bool) -> None:
    batch = batch_of(gs)
    plain, packed = encode(batch), encode(batch, pack_below=1 << 30)
    assert len(packed) == 2 and len(plain) == 1 + 4 * len(gs)
    header = msgpack.unpackb(packed[0])
    assert header["packed"] == [memoryview(f).nbytes for f in plain[1:]]
    one = decode(flat(plain), check_values=values)
    other = decode(flat(packed), check_values=values)
    assert same(one, other) and same(other, batch)
    base = np.frombuffer(memoryview(packed[1]), np.uint8).ctypes.data
    for g in other.groups:  # every array starts on an aligned offset of the one frame
        for arr in (g.tokens, g.loss_mask, g.behavior_logprobs):
            assert (arr.ctypes.data - base) % ALIGN == 0 or arr.size == 0


def test_the_threshold_is_the_mean_frame_size() -> None:
    batch = batch_of([a_group(n) for n in (5, 17, 40)])
    plain = encode(batch)
    mean = sum(memoryview(f).nbytes for f in plain[1:]) / (len(plain) - 1)
    assert len(encode(batch, pack_below=int(mean) + 1)) == 2
    assert len(encode(batch, pack_below=int(mean))) == len(plain)
    assert len(encode(batch, pack_below=0)) == len(plain)
    version = Version(policy_version=1)  # only a Batch is ever packed
    assert encode(version, pack_below=1 << 30) == encode(version)


def packed_frames() -> tuple[dict[str, Any], list[bytes]]:
    frames = flat(encode(batch_of([a_group(6), a_group(9)]), pack_below=1 << 30))
    return msgpack.unpackb(frames[0]), frames


def with_packed(value: Any, body: bytes | None = None, extra: list[bytes] = ()) -> list[bytes]:
    header, frames = packed_frames()
    header["packed"] = value
    return [msgpack.packb(header), frames[1] if body is None else body, *extra]


@pytest.mark.parametrize(
    "frames, code",
    [
        (with_packed("4,4"), "bad_message"),
        (with_packed([]), "bad_message"),
        (with_packed([-1, 5]), "bad_message"),
        (with_packed([True, 5]), "bad_message"),
        (with_packed([4, 4], body=b"x" * 9), "truncated"),
        (with_packed(None), "bad_message"),
        (with_packed(packed_frames()[0]["packed"], extra=[b"x"]), "bad_message"),
    ],
    ids=["not-a-list", "empty", "negative", "bool", "too-short", "nil", "two-bodies"],
)
def test_a_packing_that_does_not_add_up_is_refused_naming_it(
    frames: list[bytes], code: str
) -> None:
    err = rejected(frames)
    assert (err.field, err.code) == ("packed", code)


def test_a_body_one_byte_too_long_or_short_is_refused() -> None:
    header, frames = packed_frames()
    for body in (frames[1] + b"\0", frames[1][:-1]):
        err = rejected([frames[0], body])
        assert (err.field, err.code) == ("packed", "truncated")
    decode([frames[0], frames[1]])  # the frames as packed decode


def test_only_a_whole_batch_may_be_packed() -> None:
    version = flat(encode(Version(policy_version=1)))
    header = msgpack.unpackb(version[0])
    err = rejected([msgpack.packb({**header, "packed": [1]}), b"x"])
    assert err.field == "packed"
    g = a_group(7)
    frames = flat(encode(batch_of([g])))
    inner = msgpack.unpackb(frames[1])
    frames[1] = msgpack.packb({**inner, "packed": [1]})  # an embedded group claims packing
    assert rejected(frames).field == "groups[0].packed"
    frames = flat(encode(g))
    frames[0] = msgpack.packb({**msgpack.unpackb(frames[0]), "packed": [1]})
    assert rejected(frames).field == "packed"
