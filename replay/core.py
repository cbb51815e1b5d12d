"""The hub's core: its state and every decision it takes, as functions of that state, the message
and the time (given as an argument). No sockets, no clock, no threads: replay/server.py polls,
decodes, sends and holds Acks and Batches back until the durable commit; the simulator
(bench/sim/model.py) drives this same core with simulated actors and learner.

```
  Hello(actor, window)  --> actor_joined   a credit window per actor, dedup window per actor id
  (grant, once a turn)  --> grant          -> [(actor, Credits)]  admission below; the floor
                                              `min_weights_version` rides along
  Group                 --> take_group     credit held? resend? -> ReplayBuffer.insert; the
                                              caller owes the sender an Ack
  SampleRequest         --> request        adopt its version, park it
  (serve, once a turn)  --> serve          -> [(learner, Batch)]  all-or-nothing, none staler
                                              than η (ReplayBuffer.sample)
  Version, Heartbeat    --> adopt_version  drop what became too stale, re-issue its prompts
  WeightsLoaded         --> weights_loaded the actor's admission window moves up
  BatchAck, CreditReturn, Bye/silence --> trained, give_back, left
```

What to send comes back from `grant` and `serve` as (routing id, message) pairs; what to log
goes through `HubState`'s journal: every change of what a hub must not lose is one op, recorded
as it is made (replay/durability.py writes the records and replays them with `apply`).

Admission at the source (AReaL's rule, in groups). With the learner at policy version v,
staleness bound η and B groups per optimizer step, the groups ever admitted may not run more
than η + 1 steps ahead of what the learner has taken:

    consumed + ready + in_flight <= (η + v + 1) * B

where `consumed` counts distinct groups handed to the learner, `ready` stored groups not yet
handed out, and `in_flight` outstanding credits. Groups dropped as stale leave `ready` without
entering `consumed`, so they free their slot and their prompt is generated again. With η = 0
this is the synchronous baseline: B credits, then nothing until the learner has taken those B
groups *and* reported the next version.

The version in that rule is the one the groups will be generated with: a credit granted to an
actor that still holds weights w < v can only produce groups stamped w, which the learner may
take no later than version w + η. So each actor's share is bounded by the window at
min(v, w_actor) (`grant`), and actors holding the newest weights are served first. With the
learner's version alone, the last groups of every window would be generated with weights one
version too old and dropped as stale on arrival at the learner (at η = 1 about 45 % of all
generated groups on the embedded default). An actor that has reported no weights holds the
initial ones (version 0).

Three more limits: the buffer's capacity (stored + in flight never exceeds it, so a group that
arrives with a valid credit always has room), the buffer's reuse limiter (`insert_room`), and the
actors' own credit windows (an actor never holds more credits than it asked for, and is topped
up once a quarter of its window is free: `refill_at`). Each `Credits` carries the floor of the
weights its credits need (`weights_floor`): an actor holding older weights waits for newer ones
before it generates, since its groups would only be dropped.

State and delivery (`HubState`): the buffer, the outstanding credits (`CreditBook`), the prompt
source (cursor, re-issue queue, attempt counts), each actor id's dedup window, the batches lent
to the learner and not yet acknowledged, the policy version and the counters. Every op is
deterministic given the state and its recorded arguments, so a snapshot plus the log of ops
since rebuilds the state exactly.
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
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from asyncrl.config import RunConfig
from asyncrl.protocol.codec import decode
from asyncrl.protocol.group_codec import new_message
from asyncrl.protocol.messages import (
    Batch,
    CreditItem,
    Credits,
    Group,
    ProtocolError,
    SampleRequest,
)
from replay.buffer import InsertResult, ReplayBuffer
from replay.prompts import PromptSource

K = TypeVar("K")  # whatever names an actor (the hub: its routing id)

# --- admission: how many credits may be out --------------------------------------------------


def credits_available(
    *,
    policy_version: int,
    max_staleness: int,
    groups_per_step: int,
    consumed: int,
    ready: int,
    in_flight: int,
    stored: int,
    capacity: int,
    insert_room: int | None = None,
) -> int:
    """New credits the hub may issue now, summed over all actors (never negative)."""
    assert policy_version >= 0 and max_staleness >= 0 and groups_per_step >= 1
    window = (max_staleness + policy_version + 1) * groups_per_step
    room = window - consumed - ready - in_flight
    room = min(room, capacity - stored - in_flight)
    if insert_room is not None:
        room = min(room, insert_room - in_flight)
    return max(0, room)


def room(
    buffer: ReplayBuffer,
    in_flight: int,
    max_staleness: int,
    groups_per_step: int,
    policy_version: int,
) -> int:
    """`credits_available` for the state of `buffer`, with the window at `policy_version`."""
    return credits_available(
        policy_version=policy_version,
        max_staleness=max_staleness,
        groups_per_step=groups_per_step,
        consumed=buffer.num_consumed,
        ready=buffer.num_unsampled,
        in_flight=in_flight,
        stored=len(buffer),
        capacity=buffer.capacity,
        insert_room=buffer.insert_room(),
    )


def generation_version(hub_version: int, loaded_version: int) -> int:
    """The version an actor's next groups are generated with, as far as the hub can tell:
    what it reported loading (-1 = nothing reported yet: the initial weights, version 0),
    never above the learner's."""
    return min(hub_version, max(loaded_version, 0))


