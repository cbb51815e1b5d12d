"""Raw-socket helpers for the tests that talk to a server (hub, reward-model server) directly,
and `wait_for`, a deadline on a condition such tests poll."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from asyncrl.protocol.codec import decode
from asyncrl.protocol.messages import Error, Message

WAIT_S = 60.0  # generous: a deadline for an answer, never a speed assertion


@contextlib.contextmanager
def dealer(endpoint: str) -> Iterator[zmq.Socket]:
    """A bare DEALER socket connected to `endpoint` (no handshake)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()


def reply(sock: zmq.Socket) -> Message:
    """The next message the server sends back."""
    assert sock.poll(int(WAIT_S * 1000)), "the server did not answer"
    return decode(sock.recv_multipart())


def refused(sock: zmq.Socket, frames: list[Any]) -> Error:
    """Send `frames`; the answer must be an `Error` (returned)."""
    sock.send_multipart(frames)
    msg = reply(sock)
    assert isinstance(msg, Error), msg
    return msg


def wait_for(
    predicate: Callable[[], Any], what: str, timeout_s: float = WAIT_S, interval_s: float = 0.05
) -> None:
    """Poll `predicate` until it holds; fail naming `what` after `timeout_s` (a deadline, never
    a speed assertion)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval_s)
