"""Admission control: AReaL's window, capacity, the reuse limiter, fair allocation, and the
credit book with the prompt source behind it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.prompt_records import Prompt
from replay.core import CreditBook, allocate, credits_available
from replay.prompts import PromptSource, credit_seed, load_dataset


def available(**kw: Any) -> int:
    base = dict(
        policy_version=0,
        max_staleness=0,
        groups_per_step=4,
        consumed=0,
        ready=0,
        in_flight=0,
        stored=0,
        capacity=1000,
    )
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
    eta=st.integers(0, 5),
    version=st.integers(0, 50),
    batch=st.integers(1, 16),
    consumed=st.integers(0, 900),
    ready=st.integers(0, 100),
    in_flight=st.integers(0, 100),
)
def test_admitted_work_never_exceeds_the_window(
    eta: int, version: int, batch: int, consumed: int, ready: int, in_flight: int
) -> None:
    n = available(
        max_staleness=eta,
        policy_version=version,
        groups_per_step=batch,
        consumed=consumed,
        ready=ready,
        in_flight=in_flight,
        stored=ready,
    )
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


# --- credits and the prompt source behind them --------------------------------------------------


def source(n: int = 3) -> PromptSource:
    return PromptSource([Prompt(f"p{i}", f"prompt {i}") for i in range(n)], seed=7)


def test_credit_book_spends_returns_and_expires_with_reissue_first() -> None:
    book = CreditBook(source(), incarnation=5)
    a = book.issue(b"a", 2)
    b = book.issue(b"b", 1)
    assert [c.prompt_id for c in a + b] == ["p0", "p1", "p2"] and book.outstanding == 3
    assert all(book.is_current(c.credit_id) for c in a) and not book.is_current(9 << 32 | 1)
    assert not book.spend(b"b", a[0].credit_id)  # not b's credit
    assert book.spend(b"a", a[0].credit_id) and not book.spend(b"a", a[0].credit_id)
    assert book.give_back(b"a", [a[1].credit_id, 12345]) == 1
    assert book.expire(b"b") == 1 and book.outstanding == 0
    again = book.issue(b"c", 3)  # re-issued prompts come before the cursor moves on
    assert [c.prompt_id for c in again] == ["p1", "p2", "p0"]
    assert again[0].seed != a[1].seed  # a second attempt at p1 gets its own seed
    assert (book.num_issued, book.num_returned, book.num_expired) == (6, 1, 1)


def test_seeds_are_a_pure_function_of_prompt_and_attempt() -> None:
    first, second = source(), source()
    assert [first.next_prompt()[1] for _ in range(6)] == [second.next_prompt()[1] for _ in range(6)]
    assert first.epoch == 2
    assert credit_seed(7, "p0", 0) == credit_seed(7, "p0", 0) != credit_seed(7, "p0", 1)


def test_dataset_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt_id": "a", "prompt": "x"}\n\n{"prompt_id": 3, "prompt": "y"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:3: prompt_id must be a string"):
        load_dataset(path)
    path.write_text('{"prompt_id": "a", "prompt": "x"}\nnot json\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: not valid JSON"):
        load_dataset(path)
    path.write_text('{"prompt_id": "a", "prompt": "x"}\n{"prompt_id": "a", "prompt": "y"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: duplicate prompt_id"):
        load_dataset(path)
    path.write_text('{"prompt_id": "a", "prompt": "x", "info": {"k": 1}}\n')
    assert load_dataset(path) == [Prompt("a", "x", {"k": 1})]
