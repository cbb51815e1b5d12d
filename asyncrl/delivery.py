"""`Ledger`: what a hub client owes the hub and holds from it, kept across hub restarts.

A `HubConnection` sends and receives; its ledger remembers what delivery needs:

- credits: those the current hub granted and this client has not used (`held`), and those of a
  previous hub incarnation (`retired`), each usable once for a group already being generated;
- groups sent and not yet acknowledged (`unacked`, seq -> group, in send order): re-sent after
  a reconnect or a `capacity` refusal, deduplicated by the hub on (actor_id, seq);
- the latest `Version`, `BatchAck` and unanswered `SampleRequest`: said again to a restarted hub;
- the highest policy version this client has spoken of (its heartbeats carry it).

Thread-safe: the caller's thread records what it sends (`record`), the connection's I/O thread
what the hub answers; one lock guards it all.
"""

from __future__ import annotations

import threading

from asyncrl.protocol import (
    Ack,
    Batch,
    BatchAck,
    CreditReturn,
    Credits,
    Group,
    Message,
    SampleRequest,
    Version,
    WeightsLoaded,
)


class Ledger:
    """A hub client's delivery state (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[int] = set()
        self._retired: set[int] = set()
        self._unacked: dict[int, Group] = {}
        self._last_version: Version | None = None
        self._last_batch_ack: BatchAck | None = None
        self._pending_request: SampleRequest | None = None
        self.policy_version = 0

    # --- the caller's side --------------------------------------------------------------------

    def record(self, msg: Message) -> None:
        """Note a message about to be sent. A `Group` spends its credit (ValueError if this
        client holds no such credit) and stays unacknowledged until the hub says otherwise."""
        with self._lock:
            if isinstance(msg, Group):
                self._spend(msg.credit_id)
                self._unacked[msg.seq] = msg
            elif isinstance(msg, CreditReturn):
                self._held.difference_update(msg.credit_ids)
                self._retired.difference_update(msg.credit_ids)
            elif isinstance(msg, Version):
                self._last_version = msg
            elif isinstance(msg, BatchAck):
                self._last_batch_ack = msg
            elif isinstance(msg, SampleRequest):
                self._pending_request = msg
            if isinstance(msg, (Version, SampleRequest, WeightsLoaded)):
                self.policy_version = max(self.policy_version, msg.policy_version)

    def _spend(self, credit_id: int) -> None:
        if credit_id in self._held:
            self._held.discard(credit_id)
        elif credit_id in self._retired:
            self._retired.discard(credit_id)
        else:
            raise ValueError(f"credit_id {credit_id}: this client holds no such credit")

    def credits_held(self) -> int:
        with self._lock:
            return len(self._held)

    def unacked(self) -> int:
        with self._lock:
            return len(self._unacked)

    # --- what the hub answers -------------------------------------------------------------------

    def acked(self, ack: Ack) -> None:
        with self._lock:
            unacked = self._unacked
            unacked.pop(ack.seq, None)
            for seq in ack.seqs:
                unacked.pop(seq, None)

    def granted(self, credits: Credits) -> None:
        with self._lock:
            self._held.update(item.credit_id for item in credits.items)

    def answered(self, batch: Batch) -> None:
        """A `Batch` arrived: the sample request it answers is no longer pending."""
        with self._lock:
            if self._pending_request and self._pending_request.request_id == batch.request_id:
                self._pending_request = None

    def hub_forgot(self) -> list[int]:
        """The hub lost this client (it restarted): the credits it granted become retired, and
        the seqs unacknowledged now are returned, to be re-sent once registered again."""
        with self._lock:
            self._retired |= self._held
            self._held.clear()
            return list(self._unacked)

    def groups(self, seqs: list[int] | None) -> list[Group]:
        """The groups of `seqs` still unacknowledged (all of them for None), in send order."""
        with self._lock:
            wanted = self._unacked if seqs is None else seqs
            return [self._unacked[s] for s in wanted if s in self._unacked]

    def latest(self) -> list[Message]:
        """What a restarted hub must hear again: the latest Version, BatchAck and unanswered
        SampleRequest, those that exist, in that order."""
        with self._lock:
            last = (self._last_version, self._last_batch_ack, self._pending_request)
        return [m for m in last if m is not None]
