"""What the hub keeps per connected client: identity, role, liveness, the acknowledgements it
is owed, and the messages its full pipe could not take yet. No clock; the one socket use is
`Outbox`, which the hub's ROUTER sends through. (Dedup by (actor_id, seq) outlives connections
and hub processes, so it lives in replay/core.py.)

Acks: the hub acknowledges a group once it is stored (or known), but sends the acks of one
burst of received messages together, after the burst. A client that said `batched_acks` in its
Hello gets one `Ack` per burst (the last group in `seq`/`credit_id`, the others in `seqs`);
any other client gets one `Ack` per group, as protocol version 1 always did.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from asyncrl.protocol.codec import encode
from asyncrl.protocol.messages import Ack, Hello, Message
from asyncrl.transport.sockets import NOBLOCK, send_parts


@dataclass(eq=False)
class Client:
    """One registered client (keyed by its ZeroMQ routing id)."""

    identity: bytes
    client_id: str
    role: str
    concurrency: int
    last_seen: float
    batched_acks: bool = False
    loaded_version: int = -1
    session: int = 0  # Hello.session: a new one under the same client id = a restarted client
    owed: list[tuple[int, int]] = field(default_factory=list)  # (seq, credit_id) to ack

    @classmethod
    def from_hello(cls, identity: bytes, hello: Hello, now: float) -> Client:
        return cls(
            identity,
            hello.client_id,
            hello.role,
            hello.concurrency,
            now,
            batched_acks=hello.batched_acks,
            session=hello.session,
        )

    def take_acks(self) -> list[Ack]:
        """The acks owed since the last call, as messages for this client."""
        owed, self.owed = self.owed, []
        if not self.batched_acks:
            return [Ack(seq=seq, credit_id=credit_id) for seq, credit_id in owed]
        seq, credit_id = owed[-1]
        return [Ack(seq=seq, credit_id=credit_id, seqs=[s for s, _ in owed[:-1]])]

    def describe(self, outstanding: int, now: float) -> dict[str, object]:
        """This client's line in the hub's stats."""
        return {
            "role": self.role,
            "alive": True,
            "loaded_version": self.loaded_version,
            "outstanding": outstanding,
            "silent_s": round(now - self.last_seen, 3),
        }


class Registry:
    """The registered clients by routing id, and the last word on each one that left."""

    def __init__(self) -> None:
        self.by_identity: dict[bytes, Client] = {}
        self.departed: dict[str, dict[str, Any]] = {}  # client_id -> its line in the stats
        self._last_logged: dict[bytes, float] = {}
        self._owing: list[Client] = []  # clients owed acks since the last acks_due()

    def get(self, identity: bytes) -> Client | None:
        return self.by_identity.get(identity)

    def add(self, identity: bytes, hello: Hello, now: float) -> Client:
        client = self.by_identity[identity] = Client.from_hello(identity, hello, now)
        self.departed.pop(hello.client_id, None)
        return client

    def remove(self, client: Client, why: str) -> None:
        self.by_identity.pop(client.identity, None)
        self.departed[client.client_id] = {
            "role": client.role,
            "alive": False,
            "why": why,
            "loaded_version": client.loaded_version,
        }

    def actors(self) -> list[Client]:
        return [c for c in self.by_identity.values() if c.role == "actor"]

    def newest_actors(self) -> dict[str, Client]:
        """Actor id -> its most recently heard-from connection (a restarted actor can have an
        old one that has not expired yet)."""
        newest: dict[str, Client] = {}
        for actor in self.actors():
            seen = newest.get(actor.client_id)
            if seen is None or actor.last_seen >= seen.last_seen:
                newest[actor.client_id] = actor
        return newest

    def silent(self, now: float, timeout_s: float) -> list[Client]:
        """Clients not heard from for more than `timeout_s`."""
        return [c for c in self.by_identity.values() if now - c.last_seen > timeout_s]

    def may_log(self, identity: bytes, now: float) -> bool:
        """At most one log line per sender per minute."""
        if now - self._last_logged.get(identity, -1e9) < 60.0:
            return False
        self._last_logged[identity] = now
        return True

    def owe_ack(self, client: Client, seq: int, credit_id: int) -> None:
        """Acknowledge this group with the others of the current burst."""
        if not client.owed:
            self._owing.append(client)
        client.owed.append((seq, credit_id))

    def acks_due(self) -> list[tuple[bytes, Ack]]:
        """The acks owed since the last call: (routing id, message), in order."""
        owing, self._owing = self._owing, []
        return [(c.identity, ack) for c in owing for ack in c.take_acks()]

    def describe(self, held_by: Callable[[bytes], int], now: float) -> dict[str, Any]:
        """Every client's line in the hub's stats, departed ones included."""
        lines = dict(self.departed)
        for c in self.by_identity.values():
            lines[c.client_id] = c.describe(held_by(c.identity), now)
        return lines


class Outbox:
    """Sends on the hub's ROUTER without ever blocking the loop: a peer whose pipe is full
    (SNDHWM) gets a backlog, flushed in order as it drains; a peer that is gone loses what was
    meant for it (counted in `dropped`)."""

    def __init__(self, sock: zmq.Socket, pack_frames_below: int) -> None:
        self.sock = sock
        self.pack_frames_below = pack_frames_below  # replay.pack_frames_below, for `encode`
        self.backlog: dict[bytes, collections.deque[list[Any]]] = {}
        self.dropped = 0

    def send_message(self, identity: bytes, msg: Message) -> None:
        """Encode `msg` and send it to `identity`."""
        self.send(identity, encode(msg, self.pack_frames_below))

    def send(self, identity: bytes, frames: list[Any]) -> None:
        """Send encoded (or received, forwarded) frames to `identity`."""
        pending = self.backlog.get(identity)
        if pending:
            pending.append(frames)
            return
        try:
            send_parts(self.sock, [identity, *frames], NOBLOCK)
        except zmq.Again:
            self.backlog.setdefault(identity, collections.deque()).append(frames)
        except zmq.ZMQError:  # EHOSTUNREACH (ROUTER_MANDATORY): the peer is gone
            self.dropped += 1

    def flush(self) -> None:
        """Send what the backlogged peers can take now."""
        for identity in list(self.backlog):
            pending = self.backlog[identity]
            while pending:
                try:
                    send_parts(self.sock, [identity, *pending[0]], NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    self.dropped += len(pending)
                    pending.clear()
                    break
                pending.popleft()
            if not pending:
                del self.backlog[identity]

    def forget(self, identity: bytes) -> None:
        """A client left: drop its backlog."""
        self.backlog.pop(identity, None)
