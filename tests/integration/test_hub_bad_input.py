"""Bad input against a real hub process: every bad message gets an `Error` naming the field, and
a well-behaved client is served throughout."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hub_cases import WAIT_S, HubProcess, make_group, stats
from wire_checks import dealer, refused, reply

from asyncrl.protocol.codec import decode, encode
from asyncrl.protocol.messages import PROTOCOL_VERSION, CreditItem, Credits, Error, Hello, Welcome
from asyncrl.transport.connection import HubConnection

LIMIT = 64 * 1024  # replay.max_message_bytes of this hub: MAXMSGSIZE per frame, codec per message


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubProcess]:
    overrides = ["replay.max_message_bytes=65536", "learner.groups_per_step=2"]
    proc = HubProcess(tmp_path_factory.mktemp("hub"), overrides)
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def good(hub: HubProcess) -> Iterator[HubConnection]:
    conn = hub.connect("learner", "good-learner")
    yield conn
    conn.close()


@pytest.fixture
def raw(hub: HubProcess) -> Iterator[zmq.Socket]:
    with dealer(hub.endpoint) as sock:
        yield sock


def hello(
    sock: zmq.Socket, hub: HubProcess, role: str = "actor", client_id: str = "raw"
) -> list[CreditItem]:
    sock.send_multipart(
        encode(
            Hello(
                role=role,
                client_id=client_id,
                protocol_version=PROTOCOL_VERSION,
                config_hash=hub.config_hash,
                concurrency=2,
            )
        )
    )
    assert isinstance(reply(sock), Welcome)
    if role != "actor":
        return []
    credits = reply(sock)
    assert isinstance(credits, Credits)
    return list(credits.items)


def header_of(frames: list[Any]) -> dict[str, Any]:
    return msgpack.unpackb(frames[0])


def with_header(frames: list[Any], **changes: Any) -> list[Any]:
    header = header_of(frames)
    header.update(changes)
    return [msgpack.packb(header), *frames[1:]]


def served(good: HubConnection) -> None:
    """The well-behaved client still gets answers."""
    assert stats(good)["policy_version"] == 0


def test_garbage_bytes(raw: zmq.Socket, good: HubConnection) -> None:
    err = refused(raw, [b"\xc1\xff garbage"])
    assert (err.code, err.field) == ("bad_message", "header")
    assert refused(raw, [msgpack.packb([1, 2, 3])]).field == "header"
    served(good)


def test_wrong_protocol_version(raw: zmq.Socket, hub: HubProcess, good: HubConnection) -> None:
    frames = encode(
        Hello(
            role="actor",
            client_id="old",
            protocol_version=PROTOCOL_VERSION,
            config_hash=hub.config_hash,
        )
    )
    err = refused(raw, with_header(frames, protocol=PROTOCOL_VERSION + 1))
    assert (err.code, err.field) == ("protocol_mismatch", "protocol")
    err = refused(raw, with_header(frames, protocol_version=PROTOCOL_VERSION + 1))
    assert (err.code, err.field) == ("protocol_mismatch", "protocol_version")
    err = refused(raw, with_header(frames, config_hash="0" * 16))
    assert (err.code, err.field) == ("config_mismatch", "config_hash")
    err = refused(raw, with_header(frames, concurrency="four"))
    assert err.field == "concurrency"
    served(good)


def test_unregistered_sender(raw: zmq.Socket, good: HubConnection) -> None:
    item = CreditItem(credit_id=1, prompt_id="p0000", prompt="", seed=0)
    err = refused(raw, encode(make_group("raw", 0, item, 0)))
    assert (err.code, err.field) == ("not_registered", "client_id")
    served(good)


def test_truncated_and_missing_frames(
    raw: zmq.Socket, hub: HubProcess, good: HubConnection
) -> None:
    items = hello(raw, hub)
    frames = [bytes(memoryview(f)) for f in encode(make_group("raw", 0, items[0], 0))]
    err = refused(raw, [*frames[:-1], frames[-1][:-3]])
    assert (err.code, err.field) == ("truncated", "behavior_logprobs")
    err = refused(raw, frames[:-1])
    assert err.field == "behavior_logprobs"
    assert refused(raw, [*frames, b"extra"]).field == "frames"
    served(good)


def test_wrong_dtype_and_shape(raw: zmq.Socket, hub: HubProcess, good: HubConnection) -> None:
    items = hello(raw, hub)
    frames = encode(make_group("raw", 0, items[0], 0))
    ref = header_of(frames)["tokens"]
    assert refused(raw, with_header(frames, tokens={**ref, "dtype": "float64"})).field == "tokens"
    assert refused(raw, with_header(frames, tokens={**ref, "shape": [2, 5]})).field == "tokens"
    assert refused(raw, with_header(frames, rewards="high")).field == "rewards"
    served(good)


def test_nan_logprobs_and_rewards(raw: zmq.Socket, hub: HubProcess, good: HubConnection) -> None:
    items = hello(raw, hub)
    group = make_group("raw", 0, items[0], 0)
    bad = np.array(group.behavior_logprobs)
    bad[3] = np.nan
    frames = encode(group)
    frames[3] = bad.data
    assert refused(raw, frames).field == "behavior_logprobs"
    err = refused(raw, with_header(encode(group), rewards=[math.nan, 1.0]))
    assert err.field == "rewards"
    served(good)


def test_unknown_credit_and_wrong_role(
    raw: zmq.Socket, hub: HubProcess, good: HubConnection
) -> None:
    items = hello(raw, hub)
    forged = CreditItem(credit_id=items[0].credit_id + 1000, prompt_id="p0000", prompt="", seed=0)
    err = refused(raw, encode(make_group("raw", 0, forged, 0)))
    assert (err.code, err.field) == ("unknown_credit", "credit_id")
    err = refused(raw, encode(make_group("someone-else", 0, items[0], 0)))
    assert err.field == "actor_id"
    err = refused(raw, encode(Credits(group_size=1, policy_version=0, items=())))
    assert (err.code, err.field) == ("bad_message", "type")  # hub-to-client only
    served(good)


def test_wrong_role(raw: zmq.Socket, hub: HubProcess, good: HubConnection) -> None:
    hello(raw, hub, role="learner", client_id="raw-learner")
    item = CreditItem(credit_id=1, prompt_id="p0000", prompt="", seed=0)
    err = refused(raw, encode(make_group("raw-learner", 0, item, 0)))
    assert (err.code, err.field) == ("bad_role", "type")
    served(good)


def test_oversized(raw: zmq.Socket, hub: HubProcess, good: HubConnection) -> None:
    items = hello(raw, hub)
    # each frame under MAXMSGSIZE, the message over the limit: the codec's own check answers
    group = make_group("raw", 0, items[0], 0)
    frames = encode(group)
    pad = header_of(frames)
    pad["metadata"] = {"pad": "x" * (LIMIT // 2)}
    big = np.zeros(LIMIT * 3 // 16, np.int32)  # 48 KiB of tokens
    oversized = [msgpack.packb(pad), big.data, *frames[2:]]
    err = refused(raw, oversized)
    assert (err.code, err.field) == ("too_large", "message")
    # one frame over MAXMSGSIZE: the socket drops the connection; the hub keeps serving
    raw.send_multipart([b"x" * (2 * LIMIT)])
    served(good)
    assert stats(good)["errors"]["too_large"] >= 1
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:  # the raw client reconnects and is answered again
        raw.send_multipart([b"\xc1"])
        if raw.poll(200):
            assert isinstance(decode(raw.recv_multipart()), Error)
            break
    else:
        raise AssertionError("the hub never answered again after the oversized frame")
