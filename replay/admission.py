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

Three more limits: the buffer's capacity (stored + in flight never exceeds it, so a group that
arrives with a valid credit always has room), the buffer's reuse limiter (`insert_room`), and the
actors' own concurrency (an actor never holds more credits than it said it can generate at
once). Pure functions, no state.
"""

from __future__ import annotations

from collections.abc import Mapping


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


def allocate(total: int, free_slots: Mapping[str, int]) -> dict[str, int]:
    """Share `total` credits among actors by free slots (concurrency - outstanding), fairly.

    Round-robin one credit at a time over actors with free slots, emptiest first, so a fast
    actor cannot take the whole window while a slow one idles. Actors given nothing are left out.
    """
    grant: dict[str, int] = {}
    slots = {actor: n for actor, n in free_slots.items() if n > 0}
    order = sorted(slots, key=lambda actor: (-slots[actor], actor))
    while total > 0 and order:
        still = []
        for actor in order:
            if total == 0:
                break
            grant[actor] = grant.get(actor, 0) + 1
            total -= 1
            if grant[actor] < slots[actor]:
                still.append(actor)
        order = still
    return grant
