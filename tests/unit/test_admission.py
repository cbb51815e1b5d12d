"""Admission control: AReaL's window, capacity, the reuse limiter and fair allocation."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from replay.admission import allocate, credits_available


def available(**kw: Any) -> int:
    base = dict(policy_version=0, max_staleness=0, groups_per_step=4, consumed=0, ready=0,
                in_flight=0, stored=0, capacity=1000)  # fmt: skip
    return credits_available(**{**base, **kw})


def test_eta_zero_admits_one_step_at_a_time() -> None:
    assert available() == 4
    assert available(in_flight=4) == 0  # the whole step is being generated
    assert available(ready=4) == 0  # the whole step is waiting for the learner
    assert available(consumed=4) == 0  # taken, but the learner has not reported version 1
    assert available(consumed=4, policy_version=1) == 4  # next step's groups
    assert available(consumed=3, ready=1, policy_version=1) == 4


def test_eta_lets_actors_run_ahead_by_eta_steps() -> None:
    assert available(max_staleness=2) == 12
    # (η + v + 1) * B = 32 groups admitted in all by version 5
    assert available(max_staleness=2, policy_version=5, consumed=20, ready=3, in_flight=5) == 4
    assert available(max_staleness=2, policy_version=5, consumed=20) == 12
    assert available(max_staleness=2, policy_version=5, consumed=32) == 0


def test_capacity_bounds_stored_plus_in_flight() -> None:
    assert available(max_staleness=100, capacity=10) == 10
    assert available(max_staleness=100, capacity=10, stored=6, ready=6, in_flight=3) == 1
    assert available(max_staleness=100, insert_room=5, in_flight=2) == 3


def test_never_negative() -> None:
    assert available(consumed=50) == 0
    assert available(stored=2000) == 0


@settings(max_examples=200, deadline=None)
@given(
    eta=st.integers(0, 5), version=st.integers(0, 50), batch=st.integers(1, 16),
    consumed=st.integers(0, 900), ready=st.integers(0, 100), in_flight=st.integers(0, 100),
)  # fmt: skip
def test_admitted_work_never_exceeds_the_window(
    eta: int, version: int, batch: int, consumed: int, ready: int, in_flight: int
) -> None:
    n = available(max_staleness=eta, policy_version=version, groups_per_step=batch,
                  consumed=consumed, ready=ready, in_flight=in_flight, stored=ready)  # fmt: skip
    assert n >= 0
    if n > 0:
        assert (
            consumed + ready + in_flight + n == (eta + version + 1) * batch
            or ready + in_flight + n == 1000
        )


def test_allocate_respects_free_slots_and_is_fair() -> None:
    assert allocate(10, {"a": 2, "b": 8}) == {"a": 2, "b": 8}
    assert allocate(4, {"a": 4, "b": 4}) == {"a": 2, "b": 2}
    assert allocate(3, {"a": 0, "b": 5, "c": 1}) == {"b": 2, "c": 1}
    assert allocate(0, {"a": 3}) == {}
    assert allocate(5, {}) == {}


@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(0, 50),
    slots=st.dictionaries(st.text(max_size=3), st.integers(-2, 10), max_size=5),
)
def test_allocate_never_overfills(total: int, slots: dict[str, int]) -> None:
    grant = allocate(total, slots)
    assert sum(grant.values()) == min(total, sum(max(0, n) for n in slots.values()))
    assert all(0 < grant[a] <= slots[a] for a in grant)
