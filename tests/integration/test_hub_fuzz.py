"""Byte-level fuzzing of a real hub: 10,000 mutated messages of every kind a client sends
(delivery messages included), each one the codec refuses, sent by a registered client. Every
one is answered with an `Error` naming the same field the codec names, the hub stays up, its
memory stays flat, and a well-behaved client is served throughout."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from hub_cases import WAIT_S, HubProcess, make_group, stats

from asyncrl.protocol.codec import decode, encode
from asyncrl.protocol.messages import (
    PROTOCOL_VERSION,
    BatchAck,
    Bye,
    CreditItem,
    CreditReturn,
    Error,
    Heartbeat,
    Hello,
    ProtocolError,
    SampleRequest,
    StatsRequest,
    Version,
    WeightsLoaded,
    Welcome,
)

MESSAGES = 10_000
CHUNK = 200  # sent back to back, then their replies read


def seeds() -> list[list[bytes]]:
    item = CreditItem(credit_id=5, prompt_id="p1", prompt="sort 1", seed=1)
    msgs: list[Any] = [
        make_group("fuzz", 3, item, 0, size=3),
        BatchAck(request_id=4),
        SampleRequest(request_id=4, policy_version=2, num_groups=2),
        Version(policy_version=3),
        Heartbeat(client_id="fuzz", policy_version=1),
        CreditReturn(credit_ids=[5, 6]),
        WeightsLoaded(actor_id="fuzz", policy_version=2),
        StatsRequest(),
        Bye(client_id="fuzz"),
        Hello(
            role="actor",
            client_id="fuzz",
            protocol_version=1,
            config_hash="h",
            session=9,
            acks_batches=True,
            batched_acks=True,
        ),
    ]
    return [[bytes(memoryview(f)) for f in encode(m)] for m in msgs]


def mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    i = rng.randrange(len(frames))
    frame = bytearray(frames[i])
    how = rng.randrange(6)
    if how == 0 and frame:  # flip bits
        for _ in range(rng.randint(1, 3)):
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
    elif how == 1:  # truncate
        del frame[rng.randrange(len(frame) + 1) :]
    elif how == 2:  # random bytes appended
        frame += rng.randbytes(rng.randint(1, 16))
    elif how == 3 and len(frames) > 1:  # a frame lost
        del frames[i]
        return frames
    elif how == 4:  # a frame duplicated
        frames.insert(i, bytes(frame))
    else:  # garbage of the same length
        frame = bytearray(rng.randbytes(len(frame)))
    frames[i] = bytes(frame)
    return frames


def bad_messages(n: int, seed: int) -> Iterator[tuple[list[bytes], str]]:
    """(frames, the field the codec names) for `n` mutated messages the codec refuses."""
    rng, pool, made = random.Random(seed), seeds(), 0
    while made < n:
        frames = mutate(rng, rng.choice(pool))
        try:
            decode(frames, LIMIT)
        except ProtocolError as exc:
            made += 1
            yield frames, exc.field


LIMIT = 64 * 1024


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[HubProcess]:
    proc = HubProcess(tmp_path, ["replay.max_message_bytes=65536", "learner.groups_per_step=2"])
    yield proc
    proc.kill()


def test_ten_thousand_mutated_messages_each_get_an_error_naming_the_field(hub: HubProcess) -> None:
    good = hub.connect("learner", "good-learner")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(hub.endpoint)
    sock.send_multipart(
        encode(
            Hello(
                role="actor",
                client_id="fuzz",
                protocol_version=PROTOCOL_VERSION,
                config_hash=hub.config_hash,
                concurrency=0,
            )
        )
    )
    assert sock.poll(int(WAIT_S * 1000)) and isinstance(decode(sock.recv_multipart()), Welcome)
    rss_before, answered = 0, 0
    chunk: list[str] = []
    for n, (frames, field) in enumerate(bad_messages(MESSAGES, seed=15), start=1):
        sock.send_multipart(frames)
        chunk.append(field)
        if len(chunk) == CHUNK or n == MESSAGES:
            for expected in chunk:
                assert sock.poll(int(WAIT_S * 1000)), f"no answer to message {answered + 1}"
                reply = decode(sock.recv_multipart())
                assert isinstance(reply, Error) and reply.field == expected, (reply, expected)
                answered += 1
            chunk = []
            if n == 2000:  # warmed up: allocator pools and caches are in place
                rss_before = rss_kib(hub.proc.pid)
    assert answered == MESSAGES and hub.proc.poll() is None
    assert rss_kib(hub.proc.pid) - rss_before < 32 * 1024  # flat, within allocator noise
    s = stats(good)
    assert sum(s["errors"].values()) == MESSAGES and s["stored"] == 0
    sock.close()
    ctx.term()
    good.close()
