"""What the hub knows about each connected client: identity, role, liveness, the groups it has
already delivered (dedup), and the acknowledgements it is owed. No sockets, no clock.

Dedup: a client re-sends only groups it has not seen acknowledged, so the hub remembers the last
`DEDUP_WINDOW` seqs per actor; a re-send of one of those is acknowledged again, not stored.

Acks: the hub acknowledges a group once it is stored (or known), but sends the acks of one
burst of received messages together, after the burst. A client that said `batched_acks` in its
Hello gets one `Ack` per burst (the last group in `seq`/`credit_id`, the others in `seqs`);
any other client gets one `Ack` per group, as protocol version 1 always did.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from asyncrl.protocol import Ack, Hello, SampleRequest

DEDUP_WINDOW = 65536  # seqs remembered per actor; a client re-sends only groups not yet acked


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
    seen: set[int] = field(default_factory=set)  # seqs of groups already taken (dedup)
    seen_order: collections.deque[int] = field(default_factory=collections.deque)
    owed: list[tuple[int, int]] = field(default_factory=list)  # (seq, credit_id) to ack

    @classmethod
    def from_hello(cls, identity: bytes, hello: Hello, now: float) -> Client:
        return cls(identity, hello.client_id, hello.role, hello.concurrency, now,
                   batched_acks=hello.batched_acks)  # fmt: skip

    def remember(self, seq: int) -> None:
        """A group with this seq was taken: a later copy of it is a duplicate."""
        self.seen.add(seq)
        self.seen_order.append(seq)
        if len(self.seen_order) > DEDUP_WINDOW:
            self.seen.discard(self.seen_order.popleft())

    def take_acks(self) -> list[Ack]:
        """The acks owed since the last call, as messages for this client."""
        owed, self.owed = self.owed, []
        if not self.batched_acks:
            return [Ack(seq=seq, credit_id=credit_id) for seq, credit_id in owed]
        seq, credit_id = owed[-1]
        return [Ack(seq=seq, credit_id=credit_id, seqs=[s for s, _ in owed[:-1]])]

    def describe(self, outstanding: int, now: float) -> dict[str, object]:
        """This client's line in the hub's stats."""
        return {"role": self.role, "alive": True, "loaded_version": self.loaded_version,
                "outstanding": outstanding, "silent_s": round(now - self.last_seen, 3)}  # fmt: skip


@dataclass
class Parked:
    """A sample request waiting for enough eligible groups."""

    identity: bytes
    request: SampleRequest
    since: float
