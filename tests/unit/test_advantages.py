"""Group-relative advantages against values worked out by hand."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from learner.step import group_advantages


def test_grpo_centres_and_scales_by_unbiased_group_std() -> None:
    rewards = [[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]]
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64), std_norm=True, eps=1e-6)
    for g, row in enumerate(rewards):
        mean = sum(row) / len(row)
        std = statistics.stdev(row)  # Bessel-corrected, as torch.std
        for i, r in enumerate(row):
            assert got[g, i].item() == pytest.approx((r - mean) / (std + 1e-6), rel=1e-12)
    # the first group by hand: mean 0.5, stdev sqrt(1/3)
    assert got[0, 0].item() == pytest.approx(0.5 / (math.sqrt(1 / 3) + 1e-6), rel=1e-12)


def test_dr_grpo_only_centres() -> None:
    got = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0], [5.0, 7.0, 5.0, 7.0]]), False)
    expected = [[0.75, -0.25, -0.25, -0.25], [-1.0, 1.0, -1.0, 1.0]]
    assert got.tolist() == expected


def test_equal_rewards_give_zero_and_stay_finite() -> None:
    got = group_advantages(torch.full((3, 4), 0.7), std_norm=True)
    assert torch.isfinite(got).all()
    assert got.abs().max().item() < 1e-5


def test_group_of_one_has_no_baseline() -> None:
    got = group_advantages(torch.tensor([[1.0], [0.0]]), std_norm=True)
    assert got.tolist() == [[0.0], [0.0]]


def test_rows_are_independent_groups() -> None:
    a = torch.tensor([[1.0, 2.0, 3.0]])
    b = torch.tensor([[10.0, -4.0, 0.5]])
    both = group_advantages(torch.cat([a, b]), std_norm=True)
    assert torch.equal(both[0], group_advantages(a, True)[0])
    assert torch.equal(both[1], group_advantages(b, True)[0])


@pytest.mark.parametrize(
    ("rewards", "match"),
    [
        (torch.zeros(4), "rewards: must have shape"),
        (torch.zeros(2, 2, 2), "rewards: must have shape"),
        (torch.tensor([[1.0, float("nan")]]), "rewards: must be finite"),
        (torch.tensor([[1, 0]]), "rewards: must be a floating point"),
        ([[1.0, 0.0]], "rewards: must be a torch.Tensor"),
    ],
)
def test_bad_rewards_are_refused(rewards: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, std_norm=True)  # type: ignore[arg-type]


def test_bad_eps_is_refused() -> None:
    with pytest.raises(ValueError, match="eps"):
        group_advantages(torch.zeros(1, 2), std_norm=True, eps=0.0)
