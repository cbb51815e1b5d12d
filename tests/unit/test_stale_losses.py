"""The losses for high staleness (m2po, stale_clip) against numbers worked out by hand.

m2po: d = log π_prox - log μ; the fewest tokens of largest d² are dropped so that the kept
tokens' mean d² is <= τ; the kept ones get decoupled PPO's -min(r A, clip(r) A) · w.
stale_clip: PPO on ρ = π_θ/μ whose clip ranges are multiplied by 1 + κ·lag (κ ≥ 0) or divided
by 1 + |κ|·lag (κ < 0), lag per token.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncrl.config import LossConfig
from asyncrl.protocol.codec import decode, encode
from asyncrl.protocol.messages import Group, Trajectory
from learner.losses import policy_loss
from learner.step import collate

# d = PROX - BEH = [[0.5, -0.1, 0.0], [0.3, 0.05, pad]]; d² = 0.25, 0.01, 0, 0.09, 0.0025
# (sum 0.3525, mean 0.0705). Dropping 0.25 leaves 0.1025 / 4 = 0.025625; then 0.09: 0.0125 / 3.
PROX = [[-1.0, -0.6, -2.0], [-0.7, -1.15, 0.0]]
BEH = [[-1.5, -0.5, -2.0], [-1.0, -1.2, math.inf]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [1.0, -0.5]


def _m2po(bound: float) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    prox = torch.tensor(PROX, dtype=torch.float64)
    lp = prox.clone().requires_grad_(True)  # one optimizer step per batch: π_θ = π_prox, r = 1
    cfg = LossConfig(name="m2po", m2_bound=bound)
    beh = torch.tensor(BEH, dtype=torch.float64)
    loss, stats = policy_loss(
        lp, prox, beh, torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK), cfg
    )
    loss.backward()
    assert lp.grad is not None
    return loss, stats, lp.grad


@pytest.mark.parametrize(("bound", "dropped"), [(0.1, 0), (0.04, 1), (0.02563, 1), (0.0256, 2)])
def test_m2po_drops_the_fewest_tokens_of_largest_second_moment(bound: float, dropped: int) -> None:
    _, stats, grad = _m2po(bound)
    assert stats["masked_frac"] == pytest.approx(dropped / 5)
    zero = (grad == 0) & torch.tensor(MASK, dtype=torch.bool)
    expected = [(0, 0), (1, 0)][:dropped]  # d² = 0.25 first, then 0.09
    assert sorted(map(tuple, zero.nonzero().tolist())) == expected


def test_m2po_loss_by_hand() -> None:
    """τ = 0.04: token (0, 0) dropped; the others weigh -A · w, w = e^d; token mean over 5:
    (-(e^-0.1 + e^0) · 1 + 0.5 · (e^0.3 + e^0.05)) / 5 = (-1.904837 + 1.200565) / 5."""
    loss, stats, grad = _m2po(0.04)
    assert loss.item() == pytest.approx(-0.1408544, abs=1e-6)
    # ∂/∂lp of -A · r · w at r = 1 is -A · w / N
    assert grad[0, 1].item() == pytest.approx(-math.exp(-0.1) / 5, rel=1e-9)
    assert grad[1, 0].item() == pytest.approx(0.5 * math.exp(0.3) / 5, rel=1e-9)
    assert grad[1, 2].item() == 0.0  # padding (its μ is even infinite)
    assert stats["is_weight_max"] == pytest.approx(math.exp(0.5))  # before the mask


def test_m2po_without_staleness_is_decoupled_ppo() -> None:
    lp = torch.tensor([[-1.0, -0.3], [-2.0, -0.1]], requires_grad=True)
    args = (lp.detach(), lp.detach(), torch.tensor([1.0, -1.0]), torch.ones(2, 2))
    m2po, stats = policy_loss(lp, *args, LossConfig(name="m2po"))
    assert m2po.item() == policy_loss(lp, *args, LossConfig(name="decoupled_ppo"))[0].item()
    assert stats["masked_frac"] == 0.0


def _stale_clip(ratio: float, adv: float, lag: int, kappa: float) -> tuple[float, float]:
    """(loss, ∂loss/∂log π_θ) of one token with ρ = `ratio`."""
    beh = torch.tensor([[-1.0]], dtype=torch.float64)
    lp = (beh + math.log(ratio)).requires_grad_(True)
    cfg = LossConfig(name="stale_clip", clip_lag_scale=kappa)
    loss, _ = policy_loss(
        lp,
        None,
        beh,
        torch.tensor([adv], dtype=torch.float64),
        torch.ones(1, 1),
        cfg,
        token_lag=torch.tensor([[lag]]),
    )
    loss.backward()
    assert lp.grad is not None
    return loss.item(), lp.grad.item()


def test_stale_clip_shrinks_the_clip_range_with_the_lag() -> None:
    """ε_high = 0.28, ε_low = 0.2, κ = -0.25. At lag 2 the range is divided by 1.5:
    [1 - 0.2/1.5, 1 + 0.28/1.5] = [0.866667, 1.186667]."""
    assert _stale_clip(1.2, 1.0, 0, -0.25) == pytest.approx((-1.2, -1.2))  # inside [0.8, 1.28]
    assert _stale_clip(1.2, 1.0, 2, -0.25) == pytest.approx((-1.186667, 0.0), abs=1e-6)
    assert _stale_clip(0.85, -1.0, 0, -0.25) == pytest.approx((0.85, 0.85))
    assert _stale_clip(0.85, -1.0, 2, -0.25) == pytest.approx((0.866667, 0.0), abs=1e-6)
    assert _stale_clip(0.85, 1.0, 8, -0.25) == pytest.approx((-0.85, -0.85))  # min keeps ρ A
    assert _stale_clip(1.2, 1.0, 8, 0.0) == pytest.approx((-1.2, -1.2))  # plain ppo


def test_stale_clip_widens_the_clip_range_with_the_lag() -> None:
    """κ = 0.25: lag 2 multiplies the ranges by 1.5, [0.7, 1.42]; lag 4 by 2, [0.6, 1.56]."""
    assert _stale_clip(1.5, 1.0, 0, 0.25) == pytest.approx((-1.28, 0.0))
    assert _stale_clip(1.5, 1.0, 2, 0.25) == pytest.approx((-1.42, 0.0))
    assert _stale_clip(1.5, 1.0, 4, 0.25) == pytest.approx((-1.5, -1.5))
    assert _stale_clip(0.65, -1.0, 2, 0.25) == pytest.approx((0.7, 0.0))
    assert _stale_clip(0.65, -1.0, 4, 0.25) == pytest.approx((0.65, 0.65))


def test_stale_clip_needs_nonnegative_lags() -> None:
    lp, one = torch.zeros(1, 2), torch.ones(1, 2)
    cfg = LossConfig(name="stale_clip")
    with pytest.raises(ValueError, match="token_lag: required"):
        policy_loss(lp, None, lp, torch.ones(1), one, cfg)
    with pytest.raises(ValueError, match="token_lag: must be >= 0"):
        policy_loss(lp, None, lp, torch.ones(1), one, cfg, token_lag=torch.tensor([[0, -1]]))
    with pytest.raises(ValueError, match="token_lag: shape"):
        policy_loss(lp, None, lp, torch.ones(1), one, cfg, token_lag=torch.zeros(2, 2).long())
    loss, _ = policy_loss(
        lp,
        None,
        lp,
        torch.ones(1),
        torch.tensor([[1.0, 0.0]]),
        cfg,
        token_lag=torch.tensor([[0, -5]]),
    )
    assert loss.item() == -1.0  # one produced token, ρ = 1; a negative lag on padding is ignored


def test_a_trajectory_spanning_two_versions_is_clipped_token_by_token() -> None:
    """Tokens 0-1 made by version 3, tokens 2-3 by version 6 (an in-flight update); trained
    at version 7 the lags are [4, 4, 1, 1], so with κ = -0.25 the upper clip is 1 + 0.28/2 =
    1.14 on the old tokens and 1 + 0.28/1.25 = 1.224 on the new ones. Every token has
    ρ = 1.2, A = 1: the old tokens are clipped (no gradient), the new ones are not."""
    traj = Trajectory(
        tokens=np.array([1, 2, 5, 6, 7, 8], np.int32),
        prompt_len=2,
        loss_mask=np.ones(4, np.uint8),
        behavior_logprobs=np.full(4, -1.0, np.float32),
        reward=1.0,
        min_policy_version=3,
        max_policy_version=6,
        finish_reason="length",
        version_spans=(0, 3, 2, 6),
    )
    group = Group.build(
        group_id="g", prompt_id="p", credit_id=0, actor_id="a", seq=0, trajectories=[traj]
    )
    batch = collate([decode(encode(group))], pad_id=0)
    assert batch.token_versions.tolist() == [[3, 3, 6, 6]]
    lag = 7 - batch.token_versions
    lp = (batch.behavior_logprobs.double() + math.log(1.2)).requires_grad_(True)
    loss, stats = policy_loss(
        lp,
        None,
        batch.behavior_logprobs.double(),
        torch.tensor([1.0], dtype=torch.float64),
        batch.mask,
        LossConfig(name="stale_clip", clip_lag_scale=-0.25),
        token_lag=lag,
    )
    loss.backward()
    assert lp.grad is not None
    assert lp.grad.tolist()[0] == pytest.approx([0.0, 0.0, -1.2 / 4, -1.2 / 4])
    assert loss.item() == pytest.approx(-(1.14 * 2 + 1.2 * 2) / 4)
    assert stats["clipped_frac"] == 0.5


@pytest.mark.parametrize(
    ("key", "value"), [("m2_bound", 0.0), ("m2_bound", -1.0), ("clip_lag_scale", math.inf)]
)
def test_bad_values_fail_naming_the_key(key: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"loss.{key}"):
        LossConfig(**{key: value})


def test_lr_staleness_decay_must_not_be_negative() -> None:
    from asyncrl.config import LearnerConfig

    assert LearnerConfig(lr_staleness_decay=0.5).lr_staleness_decay == 0.5
    with pytest.raises(ValueError, match="learner.lr_staleness_decay"):
        LearnerConfig(lr_staleness_decay=-1.0)
