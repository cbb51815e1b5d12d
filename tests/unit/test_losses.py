"""The loss family against the formulas, written out in plain Python (math, lists), not torch.

The reference below is a direct transcription of the formulas of DESIGN §5 one token at a time;
a few cases also carry literal numbers worked out by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config import LossConfig
from learner.losses import policy_loss

NAMES = ["ppo", "decoupled_ppo", "truncated_is", "masked_is", "gspo", "cispo"]
AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "dr_grpo"]

# Two sequences of three tokens; the second has one padding token. Chosen so that tokens land
# inside and outside the clip range, above and below is_cap, with positive and negative A.
LP = [[-1.0, -0.5, -2.0], [-0.3, -1.2, 9.9]]
PROX = [[-1.1, -0.9, -1.0], [-0.3, -0.4, 0.0]]
BEH = [[-1.2, -0.6, -2.9], [-0.2, -1.5, 0.0]]
ADV = [1.0, -0.5]
MASK = [[1, 1, 1], [1, 1, 0]]


def _clip(x: float, cfg: LossConfig) -> float:
    return min(max(x, 1 - cfg.clip_low), 1 + cfg.clip_high)


def _surrogate(ratio: float, a: float, cfg: LossConfig) -> float:
    return -min(ratio * a, _clip(ratio, cfg) * a)


def ref_token_losses(
    cfg: LossConfig, lp: list, prox: list, beh: list, adv: list, mask: list
) -> list:
    """Token losses [B][T] (0 outside the mask) straight from the formulas."""
    out = []
    for b, row in enumerate(mask):
        a = adv[b]
        used = [t for t, keep in enumerate(row) if keep]
        if cfg.name == "gspo":
            s = math.exp(sum(lp[b][t] - beh[b][t] for t in used) / len(used))
            out.append([_surrogate(s, a, cfg) if keep else 0.0 for keep in row])
            continue
        losses = []
        for t, keep in enumerate(row):
            rho = math.exp(lp[b][t] - beh[b][t])
            r = math.exp(lp[b][t] - prox[b][t])
            w = math.exp(prox[b][t] - beh[b][t])
            if not keep:
                loss = 0.0
            elif cfg.name == "ppo":
                loss = _surrogate(rho, a, cfg)
            elif cfg.name == "decoupled_ppo":
                loss = 0.0 if w > cfg.is_cap else _surrogate(r, a, cfg) * w
            elif cfg.name == "truncated_is":
                loss = _surrogate(r, a, cfg) * min(w, cfg.is_cap)
            elif cfg.name == "masked_is":
                loss = _surrogate(r, a, cfg) if cfg.mask_low <= w <= cfg.mask_high else 0.0
            else:  # cispo: weight clipped and treated as a constant, times log π
                loss = -_clip(rho, cfg) * a * lp[b][t]
            losses.append(loss)
        out.append(losses)
    return out


def ref_aggregate(
    cfg: LossConfig, losses: list, mask: list, n_seq: float, t_max: float, n_tok: float
) -> float:
    if cfg.aggregation == "token_mean":
        return sum(map(sum, losses)) / n_tok
    if cfg.aggregation == "seq_mean_token_mean":
        return sum(sum(row) / sum(m) for row, m in zip(losses, mask, strict=True)) / n_seq
    return sum(map(sum, losses)) / (n_seq * t_max)


def _tensors(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    lp = torch.tensor(LP, dtype=dtype, requires_grad=True)
    return (
        lp,
        torch.tensor(PROX, dtype=dtype),
        torch.tensor(BEH, dtype=dtype),
        torch.tensor(ADV, dtype=dtype),
        torch.tensor(MASK, dtype=dtype),
    )


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_each_objective_and_aggregation_matches_the_formulas(name: str, aggregation: str) -> None:
    cfg = LossConfig(name=name, aggregation=aggregation)
    loss, _ = policy_loss(*_tensors(), cfg)
    expected = ref_aggregate(cfg, ref_token_losses(cfg, LP, PROX, BEH, ADV, MASK), MASK, 2, 3, 5)
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_ppo_single_token_by_hand() -> None:
    # ratio e^0.5 = 1.6487 > 1 + 0.28 and A = 2 > 0: the clipped term 1.28 * 2 wins.
    loss, stats = policy_loss(
        torch.tensor([[-0.5]], requires_grad=True),
        None,
        torch.tensor([[-1.0]]),
        torch.tensor([2.0]),
        torch.tensor([[1.0]]),
        LossConfig(name="ppo"),
    )
    assert loss.item() == pytest.approx(-2.56, rel=1e-6)
    assert stats["clipped_frac"] == 1.0
    loss.backward()  # clipped: no gradient


def test_decoupled_ppo_by_hand() -> None:
    # token 1: r = e^0.1, w = e^0.1, A = 1 -> -(e^0.1 * e^0.1) = -e^0.2 (inside the clip range)
    # token 2: w = e^1.0 = 2.718 > is_cap = 2 -> dropped, but still counted in the token mean
    lp = torch.tensor([[-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    prox = torch.tensor([[-1.1, -1.0]], dtype=torch.float64)
    beh = torch.tensor([[-1.2, -2.0]], dtype=torch.float64)
    loss, stats = policy_loss(lp, prox, beh, torch.tensor([1.0]), torch.ones(1, 2), LossConfig())
    assert loss.item() == pytest.approx(-math.exp(0.2) / 2, rel=1e-12)
    assert stats["masked_frac"] == 0.5
    loss.backward()
    assert lp.grad[0, 1].item() == 0.0
    assert lp.grad[0, 0].item() == pytest.approx(-math.exp(0.2) / 2, rel=1e-12)


def test_gspo_uses_the_geometric_mean_ratio_by_hand() -> None:
    # log ratios 0.2, 0.1, 0.9 -> s = e^0.4 = 1.4918 > 1.28, A = 1: loss -1.28 per sequence.
    # second sequence: log ratios -0.1, 0.3 -> s = e^0.1 = 1.1052 (inside), A = -0.5.
    cfg = LossConfig(name="gspo", aggregation="seq_mean_token_mean")
    loss, stats = policy_loss(*_tensors(), cfg)
    assert loss.item() == pytest.approx((-1.28 + 0.5 * math.exp(0.1)) / 2, rel=1e-12)
    assert stats["clipped_frac"] == pytest.approx(3 / 5)  # the first sequence's 3 tokens


def test_cispo_keeps_gradient_on_clipped_tokens() -> None:
    # ρ = e^0.5 clipped to 1.28; gradient of -sg(w) A log π is -1.28 * A / N per token.
    lp = torch.tensor([[-0.5, -1.0]], dtype=torch.float64, requires_grad=True)
    beh = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    loss, stats = policy_loss(
        lp, None, beh, torch.tensor([2.0]), torch.ones(1, 2), LossConfig(name="cispo")
    )
    assert loss.item() == pytest.approx((-1.28 * 2 * -0.5 - 1.0 * 2 * -1.0) / 2, rel=1e-12)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-1.28, -1.0], rel=1e-12)
    assert stats["clipped_frac"] == 0.5


def test_aggregations_by_hand_with_unit_ratios() -> None:
    # π = π_prox = μ, so every token loss is -A_bt; row 0 has 3 tokens, row 1 has 1.
    adv = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 9.0, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float64)
    lp = torch.zeros(2, 4, dtype=torch.float64, requires_grad=True)
    zeros = torch.zeros(2, 4, dtype=torch.float64)

    def run(aggregation: str, **kw: int) -> float:
        cfg = LossConfig(name="ppo", aggregation=aggregation)
        return policy_loss(lp, zeros, zeros, adv, mask, cfg, **kw)[0].item()

    assert run("token_mean") == pytest.approx(-10 / 4)
    assert run("token_mean", num_tokens_total=20) == pytest.approx(-10 / 20)
    assert run("seq_mean_token_mean") == pytest.approx(-(6 / 3 + 4 / 1) / 2)
    assert run("seq_mean_token_mean", num_samples_total=8) == pytest.approx(-(2 + 4) / 8)
    assert run("dr_grpo") == pytest.approx(-10 / (2 * 4))
    assert run("dr_grpo", num_samples_total=4, max_tokens=16) == pytest.approx(-10 / 64)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_sum_to_the_whole_batch(name: str, aggregation: str) -> None:
    gen = torch.Generator().manual_seed(0)
    beh = -torch.rand(4, 5, generator=gen, dtype=torch.float64) * 2
    prox = beh + 0.3 * torch.randn(4, 5, generator=gen, dtype=torch.float64)
    lp = (prox + 0.3 * torch.randn(4, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(4, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    cfg = LossConfig(name=name, aggregation=aggregation)
    glob = {"num_samples_total": 4, "max_tokens": 5, "num_tokens_total": int(mask.sum())}
    whole, _ = policy_loss(lp, prox, beh, adv, mask, cfg, **glob)
    (whole_grad,) = torch.autograd.grad(whole, lp)
    parts = [
        policy_loss(lp[s], prox[s], beh[s], adv[s], mask[s], cfg, **glob)[0]
        for s in (slice(0, 1), slice(1, 4))
    ]
    total = parts[0] + parts[1]
    (parts_grad,) = torch.autograd.grad(total, lp)
    assert total.item() == pytest.approx(whole.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(parts_grad, whole_grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", NAMES)
def test_padding_is_ignored_even_when_non_finite(name: str) -> None:
    lp, prox, beh, adv, mask = _tensors()
    clean, _ = policy_loss(lp, prox, beh, adv, mask, LossConfig(name=name))
    dirty_lp = torch.tensor(LP, dtype=torch.float64)
    dirty_lp[1, 2] = float("nan")
    dirty_lp.requires_grad_()
    prox2, beh2 = prox.clone(), beh.clone()
    prox2[1, 2], beh2[1, 2] = float("inf"), float("-inf")
    dirty, _ = policy_loss(dirty_lp, prox2, beh2, adv, mask.bool(), LossConfig(name=name))
    assert dirty.item() == pytest.approx(clean.item(), rel=1e-12)
    dirty.backward()
    assert torch.isfinite(dirty_lp.grad).all()
    assert dirty_lp.grad[1, 2].item() == 0.0


def test_empty_mask_gives_zero_loss_and_zero_diagnostics() -> None:
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, stats = policy_loss(
        lp, lp.detach(), lp.detach(), torch.ones(2), torch.zeros(2, 3), LossConfig()
    )
    loss.backward()
    assert loss.item() == 0.0
    assert lp.grad.abs().sum().item() == 0.0
    assert all(v == 0.0 for v in stats.values())


def test_diagnostics_by_hand() -> None:
    cfg = LossConfig(name="decoupled_ppo")
    _, stats = policy_loss(*_tensors(), cfg)
    d = [0.1, -0.3, 1.9, -0.1, 1.1]  # log π_prox - log μ over the five produced tokens
    w = [math.exp(x) for x in d]
    assert stats["is_weight_mean"] == pytest.approx(sum(w) / 5, rel=1e-12)
    assert stats["is_weight_max"] == pytest.approx(math.exp(1.9), rel=1e-12)
    assert stats["ess"] == pytest.approx(sum(w) ** 2 / (5 * sum(x * x for x in w)), rel=1e-12)
    assert stats["mismatch_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 5, rel=1e-12)
    r = [0.1, 0.4, -1.0, 0.0, -0.8]  # log π - log π_prox
    assert stats["ratio_mean"] == pytest.approx(sum(math.exp(x) for x in r) / 5, rel=1e-12)
    # w > 2 drops tokens (0, 2) and (1, 1); of the rest only (0, 1) has its clip active
    assert stats["masked_frac"] == pytest.approx(2 / 5)
    assert stats["clipped_frac"] == pytest.approx(1 / 5)
    assert stats["num_tokens"] == 5.0
    assert all(isinstance(v, float) for v in stats.values())


def test_masked_is_and_ppo_diagnostics() -> None:
    _, stats = policy_loss(*_tensors(), LossConfig(name="masked_is", mask_low=0.8, mask_high=1.5))
    # w = e^0.1, e^-0.3 (0.74 < 0.8), e^1.9, e^-0.1, e^1.1: three outside [0.8, 1.5]
    assert stats["masked_frac"] == pytest.approx(3 / 5)
    _, stats = policy_loss(*_tensors(), LossConfig(name="ppo"))
    assert stats["masked_frac"] == 0.0
    # ρ = e^0.2, e^0.1, e^0.9 (A = 1: clipped), e^-0.1, e^0.3 (A < 0: unclipped term is lower)
    assert stats["clipped_frac"] == pytest.approx(1 / 5)
    assert stats["ratio_mean"] == pytest.approx(
        sum(math.exp(x) for x in (0.2, 0.1, 0.9, -0.1, 0.3)) / 5
    )


def test_without_proximal_the_weights_are_one() -> None:
    lp, _, beh, adv, mask = _tensors()
    _, stats = policy_loss(lp, None, beh, adv, mask, LossConfig(name="gspo"))
    assert stats["is_weight_mean"] == 1.0
    assert stats["ess"] == pytest.approx(1.0)
    assert stats["mismatch_kl"] == 0.0


@pytest.mark.parametrize("name", ["ppo", "decoupled_ppo", "gspo", "cispo"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_gradients_match_finite_differences(name: str, aggregation: str) -> None:
    lp, prox, beh, adv, mask = _tensors()
    if name == "cispo":
        # the weight is detached; finite differences see it only where it is clipped (constant)
        beh = lp.detach() - torch.tensor([[0.5, -0.5, 0.7], [-0.9, 0.6, 0.0]], dtype=torch.float64)
    adv2 = adv[:, None] * torch.tensor([[1.0, 0.5, 2.0]], dtype=torch.float64)  # token advantages
    cfg = LossConfig(name=name, aggregation=aggregation)
    for a in (adv, adv2):
        assert torch.autograd.gradcheck(
            lambda x, a=a: policy_loss(x, prox, beh, a, mask, cfg)[0], (lp,)
        )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"logprobs": torch.zeros(2, 3, 1)}, "logprobs: must have shape"),
        ({"logprobs": torch.zeros(2, 3, dtype=torch.long)}, "logprobs: must be a floating"),
        ({"behavior_logprobs": torch.zeros(2, 4)}, "behavior_logprobs: shape"),
        ({"proximal_logprobs": torch.zeros(3, 3)}, "proximal_logprobs: shape"),
        ({"proximal_logprobs": None}, "proximal_logprobs: required"),
        ({"advantages": torch.zeros(3)}, "advantages: must have shape"),
        ({"mask": torch.ones(2, 2)}, "mask: shape"),
        ({"mask": torch.full((2, 3), 0.5)}, "mask: values must be 0 or 1"),
        ({"mask": [[1, 1, 1], [1, 1, 1]]}, "mask: must be a torch.Tensor"),
        ({"advantages": torch.tensor([1.0, float("nan")])}, "advantages: must be finite"),
        (
            {"behavior_logprobs": torch.full((2, 3), float("-inf"))},
            "behavior_logprobs: must be finite",
        ),
        ({"logprobs": torch.full((2, 3), float("nan"))}, "logprobs: must be finite"),
    ],
)
def test_bad_inputs_name_the_argument(change: dict, match: str) -> None:
    args = dict(
        zip(
            ["logprobs", "proximal_logprobs", "behavior_logprobs", "advantages", "mask"],
            _tensors(torch.float32),
            strict=True,
        )
    )
    args.update(change)
    with pytest.raises(ValueError, match=match):
        policy_loss(cfg=LossConfig(), **args)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_samples_total": 0}, "num_samples_total: must be > 0"),
        ({"num_samples_total": 1}, "num_samples_total: must be >= the batch"),
        ({"max_tokens": -1}, "max_tokens: must be > 0"),
        ({"num_tokens_total": 0}, "num_tokens_total: must be > 0"),
    ],
)
def test_bad_counts_are_refused(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        policy_loss(*_tensors(), LossConfig(), **kw)
