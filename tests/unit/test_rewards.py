"""Rewards: the sort verifier's partial-credit rule and the never-raising `safe_score` guard."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.envs.sort_task import SortVerifier, make_verifier
from actors.rewards.pipeline import RewardResult, safe_score
from asyncrl.config import TaskConfig

INFO = {"digits": "3141", "answer": "1134"}


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("1134<eos>", 1.0),
        ("1134", 1.0),
        ("3141<eos>", 0.5 * 1 / 4 + 0.5 * 1.0),  # right digits, one in place
        ("1143<eos>", 0.5 * 2 / 4 + 0.5 * 1.0),
        ("11345<eos>", 0.5 * 4 / 5 + 0.5 * 4 / 5),  # an extra digit costs like a missing one
        ("11<eos>", 0.5 * 2 / 4 + 0.5 * 2 / 4),
        ("<eos>", 0.0),
        ("9999<eos>", 0.0),
    ],
)
def test_sort_reward_rule(completion: str, reward: float) -> None:
    result = SortVerifier().score("3141:", completion, INFO)
    assert result.reward == pytest.approx(reward)
    assert not result.failed


def test_answer_is_recomputed_from_digits() -> None:
    assert SortVerifier().score("3141:", "1134", {"digits": "3141"}).reward == 1.0


@given(
    st.text(alphabet="0123456789: <>eosunk", max_size=12),
    st.text("0123456789", min_size=1, max_size=8),
)
def test_sort_reward_is_in_range_and_one_only_when_exact(completion: str, digits: str) -> None:
    info = {"digits": digits, "answer": "".join(sorted(digits))}
    result = safe_score(SortVerifier(), digits + ":", completion, info)
    assert 0.0 <= result.reward <= 1.0 and not result.failed
    exact = completion.split("<eos>")[0].strip() == info["answer"]
    assert (result.reward == 1.0) == exact


def test_make_verifier() -> None:
    assert isinstance(make_verifier(TaskConfig()), SortVerifier)


class _Raising:
    def score(self, prompt: str, completion: str, info: dict[str, Any]) -> RewardResult:
        raise KeyError("boom")


class _Returning:
    def __init__(self, value: Any) -> None:
        self.value = value

    def score(self, prompt: str, completion: str, info: dict[str, Any]) -> RewardResult:
        return self.value


def test_safe_score_maps_an_exception_to_zero() -> None:
    result = safe_score(_Raising(), "p", "c", {})
    assert result.reward == 0.0 and "KeyError" in result.failed


def test_safe_score_maps_a_missing_answer_to_zero() -> None:
    result = safe_score(SortVerifier(), "p", "c", {})
    assert result.reward == 0.0 and "ValueError" in result.failed


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (RewardResult(math.nan), "not finite"),
        (RewardResult(math.inf), "not finite"),
        (RewardResult("1"), "not a number"),  # type: ignore[arg-type]
        (RewardResult(True), "not a number"),
        (0.5, "returned float"),
    ],
)
def test_safe_score_maps_bad_rewards_to_zero(value: Any, reason: str) -> None:
    result = safe_score(_Returning(value), "p", "c", {})
    assert result.reward == 0.0 and reason in result.failed


def test_safe_score_passes_good_rewards_through() -> None:
    good = RewardResult(0.25, {"k": 1})
    assert safe_score(_Returning(good), "p", "c", {}) == good


@pytest.mark.parametrize("value", [1.5, -0.1, -7.0, 123.25])
def test_safe_score_accepts_any_finite_reward(value: float) -> None:
    assert safe_score(_Returning(RewardResult(value)), "p", "c", {}).reward == value
