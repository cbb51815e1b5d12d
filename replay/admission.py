"""Admission control at the source: how many credits the hub may have out at once.

AReaL's rule, in groups. With the learner at policy version v, staleness bound η and B groups
per optimizer step, the groups ever admitted may not run more than η + 1 steps ahead of what
the learner has taken:

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
actors' own concurrency (an actor never holds more credits than it said it can generate at
once). `CreditBook` keeps the outstanding credits themselves. No sockets, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from asyncrl.protocol.group_codec import new_message
from asyncrl.protocol.messages import CreditItem
from replay.buffer import ReplayBuffer
from replay.prompts import PromptSource

K = TypeVar("K")  # whatever names an actor (the hub: its routing id)


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


def grant(
    buffer: ReplayBuffer,
    in_flight: int,
    max_staleness: int,
    groups_per_step: int,
    free_slots: Mapping[K, int],
    versions: Mapping[K, int],
) -> dict[K, int]:
    """New credits per actor: `allocate` with each actor capped by the window at its version.

    `versions[actor]` is `generation_version(...)` of each actor in `free_slots`.
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


class CreditBook:
    """Outstanding credits: which holder (a routing id) may push a group for which prompt.

    Credit ids carry the hub's incarnation in their high 32 bits, so a group for a credit of an
    earlier hub process is recognised as such (see asyncrl/hub_connection.py for what the hub
    does with it) instead of being confused with a forged or spent credit of this one. A hub
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
