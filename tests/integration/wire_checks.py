"""Raw-socket helpers for the tests that talk to a server (hub, reward-model server) directly."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import zmq

from asyncrl.protocol import Error, Message, decode

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