def weights_floor(policy_version: int, max_staleness: int, publish_every: int) -> int:
    """`Credits.min_weights_version`: the oldest weights an actor may generate with for credits
    granted at hub version v, v - η (groups older than that would be stale the moment the
    learner could take them), rounded down to a version the learner publishes (every
    `publish_every`-th), never below the initial weights."""
    need = max(0, policy_version - max_staleness)
    return need - need % publish_every


def refill_at(window: int) -> int:
    """Free credit slots an actor's window needs before the hub tops it up: a quarter of it.

    The actor still holds three quarters of its window meanwhile (two credits per group it
    generates at once, by default: `actor.credit_window`), so it never waits for one, and it
    gets one Credits message (one wake-up) per quarter window instead of one per group. With
    2 MB groups (32 credits out) that was one grant, one message and one actor wake-up per
    group, ~50 us of the hub loop's ~350 per group (bench/transport.py)."""
    return max(1, window // 4)


def grant(
    buffer: ReplayBuffer,
    in_flight: int,
    max_staleness: int,
    groups_per_step: int,
    free_slots: Mapping[K, int],
    versions: Mapping[K, int],
) -> dict[K, int]:
    """New credits per actor: `allocate` with each actor capped by the window at its version.

    `versions[actor]` is `generation_version(...)` of each actor in `free_slots`. The
    reference for `ActorSlots.grant`, which gives the same grant without visiting every actor.
    """
    free = {actor: n for actor, n in free_slots.items() if n > 0}
    if not free:
        return {}
    rooms = {
        u: room(buffer, in_flight, max_staleness, groups_per_step, u)
        for u in {versions[actor] for actor in free}
    }
    caps = {actor: rooms[versions[actor]] for actor in free}
    return allocate(max(caps.values()), free, caps)


def allocate(
    total: int, free_slots: Mapping[K, int], caps: Mapping[K, int] | None = None
) -> dict[K, int]:
    """Share `total` credits among actors by free slots (concurrency - outstanding), fairly.

    Round-robin one credit at a time over actors with free slots, emptiest first, so a fast
    actor cannot take the whole window while a slow one idles. With `caps`, an actor gets a
    credit only while fewer than `caps[actor]` credits have been dealt in all (its own
    admission window, see `grant`), and actors with larger caps come first: the result then
    depends only on the first `total` actors in that order. Actors given nothing are left out.
    """
    grant: dict[K, int] = {}
    slots = {actor: n for actor, n in free_slots.items() if n > 0}
    cap = {actor: min(total, caps[actor]) if caps is not None else total for actor in slots}
    order = sorted(slots, key=lambda actor: (-cap[actor], -slots[actor], actor))
    dealt = 0
    while dealt < total and order:
        still = []
        for actor in order:
            if dealt >= cap[actor]:
                break  # caps only fall along the order: nobody after this one gets a credit
            grant[actor] = grant.get(actor, 0) + 1
            dealt += 1
            if grant[actor] < slots[actor]:
                still.append(actor)
        order = still
    return grant


class ActorSlots:
    """The actors that may be topped up now (their free credit slots), grouped by the weights
    each one reported loading; `grant` is `grant` above for them, without visiting every actor.

    `grant` caps each actor by the room at its version, `total` = the largest cap, and `allocate`
    deals one credit per round to actors sorted by (largest cap, most free slots, id), never past
    an actor's cap. So the first round decides who takes part: only the first `total` actors in
    that order can receive anything, and passing just those gives the identical grant
    (tests/unit/test_simulate.py checks this against `grant` over the full map).

    The room is monotone in the version but may be equal at several versions (the capacity
    binds), and then actors of those versions interleave by (slots, id). So each version keeps
    its own heap of (-slots, id), and `candidates` merges the heaps of equal cap, largest cap
    first: O(total log A) per grant instead of O(A log A), with thousands of actors.
    """

    def __init__(self) -> None:
        self.slots: dict[bytes, int] = {}  # actors with free slots
        self.version: dict[bytes, int] = {}  # loaded version; absent = 0 (initial weights)
        self._heaps: dict[int, list[tuple[int, bytes]]] = {}  # (-slots, id); stale ones skipped
        self._num_free: dict[int, int] = {}  # version -> actors with free slots at it

    def __bool__(self) -> bool:
        return bool(self.slots)

    def set(self, actor: bytes, n: int) -> None:
        """`actor` may be topped up by `n` credits now (0: not now)."""
        assert n >= 0, f"{actor!r} would hold more credits than its window"
        old = self.slots.get(actor, 0)
        if n == old:
            return
        version = self.version.get(actor, 0)
        if n == 0:
            del self.slots[actor]
            self._count(version, -1)
            return
        if not old:
            self._count(version, +1)
        self.slots[actor] = n
        self._push(version, n, actor)

    def move(self, actor: bytes, version: int) -> None:
        """The actor now generates with `version`."""
        old = self.version.get(actor, 0)
        if version == old:
            return
        self.version[actor] = version
        n = self.slots.get(actor, 0)
        if n:
            self._count(old, -1)
            self._count(version, +1)
            self._push(version, n, actor)

    def remove(self, actor: bytes) -> None:
        """The actor left."""
        self.set(actor, 0)
        self.version.pop(actor, None)

    def grant(self, room: Callable[[int], int]) -> dict[bytes, int]:
        """`grant` for these actors, `room(u)` being the admission room of an actor that
        loaded version u."""
        rooms = {version: room(version) for version in self._num_free}
        total = max(rooms.values(), default=0)
        if total <= 0:
            return {}
        chosen = self.candidates(total, rooms)
        caps = {actor: rooms[self.version.get(actor, 0)] for actor in chosen}
        return allocate(total, chosen, caps)

    def candidates(self, total: int, rooms: dict[int, int]) -> dict[bytes, int]:
        """Free slots of the first `total` actors in `allocate`'s order, with cap = rooms[version]
        (actors whose cap is not positive get nothing and are left out)."""
        if total >= len(self.slots):
            return dict(self.slots)
        by_cap: dict[int, list[int]] = collections.defaultdict(list)
        for version, cap in rooms.items():
            by_cap[cap].append(version)
        chosen: dict[bytes, int] = {}
        for cap in sorted(by_cap, reverse=True):
            if cap <= 0 or len(chosen) >= total:
                break
            heads: list[tuple[int, bytes, int]] = []  # the best live entry of each version's heap
            for version in by_cap[cap]:
                self._next(version, heads, chosen)
            while heads and len(chosen) < total:
                neg, actor, version = heapq.heappop(heads)
                chosen[actor] = -neg
                self._next(version, heads, chosen)
            for neg, actor, version in heads:
                heapq.heappush(self._heaps[version], (neg, actor))
        for actor, n in chosen.items():
            heapq.heappush(self._heaps[self.version.get(actor, 0)], (-n, actor))
        return chosen

    def _next(
        self, version: int, heads: list[tuple[int, bytes, int]], chosen: dict[bytes, int]
    ) -> None:
        """Move the best live entry of `version`'s heap into `heads` (stale ones are dropped)."""
        heap = self._heaps[version]
        while heap:
            neg, actor = heapq.heappop(heap)
            if actor not in chosen and self._live(version, neg, actor):
                heapq.heappush(heads, (neg, actor, version))
                return

    def _live(self, version: int, neg: int, actor: bytes) -> bool:
        return self.version.get(actor, 0) == version and self.slots.get(actor) == -neg

    def _count(self, version: int, delta: int) -> None:
        n = self._num_free.get(version, 0) + delta
        if n:
            self._num_free[version] = n
        else:  # no actor left at this version: all its heap entries are stale
            del self._num_free[version]
            self._heaps.pop(version, None)

    def _push(self, version: int, n: int, actor: bytes) -> None:
        heap = self._heaps.setdefault(version, [])
        heapq.heappush(heap, (-n, actor))
        if len(heap) > 4 * self._num_free[version] + 64:
            heap[:] = sorted({entry for entry in heap if self._live(version, *entry)})


# --- the state: what a hub must not lose ------------------------------------------------------


class CreditBook:
    """Outstanding credits: which holder (a routing id) may push a group for which prompt.

    Credit ids carry the hub's incarnation in their high 32 bits, so a group for a credit of an
    earlier hub process is recognised as such (see asyncrl/transport/connection.py for what
    the hub does with it) instead of being confused with a forged or spent credit of this one. A hub
    that recovered its state (replay/durability.py) still knows the credits of its earlier
    incarnations that were outstanding, and who holds them.
    """

    def __init__(self, prompts: PromptSource, incarnation: int) -> None:
        assert 0 < incarnation < 2**31
        self.prompts = prompts
        self.incarnation = incarnation
        self._serial = 0
        self._held: dict[bytes, dict[int, str]] = {}  # holder -> credit_id -> prompt_id
        self.outstanding = 0
        self.num_issued = 0
        self.num_expired = 0
        self.num_returned = 0

    def is_current(self, credit_id: int) -> bool:
        """Issued (or forged) under this incarnation; 0 is never an incarnation."""
        return credit_id >> 32 in (self.incarnation, 0)

    def holds(self, holder: bytes, credit_id: int) -> bool:
        return credit_id in self._held.get(holder, ())

    def holders(self) -> list[bytes]:
        """Every holder with outstanding credits."""
        return [holder for holder, book in self._held.items() if book]

    def held_by(self, holder: bytes) -> int:
        return len(self._held.get(holder, ()))

    def issue(self, holder: bytes, n: int) -> list[CreditItem]:
        """`n` new credits for `holder`, each for the next prompt (re-issues first)."""
        book = self._held.setdefault(holder, {})
        items = []
        for _ in range(n):
            prompt, seed = self.prompts.next_prompt()
            self._serial += 1
            credit_id = (self.incarnation << 32) | self._serial
            book[credit_id] = prompt.prompt_id
            items.append(
                new_message(
                    CreditItem,
                    {  # fields in order, without __init__'s cost
                        "credit_id": credit_id,
                        "prompt_id": prompt.prompt_id,
                        "prompt": prompt.prompt,
                        "seed": seed,
                        "info": prompt.info,
                    },
                )
            )
        self.outstanding += n
        self.num_issued += n
        return items

    def spend(self, holder: bytes, credit_id: int) -> bool:
        """Use up a credit for a stored group; False when `holder` does not hold it."""
        if self._held.get(holder, {}).pop(credit_id, None) is None:
            return False
        self.outstanding -= 1
        return True

    def give_back(self, holder: bytes, credit_ids: list[int]) -> int:
        """Credits an actor returns unused: their prompts are re-issued. Unknown ids are ignored."""
        book = self._held.get(holder, {})
        returned = [book.pop(c) for c in credit_ids if c in book]
        for prompt_id in returned:
            self.prompts.reissue(prompt_id)
        self.outstanding -= len(returned)
        self.num_returned += len(returned)
        return len(returned)

    def export(self) -> dict[str, Any]:
        """Everything a snapshot needs (`restore` takes it back)."""
        held = [[holder, list(book.items())] for holder, book in self._held.items()]
        return {
            "incarnation": self.incarnation,
            "serial": self._serial,
            "held": held,
            "issued": self.num_issued,
            "expired": self.num_expired,
            "returned": self.num_returned,
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.incarnation, self._serial = state["incarnation"], state["serial"]
        self._held = {holder: dict(map(tuple, items)) for holder, items in state["held"]}
        self.outstanding = sum(map(len, self._held.values()))
        self.num_issued, self.num_expired = state["issued"], state["expired"]
        self.num_returned = state["returned"]

    def expire(self, holder: bytes) -> int:
        """A holder left or died: all its credits expire and their prompts are re-issued."""
        book = self._held.pop(holder, {})
        for prompt_id in book.values():
            self.prompts.reissue(prompt_id)
        self.outstanding -= len(book)
        self.num_expired += len(book)
        return len(book)


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


# --- the decisions --------------------------------------------------------------------------


@dataclass
class Parked:
    """A sample request waiting for enough eligible groups."""

    identity: bytes
    request: SampleRequest
    since: float


class HubCore:
    """The hub's decisions over its `HubState`, one method per message or per turn's step.

    Actors are named by their routing id (`holder`); a method that answers returns the messages
    to send, the state's changes are journaled as they are made (see the module docstring).
    """

    def __init__(self, cfg: RunConfig, prompts: PromptSource, incarnation: int) -> None:
        self.max_staleness = cfg.replay.max_staleness
        self.groups_per_step = cfg.learner.groups_per_step
        self.group_size = cfg.actor.group_size
        self.publish_every = cfg.learner.publish_every
        self.state = HubState(cfg, prompts, incarnation)
        self.parked: collections.deque[Parked] = collections.deque()
        self.slots = ActorSlots()
        self._windows: dict[bytes, int] = {}  # actor -> credits it asked to hold
        self._changed: set[bytes] = set()  # actors whose credits changed since the last grant

    @property
    def policy_version(self) -> int:
        return self.state.policy_version

    # --- clients coming and going ---------------------------------------------------------------

    def actor_joined(self, holder: bytes, actor_id: str, session: int, window: int) -> int:
        """An actor's Hello: it asks to hold `window` credits. Returns the seq it should number
        its next new group with."""
        next_seq = self.state.actor_hello(holder, actor_id, session)
        self._windows[holder] = window
        self._changed.add(holder)
        return next_seq

    def learner_joined(self, session: int, acks_batches: bool) -> int:
        """A learner's Hello; returns how many lent groups came back into the buffer."""
        return self.state.learner_hello(session, acks_batches)

    def left(self, holder: bytes) -> int:
        """A client left or died (or, after a recovery, never came back): its credits expire
        and their prompts are re-issued, its parked requests are dropped. Returns how many
        credits expired."""
        expired = self.state.expire(holder)
        if any(p.identity == holder for p in self.parked):
            self.parked = collections.deque(p for p in self.parked if p.identity != holder)
        if self._windows.pop(holder, None) is not None:
            self.slots.remove(holder)
        self._changed.discard(holder)
        return expired

    def weights_loaded(self, holder: bytes, loaded_version: int) -> None:
        """The newest weights an actor reported loading: its admission window is at them."""
        if holder in self._windows:
            self.slots.move(holder, max(loaded_version, 0))

    # --- groups and credits ---------------------------------------------------------------------

    def take_group(
        self, holder: bytes, client_id: str, group: Group, frames: Sequence[Any]
    ) -> None:
        """A group pushed by `holder` (whose Hello said `client_id`): stored, or known already
        (a resend: counted, not stored again); either way the sender is owed an Ack. Raises
        ProtocolError when refused (not the sender's, credit not held, replay full)."""
        state = self.state
        state.counters["groups_received"] += 1
        if group.actor_id != client_id:
            raise ProtocolError("actor_id", f"{group.actor_id!r} is not the sender {client_id!r}")
        if state.is_resend(group.actor_id, group.seq):
            state.resend(group.actor_id, group.seq)
            return
        state.store(holder, group, frames)
        self._changed.add(holder)

    def give_back(self, holder: bytes, credit_ids: list[int]) -> None:
        """Credits an actor will not use: their prompts are re-issued."""
        self.state.give_back(holder, credit_ids)
        self._changed.add(holder)

    def grant(self) -> list[tuple[bytes, Credits]]:
        """Top up each actor's credit window as far as admission allows, one message each.

        Each actor's share is bounded by the window at the version it will generate with
        (`grant`, `generation_version`), which it reports in WeightsLoaded and heartbeats. An
        actor is topped up once a quarter of its window is free (`refill_at`), not after every
        group.
        """
        for holder in self._changed:
            self._refresh(holder)
        self._changed.clear()
        if not self.slots:
            return []
        state, v = self.state, self.policy_version
        buffer, in_flight = state.buffer, state.credits.outstanding
        eta, steps = self.max_staleness, self.groups_per_step

        def room_at(loaded_version: int) -> int:
            return room(buffer, in_flight, eta, steps, generation_version(v, loaded_version))

        floor = weights_floor(v, eta, self.publish_every)
        out = []
        for holder, n in self.slots.grant(room_at).items():
            items = tuple(state.issue(holder, n))
            credits = Credits(
                group_size=self.group_size,
                policy_version=v,
                items=items,
                min_weights_version=floor,
            )
            out.append((holder, credits))
            self._refresh(holder)
        return out

    def _refresh(self, holder: bytes) -> None:
        """How far `holder` may be topped up now, from the credits it holds."""
        window = self._windows.get(holder)
        if window is not None:
            free = window - self.state.credits.held_by(holder)
            self.slots.set(holder, free if free >= refill_at(window) else 0)

    # --- versions and batches -------------------------------------------------------------------

    def adopt_version(self, policy_version: int, rewind: bool = False) -> None:
        """The learner's version (Version, SampleRequest, a learner's Heartbeat): groups now too
        stale are dropped and their prompts re-issued; see `HubState.adopt_version`."""
        self.state.adopt_version(policy_version, rewind)

    def request(self, identity: bytes, msg: SampleRequest, now: float) -> None:
        """A SampleRequest: adopt its version, park it until `serve` can answer it."""
        capacity = self.state.buffer.capacity
        if not 1 <= msg.num_groups <= capacity:
            raise ProtocolError("num_groups", f"must be in [1, {capacity}], got {msg.num_groups}")
        self.adopt_version(msg.policy_version, rewind=True)
        self.parked.append(Parked(identity, msg, now))

    def serve(self, now: float, durable_lsn: float = math.inf) -> list[tuple[bytes, Batch]]:
        """Batches for the parked requests, in arrival order, while enough eligible groups
        exist (and their records are durable: lsn <= `durable_lsn`)."""
        out = []
        state = self.state
        while self.parked:
            parked = self.parked[0]
            dropped_stale = state.dropped_since_batch
            request = parked.request
            groups = state.hand_out(request.request_id, request.num_groups, durable_lsn)
            if not groups:
                break
            self.parked.popleft()
            batch = Batch(
                request_id=request.request_id,
                policy_version=self.policy_version,
                groups=tuple(groups),
                dropped_stale=dropped_stale,
                wait_s=now - parked.since,
            )
            out.append((parked.identity, batch))
        return out

    def trained(self, request_id: int) -> None:
        """A BatchAck: the batches up to `request_id` are trained on, gone for good."""
        self.state.trained(request_id)
