"""The hub's state, and the only code that changes it: one method per kind of change (an op).

What a hub must not lose lives here: the buffer, the outstanding credits, the prompt source
(cursor, re-issue queue, attempt counts), each actor id's dedup window, the batches lent to the
learner and not yet acknowledged, the policy version and the counters. Sockets, clients and
clocks stay in replay/server.py. Every op is deterministic given the state and its recorded
arguments, and records itself through `journal` (when one is set), so a snapshot plus the log of
ops since rebuilds the state exactly (replay/durability.py replays them with `apply`).

Delivery rules kept here:
- Dedup by (actor_id, seq): each actor id has a `SeqWindow`. A group whose seq it holds is a
  resend: acknowledged again, never stored twice, whichever connection or hub process it came
  through. A new session of an actor id (a restarted process, a different `Hello.session`)
  abandons the gaps of the old one and takes over numbering at `next_seq`.
- Lending: a batch handed to a learner that acknowledges batches (`Hello.acks_batches`) stays
  lent until `BatchAck`; a new learner session (it died and came back) gets every lent group
  back in the buffer, ahead of the rest, and the version it reports next is adopted even when
  older (it resumed from a checkpoint: the steps since are lost, so their data is not counted).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.config import RunConfig
from asyncrl.protocol.codec import decode
from asyncrl.protocol.messages import CreditItem, Group, ProtocolError
from replay.admission import CreditBook
from replay.buffer import InsertResult, ReplayBuffer
from replay.prompts import PromptSource

DEDUP_GAPS = 65536  # seqs above an unfilled gap remembered per actor id before giving up on it
Journal = Callable[[str, dict[str, Any], Sequence[Any], "tuple[str, int] | None"], int]
"""journal(op, args, frames, key) -> the record's log position (lsn), for replay/durability.py;
`key` is the (actor_id, seq) of the group a `store` record holds, else None."""


@dataclass
class SeqWindow:
    """The seqs already taken from one actor id: every seq below `floor`, and `above`."""

    floor: int = 0
    above: set[int] = field(default_factory=set)
    top: int = -1  # the highest seq taken
    session: int = 0

    def seen(self, seq: int) -> bool:
        return seq < self.floor or seq in self.above

    def add(self, seq: int) -> None:
        if seq == self.floor and not self.above:  # the usual case: the next seq, in order
            self.floor = seq + 1
            self.top = max(self.top, seq)
            return
        self.above.add(seq)
        self.top = max(self.top, seq)
        while self.floor in self.above:
            self.above.discard(self.floor)
            self.floor += 1
        if len(self.above) > DEDUP_GAPS:  # a gap that never filled: its group is not coming
            self.floor = self.top - DEDUP_GAPS // 2
            self.above = {s for s in self.above if s >= self.floor}

    @property
    def next_seq(self) -> int:
        return max(self.floor, self.top + 1)

    def new_session(self, session: int) -> None:
        """A restarted sender: what it had not delivered died with it, gaps included."""
        self.session, self.floor, self.above = session, self.next_seq, set()


class HubState:
    """Buffer, credits, prompts, dedup, lent batches, version, counters; changed only by ops."""

    def __init__(self, cfg: RunConfig, prompts: PromptSource, incarnation: int) -> None:
        rc = cfg.replay
        self.groups_per_step = cfg.learner.groups_per_step
        self.buffer = ReplayBuffer(
            capacity=rc.capacity_groups,
            max_staleness=rc.max_staleness,
            batch_groups=cfg.learner.groups_per_step,
            sampling=rc.sampling,
            max_times_sampled=rc.max_times_sampled,
            samples_per_insert=rc.samples_per_insert,
            tolerance=rc.samples_per_insert_tolerance,
        )
        self.prompts = prompts
        self.credits = CreditBook(prompts, incarnation)
        self.windows: dict[str, SeqWindow] = {}
        self.lent: dict[int, list[Group]] = {}  # request id -> groups not yet acknowledged
        self.learner_session = 0
        self.learner_acks = False
        self.rewind_pending = False  # a new learner session: its first version may be older
        self.counters: collections.Counter[str] = collections.Counter()
        self.staleness_hist: collections.Counter[int] = collections.Counter()
        self.dropped_since_batch = 0
        self.journal: Journal | None = None
        self.last_lsn = 0  # log position of the latest recorded op

    @property
    def policy_version(self) -> int:
        return self.buffer.policy_version

    def _record(
        self,
        op: str,
        args: dict[str, Any],
        frames: Sequence[Any] = (),
        key: tuple[str, int] | None = None,
    ) -> None:
        if self.journal is not None:
            self.last_lsn = self.journal(op, args, frames, key)

    # --- ops ------------------------------------------------------------------------------------

    def begin(self, incarnation: int) -> None:
        """A hub process starts: the credits it issues carry its incarnation."""
        self.credits.incarnation = incarnation
        self._record("begin", {"incarnation": incarnation})

    def actor_hello(self, holder: bytes, actor_id: str, session: int) -> int:
        """An actor (re)registers; returns the seq it should number its next new group with.
        A new session also expires credits its earlier process still held (a recovered hub)."""
        window = self.windows.setdefault(actor_id, SeqWindow())
        if session == 0 or session != window.session:
            window.new_session(session)
            self.credits.expire(holder)
        self._record("actor_hello", {"holder": holder, "actor_id": actor_id, "session": session})
        return window.next_seq

    def learner_hello(self, session: int, acks_batches: bool) -> int:
        """A learner (re)registers; a new session gets every lent group back into the buffer.
        Returns how many came back."""
        returned = 0
        if session == 0 or session != self.learner_session:
            lent = [g for rid in sorted(self.lent) for g in self.lent[rid]]
            self.lent.clear()
            self.counters["groups_returned"] += len(lent)
            self.dropped(self.buffer.give_back(lent))
            self.rewind_pending = True
            returned = len(lent)
        self.learner_session, self.learner_acks = session, acks_batches
        self._record("learner_hello", {"session": session, "acks_batches": acks_batches})
        return returned

    def store(self, holder: bytes, group: Group, frames: Sequence[Any] = ()) -> InsertResult:
        """Take a group from `holder` (not a resend: see `is_resend`); raises ProtocolError when
        refused (credit not held, replay full), changing nothing then."""
        held = self.credits.holds(holder, group.credit_id)
        if not held and self.credits.is_current(group.credit_id):
            raise ProtocolError(
                "credit_id", f"credit {group.credit_id} is not held by this actor", "unknown_credit"
            )
        if not self.buffer.has_room(group):
            raise ProtocolError(
                "group", f"replay is full ({self.buffer.capacity} groups)", "capacity"
            )
        self._record("store", {"holder": holder}, frames, (group.actor_id, group.seq))
        result = self.buffer.insert(group, self.last_lsn)
        assert result is not InsertResult.FULL and result is not InsertResult.DUPLICATE, result
        if held:
            self.credits.spend(holder, group.credit_id)
        else:
            self.counters["groups_adopted"] += 1  # completed work for an earlier hub's credit
        window = self.windows.get(group.actor_id)
        if window is None:
            window = self.windows[group.actor_id] = SeqWindow()
        window.add(group.seq)
        if result is InsertResult.STORED:
            self.counters["groups_stored"] += 1
        elif result is InsertResult.STALE:
            self.counters["groups_stale_on_arrival"] += 1
            self.dropped([group])
        return result

    def issue(self, holder: bytes, n: int) -> list[CreditItem]:
        self._record("issue", {"holder": holder, "n": n})
        return self.credits.issue(holder, n)

    def give_back(self, holder: bytes, credit_ids: list[int]) -> int:
        self._record("give_back", {"holder": holder, "credit_ids": credit_ids})
        return self.credits.give_back(holder, credit_ids)

    def expire(self, holder: bytes) -> int:
        """A holder left or died: its credits expire, their prompts are re-issued."""
        if self.credits.held_by(holder):
            self._record("expire", {"holder": holder})
        return self.credits.expire(holder)

    def adopt_version(self, policy_version: int, rewind: bool = False) -> None:
        """The learner's version only moves forward, except once after a new learner session
        (`rewind`); groups now too stale are dropped and their prompts re-issued."""
        if rewind and self.rewind_pending:  # recorded even when nothing else changes
            self._record("adopt_version", {"policy_version": policy_version, "rewind": True})
            self.rewind_pending = False
            if policy_version < self.policy_version:
                self.buffer.rewind(policy_version, policy_version * self.groups_per_step)
                return
        elif policy_version > self.policy_version:
            self._record("adopt_version", {"policy_version": policy_version, "rewind": False})
        if policy_version > self.policy_version:
            self.dropped(self.buffer.drop_stale(policy_version))

    def hand_out(self, request_id: int, num_groups: int, durable_lsn: float) -> list[Group]:
        """The groups of the batch for `request_id` ([] while too few are eligible and durable);
        the same groups again for a request already answered and not yet acknowledged."""
        if request_id in self.lent:
            return self.lent[request_id]
        groups, dropped = self.buffer.sample(self.policy_version, num_groups, durable_lsn)
        self.dropped(dropped)
        if groups:
            if self.journal is not None:
                keys = [[g.actor_id, g.seq] for g in groups]
                self._record("hand_out", {"request_id": request_id, "keys": keys})
            self._lend(request_id, groups)
        return groups

    def _lend(self, request_id: int, groups: list[Group]) -> None:
        self.counters["groups_consumed"] += len(groups)
        for g in groups:
            self.staleness_hist[self.policy_version - g.min_policy_version] += 1
        if self.learner_acks:
            self.lent[request_id] = groups
        else:
            self.counters["groups_trained"] += len(groups)
        self.dropped_since_batch = 0

    def trained(self, request_id: int) -> int:
        """The learner trained every batch up to `request_id`: their groups are gone for good."""
        done = [rid for rid in self.lent if rid <= request_id]
        if done:
            self._record("trained", {"request_id": request_id})
        num = sum(len(self.lent.pop(rid)) for rid in done)
        self.counters["groups_trained"] += num
        return num

    # --- helpers --------------------------------------------------------------------------------

    def resend(self, actor_id: str, seq: int) -> None:
        """A group taken before came again (acknowledged again, not stored): counted."""
        self._record("resend", {"actor_id": actor_id, "seq": seq})
        self.counters["groups_duplicate"] += 1

    def is_resend(self, actor_id: str, seq: int) -> bool:
        """A group with this (actor_id, seq) was already taken: acknowledge it, store nothing."""
        window = self.windows.get(actor_id)
        return window is not None and window.seen(seq)

    def next_seq(self, actor_id: str) -> int:
        window = self.windows.get(actor_id)
        return window.next_seq if window else 0

    def dropped(self, groups: list[Group]) -> None:
        """Groups dropped as stale: counted, their prompts re-issued."""
        for g in groups:
            self.prompts.reissue(g.prompt_id)
        self.counters["groups_dropped_stale"] += len(groups)
        self.dropped_since_batch += len(groups)

    # --- snapshot and replay --------------------------------------------------------------------

    def export(self) -> tuple[dict[str, Any], list[Group]]:
        """(state without groups, the groups: stored ones in order, then lent ones)."""
        counts, entries = self.buffer.export()
        lent = [g for gs in self.lent.values() for g in gs]
        windows = [[a, w.floor, sorted(w.above), w.top, w.session] for a, w in self.windows.items()]
        meta = {
            "buffer": counts,
            "times_sampled": [t for _, t in entries],
            "lent": [[rid, len(gs)] for rid, gs in self.lent.items()],
            "credits": self.credits.export(),
            "prompts": self.prompts.export(),
            "windows": windows,
            "learner": [self.learner_session, self.learner_acks],
            "counters": dict(self.counters),
            "staleness": list(self.staleness_hist.items()),
            "dropped_since_batch": self.dropped_since_batch,
        }
        return meta, [g for g, _ in entries] + lent

    def restore(self, meta: dict[str, Any], groups: list[Group]) -> None:
        """The state `export` returned, into a fresh HubState."""
        stored = len(meta["times_sampled"])
        self.buffer.restore(
            meta["buffer"], list(zip(groups[:stored], meta["times_sampled"], strict=True))
        )
        rest = iter(groups[stored:])
        self.lent = {rid: [next(rest) for _ in range(n)] for rid, n in meta["lent"]}
        self.credits.restore(meta["credits"])
        self.prompts.restore(meta["prompts"])
        for actor_id, floor, above, top, session in meta["windows"]:
            self.windows[actor_id] = SeqWindow(floor, set(above), top, session)
        self.learner_session, self.learner_acks = meta["learner"]
        self.counters = collections.Counter(meta["counters"])
        self.staleness_hist = collections.Counter(dict(map(tuple, meta["staleness"])))
        self.dropped_since_batch = meta["dropped_since_batch"]

    def apply(self, op: str, args: dict[str, Any], frames: Sequence[Any]) -> None:
        """Replay one recorded op (recovery): the same change the live op made."""
        assert self.journal is None, "replaying into a state that records"
        if op == "store":
            group = decode(frames, 1 << 62, check_values=False)
            assert isinstance(group, Group)
            self.store(args["holder"], group)
        elif op == "hand_out":
            groups = self.buffer.take([(a, s) for a, s in args["keys"]])
            self._lend(args["request_id"], groups)
        else:
            getattr(self, op)(**args)
