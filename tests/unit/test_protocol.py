"""The wire codec: round trips for every message (hypothesis), golden bytes, and rejections that
name the offending field."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import msgpack
import numpy as np
import pytest
from golden_wire import GOLDEN, GOLDEN_DELIVERY, GOLDEN_MESSAGES, GROUP
from hypothesis import given
from hypothesis import strategies as st
from wire_cases import FAST, builds, edited, header, rejected, same, values, wire

from asyncrl.protocol.codec import decode, encode
from asyncrl.protocol.group_codec import decode_group
from asyncrl.protocol.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Ack,
    Batch,
    Group,
    ProtocolError,
    Version,
    check_hello,
)

# --- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.TYPE)
def test_round_trip(cls: type) -> None:
    @FAST
    @given(builds(cls))
    def check(msg: Any) -> None:
        assert same(decode(wire(msg)), msg)
        assert same(decode(encode(msg)), msg)  # memoryview frames, as sent

    check()


def test_decoded_arrays_are_read_only_views_of_the_frames() -> None:
    group = GOLDEN_MESSAGES[Group.TYPE]
    frames = wire(group)
    out = decode(frames)
    assert not out.tokens.flags.writeable
    assert np.shares_memory(out.tokens, np.frombuffer(frames[1], np.uint8))


def test_unknown_header_keys_are_ignored_and_optional_fields_default() -> None:
    header = msgpack.unpackb(wire(Ack(seq=3, credit_id=5))[0])
    header["added_later"] = [1, 2]
    del header["credit_id"]
    assert decode([msgpack.packb(header)]) == Ack(seq=3)


@FAST
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=4))
def test_arbitrary_bytes_raise_only_protocol_errors(frames: list[bytes]) -> None:
    try:
        decode(frames)
    except ProtocolError:
        pass


@pytest.mark.parametrize(
    "name",
    [
        "StatusRequest",
        "Status",
        "AlarmRaised",
        "Control",
        "EvalRequest",
        "EvalResult",
        "Credits",
        "Group",
    ],
)
def test_a_field_replaced_by_anything_decodes_or_raises_protocol_error(name: str) -> None:
    @FAST
    @given(st.data())
    def check(data: st.DataObject) -> None:
        frames = wire(GOLDEN_MESSAGES[name])
        head = msgpack.unpackb(frames[0])
        key = data.draw(st.sampled_from(sorted(head)))
        head[key] = data.draw(values)
        try:
            msg = decode([msgpack.packb(head), *frames[1:]])
        except ProtocolError:
            return
        assert type(msg) is type(GOLDEN_MESSAGES[name]) or key == "type"

    check()


# --- golden bytes (any change here is a wire-format change: bump PROTOCOL_VERSION) -------------


@pytest.mark.parametrize("msg, golden", GOLDEN_DELIVERY, ids=["Hello", "Welcome"])
def test_golden_bytes_of_delivery_fields(msg: Any, golden: str) -> None:
    assert [frame.hex() for frame in wire(msg)] == [golden]
    assert same(decode([bytes.fromhex(golden)]), msg)


def test_every_message_type_has_golden_bytes() -> None:
    assert set(GOLDEN) == set(GOLDEN_MESSAGES) == {cls.TYPE for cls in MESSAGE_TYPES}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_bytes(name: str) -> None:
    msg = GOLDEN_MESSAGES[name]
    assert [frame.hex() for frame in wire(msg)] == GOLDEN[name]
    assert same(decode([bytes.fromhex(h) for h in GOLDEN[name]]), msg)


# --- rejections name the field ------------------------------------------------------------------


def test_garbage_and_structure() -> None:
    assert rejected([]).field == "frames"
    assert rejected([b"\xc1"]).field == "header"
    assert rejected([msgpack.packb([1])]).field == "header"
    assert rejected(edited(Version(policy_version=1), type="Nope")).field == "type"
    err = rejected(edited(Version(policy_version=1), protocol=PROTOCOL_VERSION + 1))
    assert (err.field, err.code) == ("protocol", "protocol_mismatch")
    assert rejected([*wire(GROUP), b"x"]).field == "frames"
    h = header(Version(policy_version=1))
    del h["policy_version"]
    assert rejected([msgpack.packb(h)]).field == "policy_version"


def test_wrong_scalar_and_list_types() -> None:
    assert rejected(edited(Version(policy_version=1), policy_version="1")).field == "policy_version"
    assert (
        rejected(edited(Version(policy_version=1), policy_version=True)).field == "policy_version"
    )
    assert rejected(edited(GROUP, rewards=["a"])).field == "rewards"
    assert rejected(edited(GROUP, seq_lens=5)).field == "seq_lens"
    assert rejected(edited(GROUP, metadata=[1])).field == "metadata"
    item = header(GOLDEN_MESSAGES["Credits"])["items"][0]
    assert (
        rejected(edited(GOLDEN_MESSAGES["Credits"], items=[{**item, "credit_id": "7"}])).field
        == "items[0].credit_id"
    )


def test_truncated_frames() -> None:
    frames = wire(GROUP)
    err = rejected([*frames[:-1], frames[-1][:-1]])
    assert (err.field, err.code) == ("behavior_logprobs", "truncated")
    assert rejected(frames[:-1]).field == "behavior_logprobs"
    batch = wire(GOLDEN_MESSAGES["Batch"])
    assert rejected([*batch[:-1], batch[-1][:-2]]).field == "groups[0].behavior_logprobs"


def test_wrong_dtype_and_shape() -> None:
    ref = header(GROUP)["tokens"]
    assert rejected(edited(GROUP, tokens={**ref, "dtype": "int64"})).field == "tokens"
    assert rejected(edited(GROUP, tokens={**ref, "shape": [1, 5]})).field == "tokens"
    assert rejected(edited(GROUP, tokens={**ref, "shape": [-5]})).field == "tokens"
    assert rejected(edited(GROUP, tokens={**ref, "frame": 9})).field == "tokens"
    assert rejected(edited(GROUP, loss_mask={**ref, "dtype": "uint8"})).field == "loss_mask"
    assert rejected(edited(GROUP, tokens=[1, 2])).field == "tokens"


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.5])
def test_non_finite_or_positive_logprobs(bad: float) -> None:
    frames = wire(GROUP)
    lp = np.frombuffer(frames[3], np.float32).copy()
    lp[0] = bad
    assert rejected([*frames[:3], lp.tobytes()]).field == "behavior_logprobs"


@pytest.mark.parametrize("length", [5, 40_000])  # below and above group_codec._ARG_BELOW (floats)
@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("tokens", -1),
        ("loss_mask", 2),
        ("behavior_logprobs", math.nan),
        ("behavior_logprobs", -math.inf),
        ("behavior_logprobs", math.inf),
    ],
)
@pytest.mark.parametrize("where", [0, -1])
def test_value_scans_find_a_bad_entry_anywhere_at_any_length(
    length: int, field: str, bad: float, where: int
) -> None:
    """Small arrays are scanned with argmin/argmax, large ones with reductions: both refuse
    the same entries, wherever they sit, and accept the clean group."""
    arrays = {
        "tokens": np.arange(length, dtype=np.int32),
        "loss_mask": np.ones(length - 1, np.uint8),
        "behavior_logprobs": -np.linspace(0.0, 3.0, length - 1, dtype=np.float32),
    }
    group = dataclasses.replace(GROUP, seq_lens=[length], prompt_lens=[1], **arrays)
    assert isinstance(decode(encode(group)), Group)
    bad_array = arrays[field].copy()
    bad_array[where] = bad
    bad_group = dataclasses.replace(group, **{field: bad_array})
    frames = wire(bad_group)
    assert decode_group([memoryview(f) for f in frames], True) is None
    assert rejected(frames).field == field


def test_non_finite_scalars() -> None:
    assert rejected(edited(GROUP, rewards=[math.nan])).field == "rewards"
    assert rejected(edited(GROUP, timings={"t": math.inf})).field == "timings"
    welcome = GOLDEN_MESSAGES["Welcome"]
    assert rejected(edited(welcome, heartbeat_interval_s=math.nan)).field == "heartbeat_interval_s"


def test_group_consistency() -> None:
    assert rejected(edited(GROUP, prompt_lens=[9])).field == "prompt_lens"
    assert rejected(edited(GROUP, rewards=[1.0, 2.0])).field == "rewards"
    assert rejected(edited(GROUP, seq_lens=[4])).field == "tokens"
    assert rejected(edited(GROUP, finish_reasons=["bored"])).field == "finish_reasons"
    assert rejected(edited(GROUP, min_policy_versions=[9])).field == "min_policy_versions"
    frames = wire(GROUP)
    assert rejected([*frames[:2], b"\x02\x00", frames[3]]).field == "loss_mask"
    assert (
        rejected([frames[0], np.array([-1, 0, 0, 0, 0], np.int32).tobytes(), *frames[2:]]).field
        == "tokens"
    )


def test_oversized() -> None:
    frames = wire(GROUP)
    size = sum(map(len, frames))
    err = rejected(frames, limit=size - 1)
    assert (err.field, err.code) == ("message", "too_large")
    assert same(decode(frames, size), GROUP)


def test_check_hello() -> None:
    hello = GOLDEN_MESSAGES["Hello"]
    check_hello(hello, "abcd")
    with pytest.raises(ProtocolError, match="config_hash") as info:
        check_hello(hello, "other")
    assert info.value.code == "config_mismatch"
    old = dataclasses.replace(hello, protocol_version=PROTOCOL_VERSION + 1)
    with pytest.raises(ProtocolError) as info:
        check_hello(old, "abcd")
    assert (info.value.field, info.value.code) == ("protocol_version", "protocol_mismatch")
    with pytest.raises(ProtocolError, match="role"):
        check_hello(dataclasses.replace(hello, role="boss"), "abcd")


def test_received_frames_are_forwarded_without_copies() -> None:
    zmq = pytest.importorskip("zmq")
    received = [zmq.Frame(f) for f in wire(GROUP)]
    batch = Batch(request_id=1, policy_version=0, groups=(decode(received),))
    frames = encode(batch)
    assert all(
        out is got for out, got in zip(frames[1:], received, strict=True)
    )  # the very frames received, the group's header among them
    assert same(decode(wire(batch)), batch)
    partial = np.frombuffer(received[1].buffer[4:], np.int32)  # a view of part of a frame
    assert not isinstance(
        encode(
            dataclasses.replace(
                GROUP,
                tokens=partial,
                seq_lens=[4],
                prompt_lens=[3],
                loss_mask=GROUP.loss_mask[:1],
                behavior_logprobs=GROUP.behavior_logprobs[:1],
            )
        )[1],
        zmq.Frame,
    )
