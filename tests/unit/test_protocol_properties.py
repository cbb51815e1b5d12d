"""Property tests over every message type (the delivery messages included): any valid message
round-trips, and any header field given a value of the wrong type is refused with a
`ProtocolError` that names that field, never another exception."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wire_cases import builds

from asyncrl.protocol.codec import decode, encode
from asyncrl.protocol.messages import MESSAGE_TYPES, BatchAck, Hello, ProtocolError, Welcome

PROPS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WRONG = {  # a value of each msgpack kind, and the kinds it stands in for
    "int": 7,
    "str": "x",
    "float": 0.5,
    "bool": True,
    "list": [1, "a"],
    "map": {"k": 1},
    "bytes": b"\x00",
    "nil": None,
}


def kind_of(value: Any) -> str:
    for name, sample in WRONG.items():
        if type(value) is type(sample):
            return name
    return "other"


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.TYPE)
def test_a_field_of_the_wrong_type_is_refused_naming_it(cls: type) -> None:
    @PROPS
    @given(builds(cls), st.data())
    def check(msg: Any, data: st.DataObject) -> None:
        frames = [bytes(memoryview(f)) for f in encode(msg)]
        header = msgpack.unpackb(frames[0])
        fields = sorted(k for k in header if k not in ("type", "protocol"))
        if not fields:
            return
        key = data.draw(st.sampled_from(fields))
        current = kind_of(header[key])
        if current == "nil":
            return  # an optional field left empty: any value might be allowed
        wrong = data.draw(st.sampled_from([k for k in WRONG if k != current]))
        if {current, wrong} <= {"int", "float"} or {current, wrong} == {"int", "bool"}:
            return  # numbers may widen; a bool is no int here, but is checked elsewhere
        header[key] = WRONG[wrong]
        try:
            decoded = decode([msgpack.packb(header), *frames[1:]])
        except ProtocolError as exc:
            assert exc.field.split(".")[0].split("[")[0] == key, (key, wrong, exc.field)
        else:
            assert type(decoded) is cls  # accepted: still a well-formed message of its type

    check()


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.TYPE)
def test_truncated_or_extended_frames_raise_only_protocol_errors(cls: type) -> None:
    @PROPS
    @given(builds(cls), st.data())
    def check(msg: Any, data: st.DataObject) -> None:
        frames = [bytes(memoryview(f)) for f in encode(msg)]
        i = data.draw(st.integers(0, len(frames) - 1))
        cut = data.draw(st.integers(0, max(0, len(frames[i]) - 1)))
        tail = data.draw(st.binary(max_size=8))
        frames[i] = frames[i][:cut] + tail
        try:
            decode(frames)
        except ProtocolError as exc:
            assert exc.field

    check()


@given(st.integers(0, 2**62), st.integers(0, 2**62), st.booleans())
def test_delivery_fields_round_trip(request_id: int, seq: int, acks: bool) -> None:
    assert decode(encode(BatchAck(request_id=request_id))) == BatchAck(request_id=request_id)
    welcome = Welcome(
        client_id="a", policy_version=1, heartbeat_interval_s=1.0, max_staleness=2, next_seq=seq
    )
    assert decode(encode(welcome)) == welcome
    hello = Hello(
        role="actor",
        client_id="a",
        protocol_version=1,
        config_hash="h",
        session=seq,
        acks_batches=acks,
    )
    assert decode(encode(hello)) == hello
