"""How the hub's loop paces its work: how many messages one turn handles (`turn_messages`)
and when an actor's credits are topped up (`refill_at`). Plain arithmetic, no state; the
figures behind each choice come from bench/transport.py."""

from __future__ import annotations

TURN_MESSAGES_MIN, TURN_MESSAGES_MAX = 16, 2000


def turn_messages(groups_per_step: int, num_clients: int) -> int:
    """How many waiting messages one turn of the hub's loop handles before it grants credits
    and serves parked sample requests: one learner step's worth of groups, and at least one
    message per client (the work between turns grows with the clients).

    Handling a whole burst instead (up to TURN_MESSAGES_MAX) leaves the learner waiting for a
    batch whose groups are already here, and the actors for the credits those groups freed,
    while only the hub works: with 32 KB groups on two CPUs, one of them then idled a sixth of
    the time, and the hub moved 15 % fewer groups per second (bench/transport.py)."""
    return min(TURN_MESSAGES_MAX, max(TURN_MESSAGES_MIN, groups_per_step, num_clients))


def refill_at(window: int) -> int:
    """Free credit slots an actor's window needs before the hub tops it up: a quarter of it.

    The actor still holds three quarters of its window meanwhile (two credits per group it
    generates at once, by default: `actor.credit_window`), so it never waits for one, and it
    gets one Credits message (one wake-up) per quarter window instead of one per group. With
    2 MB groups (32 credits out) that was one grant, one message and one actor wake-up per
    group, ~50 us of the hub loop's ~350 per group (bench/transport.py)."""
    return max(1, window // 4)
