"""The policy-gradient loss family of asyncrl, behind one signature (`policy_loss`).

Three policies meet in an asynchronous learner:

    π_θ     `logprobs`            the policy being trained (carries the gradient)
    π_prox  `proximal_logprobs`   the parameters at the start of this optimizer step (detached);
                                  with one optimizer step per batch this is `logprobs.detach()`
    μ       `behavior_logprobs`   the actor's logprobs, recorded when the tokens were sampled

All tensors are [B, T] over completion tokens; `mask` marks the tokens the model produced. With
r = π_θ/π_prox, ρ = π_θ/μ, w = π_prox/μ (detached) and clip(x) = clip(x, 1 - ε_low, 1 + ε_high)
(clip-higher: ε_high may exceed ε_low), the per-token losses are:

    ppo            -min(ρ A, clip(ρ) A)                 μ is the old policy; no correction
    decoupled_ppo  -min(r A, clip(r) A) · w             AReaL; tokens with w > is_cap dropped
    truncated_is   -min(r A, clip(r) A) · min(w, C)     C = is_cap
    masked_is      -min(r A, clip(r) A) · 1[α ≤ w ≤ β]  α = mask_low, β = mask_high
    gspo           -min(s A, clip(s) A) per sequence,   s = exp(mean_t (log π_θ - log μ)),
                   the geometric mean of ρ over the sequence's tokens (GSPO with μ as old)
    cispo          -sg(clip(ρ)) · A · log π_θ           MiniMax-M1's CISPO: the IS weight is taken
                   against the behaviour policy μ, clipped and detached, so every token keeps a
                   gradient (through log π_θ); set clip_low near 1 for the paper's upper-only clip
    m2po           -min(r A, clip(r) A) · w · k         M2PO: k = 0 for the fewest tokens of largest
                   d² (d = log π_prox - log μ) such that the kept tokens' second moment
                   Σ k d² / Σ k stays ≤ τ = m2_bound; keeps w uncapped otherwise
    stale_clip     -min(ρ A, clip_ℓ(ρ) A)               PPO whose clip ranges scale with the token's
                   version lag ℓ (`token_lag`): clip_ℓ(x) = clip(x, 1 - ε_low s, 1 + ε_high s),
                   s = 1 + κ ℓ (κ = clip_lag_scale ≥ 0: the trust region around μ widens with
                   staleness) or s = 1 / (1 + |κ| ℓ) (κ < 0: it shrinks); κ = 0 or ℓ = 0 is ppo

Masked IS is the IcePop-style two-sided mask (tokens with π_prox/μ outside [α, β] dropped).
M2PO's mask is chosen over the tokens of one call: pass the whole step's batch in one call (one
micro-batch) for the paper's batch-level bound; with several micro-batches each keeps its own
second moment under τ. Per token: sort the produced tokens by d² descending, s_1 ≥ ... ≥ s_n;
drop the first j, j the smallest with Σ_{i>j} s_i ≤ τ (n - j) (j = 0 when the mean is ≤ τ).
`token_lag` [B, T] is the policy version being trained minus the version that produced each
token (0 for fresh tokens; a trajectory updated in flight has two or more lags).

GSPO's sequence loss is written on each of the sequence's tokens, so the aggregations below
apply to it unchanged (seq_mean_token_mean gives exactly the mean of sequence losses). Token
advantages [B, T] are averaged over the sequence's tokens for GSPO.

Aggregation (`cfg.aggregation`), where L_bt is the token loss, m_bt the mask:

    token_mean           Σ m L / N_tok                    N_tok = num_tokens_total or Σ m
    seq_mean_token_mean  Σ_b (Σ_t m L / Σ_t m) / N_seq    N_seq = num_samples_total or B
    dr_grpo              Σ m L / (N_seq · T_max)          T_max = max_tokens or T

Tokens dropped by an IS mask contribute zero but stay in the denominators (as in AReaL): the
denominators depend only on which tokens were produced, never on the policy.

Micro-batching: the denominators are the only non-additive part. Pass the step's global
constants (num_tokens_total = produced tokens over the whole step, num_samples_total = its
samples, max_tokens = the generation limit) with every micro-batch; then the micro-batch losses
(and their gradients) sum to the loss of the whole batch. Under data parallelism, where the
gradient all-reduce averages over W ranks, pass the global counts divided by W (or scale the
loss by W). An argument the chosen aggregation does not use is ignored, so a learner can always
pass all three.

Diagnostics (plain floats, over produced tokens; zeros when there are none): `is_weight_mean`,
`is_weight_max` (w = π_prox/μ before any cap), `ess` = (Σw)² / (n Σw²) (effective sample size
as a fraction of n), `clipped_frac` (the clip bound is active: the token's gradient is zeroed by
the clip, or for CISPO its weight was clipped), `masked_frac` (dropped by an IS mask),
`mismatch_kl` = mean(exp(d) - 1 - d) with d = log π_prox - log μ (Schulman's k3 estimator of
KL(μ ‖ π_prox), unbiased under samples from μ, never negative), `ratio_mean` (the mean of the
ratio the objective clips: ρ, r or s), `num_tokens` and `loss`. With `proximal_logprobs=None`
(allowed for ppo, gspo and cispo, which never read it) the IS diagnostics use π_prox = μ.
Entropy needs the full distribution and is computed by the learner, not here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from asyncrl.config import LossConfig

NEEDS_PROXIMAL = ("decoupled_ppo", "truncated_is", "masked_is", "m2po")
"""Losses that use π_prox (the others ignore it)."""
NEEDS_LAG = ("stale_clip",)
"""Losses that use each token's version lag (`token_lag`)."""


class TokenTerms(NamedTuple):
    """What an objective returns per token, before aggregation."""

    loss: Tensor
    """[B, T] token losses (zero outside the mask and where an IS mask drops the token)."""
    ratio: Tensor
    """[B, T] the ratio the objective clips (detached), for diagnostics."""
    clipped: Tensor
    """[B, T] bool: the clip bound is active."""
    dropped: Tensor
    """[B, T] bool: removed by an IS mask."""


def policy_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor | None,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    *,
    num_samples_total: int | None = None,
    max_tokens: int | None = None,
    num_tokens_total: float | None = None,
    token_lag: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The scalar loss of `cfg.name` aggregated by `cfg.aggregation`, and its diagnostics.

    Shapes: logprobs, proximal_logprobs, behavior_logprobs, mask [B, T]; advantages [B] or
    [B, T]; token_lag [B, T] (needed by stale_clip only). Values outside the mask are ignored
    (they may be padding, even non-finite).
    """
    _validate_counts(num_samples_total, max_tokens, num_tokens_total, logprobs)
    m = _validate_inputs(logprobs, proximal_logprobs, behavior_logprobs, advantages, mask, cfg)
    lag = _validate_lag(token_lag, m, cfg)
    lp = torch.where(m, logprobs, torch.zeros_like(logprobs))
    beh = torch.where(m, behavior_logprobs.detach(), 0.0)
    prox = beh if proximal_logprobs is None else torch.where(m, proximal_logprobs.detach(), 0.0)
    adv = advantages.detach()
    adv = torch.where(m, adv if adv.dim() == 2 else adv[:, None].expand_as(lp), 0.0)
    if cfg.name not in _OBJECTIVES:
        raise ValueError(f"cfg.name: unknown loss {cfg.name!r} (known: {', '.join(_OBJECTIVES)})")
    if cfg.name == "stale_clip":
        terms = _stale_clip(lp, beh, adv, m, cfg, lag)
    else:
        terms = _OBJECTIVES[cfg.name](lp, prox, beh, adv, m, cfg)
    mf = m.to(lp.dtype)
    loss = _aggregate(terms.loss * mf, mf, cfg, num_samples_total, max_tokens, num_tokens_total)
    stats = _diagnostics(terms, prox, beh, m)
    stats["loss"] = float(loss.detach())
    return loss, stats


def _clip_surrogate(
    ratio: Tensor, adv: Tensor, cfg: LossConfig, scale: Tensor | float = 1.0
) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic surrogate -min(ratio A, clip(ratio) A) and where the clip is active;
    `scale` multiplies both clip ranges (per token when a tensor)."""
    unclipped = ratio * adv
    low, high = 1.0 - cfg.clip_low * scale, 1.0 + cfg.clip_high * scale
    clipped = torch.clamp(ratio, low, high) * adv
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def _ppo(
    lp: Tensor, prox: Tensor, beh: Tensor, adv: Tensor, m: Tensor, cfg: LossConfig
) -> TokenTerms:
    ratio = torch.exp(lp - beh)
    loss, clipped = _clip_surrogate(ratio, adv, cfg)
    return TokenTerms(loss, ratio.detach(), clipped, torch.zeros_like(m))


def _decoupled(
    lp: Tensor, prox: Tensor, beh: Tensor, adv: Tensor, m: Tensor, cfg: LossConfig
) -> TokenTerms:
    """Shared by decoupled_ppo, truncated_is and masked_is: clip on π/π_prox, weight by w."""
    ratio = torch.exp(lp - prox)
    loss, clipped = _clip_surrogate(ratio, adv, cfg)
    w = torch.exp(prox - beh)
    if cfg.name == "decoupled_ppo":
        dropped = w > cfg.is_cap
        weight = torch.where(dropped, 0.0, w)
    elif cfg.name == "truncated_is":
        dropped = torch.zeros_like(m)
        weight = torch.clamp(w, max=cfg.is_cap)
    elif cfg.name == "m2po":
        dropped = _m2_mask(prox - beh, m, cfg.m2_bound)
        weight = torch.where(dropped, 0.0, w)
    else:
        assert cfg.name == "masked_is", cfg.name
        dropped = (w < cfg.mask_low) | (w > cfg.mask_high)
        weight = (~dropped).to(lp.dtype)
    return TokenTerms(loss * weight, ratio.detach(), clipped & ~dropped, dropped & m)


@torch.no_grad()
def _m2_mask(d: Tensor, m: Tensor, bound: float) -> Tensor:
    """[B, T] bool: M2PO's dropped tokens, the fewest of largest d² leaving Σ d² / n ≤ bound."""
    sq = torch.where(m, d.double() ** 2, -1.0).flatten()  # padding sorts last, never dropped
    order = torch.argsort(sq, descending=True, stable=True)
    s = sq[order][: int(m.sum())]
    n = s.shape[0]
    left = s.sum() - torch.cat([s.new_zeros(1), torch.cumsum(s, 0)])  # Σ_{i>j} s_i, j = 0..n
    kept = torch.arange(n, -1, -1, dtype=s.dtype)  # n - j
    j = int(torch.nonzero(left <= bound * kept + 1e-12)[0])  # j = n always qualifies
    dropped = torch.zeros_like(sq, dtype=torch.bool)
    dropped[order[:j]] = True
    return dropped.view_as(m)


def _stale_clip(
    lp: Tensor, beh: Tensor, adv: Tensor, m: Tensor, cfg: LossConfig, lag: Tensor
) -> TokenTerms:
    ratio = torch.exp(lp - beh)
    kappa_lag = abs(cfg.clip_lag_scale) * lag.to(lp.dtype)
    scale = 1.0 + kappa_lag if cfg.clip_lag_scale >= 0 else 1.0 / (1.0 + kappa_lag)
    loss, clipped = _clip_surrogate(ratio, adv, cfg, scale)
    return TokenTerms(loss, ratio.detach(), clipped, torch.zeros_like(m))


def _gspo(
    lp: Tensor, prox: Tensor, beh: Tensor, adv: Tensor, m: Tensor, cfg: LossConfig
) -> TokenTerms:
    mf = m.to(lp.dtype)
    num = mf.sum(dim=1).clamp(min=1.0)
    seq_ratio = torch.exp(((lp - beh) * mf).sum(dim=1) / num)
    seq_adv = (adv * mf).sum(dim=1) / num
    seq_loss, seq_clipped = _clip_surrogate(seq_ratio, seq_adv, cfg)
    expand = torch.ones_like(lp)
    clipped = seq_clipped[:, None].expand_as(m) & m
    ratio = seq_ratio.detach()[:, None] * expand
    return TokenTerms(seq_loss[:, None] * expand, ratio, clipped, torch.zeros_like(m))


def _cispo(
    lp: Tensor, prox: Tensor, beh: Tensor, adv: Tensor, m: Tensor, cfg: LossConfig
) -> TokenTerms:
    ratio = torch.exp(lp - beh).detach()
    weight = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    clipped = (weight != ratio) & m
    return TokenTerms(-weight * adv * lp, ratio, clipped, torch.zeros_like(m))


_Objective = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, LossConfig], TokenTerms]
_OBJECTIVES: dict[str, _Objective] = {
    "ppo": _ppo,
    "decoupled_ppo": _decoupled,
    "truncated_is": _decoupled,
    "masked_is": _decoupled,
    "gspo": _gspo,
    "cispo": _cispo,
    "m2po": _decoupled,
    "stale_clip": _ppo,  # dispatched with the lags in policy_loss; listed for the name check
}


def _aggregate(
    token_loss: Tensor,
    mf: Tensor,
    cfg: LossConfig,
    num_samples_total: int | None,
    max_tokens: int | None,
    num_tokens_total: float | None,
) -> Tensor:
    """One scalar from masked token losses [B, T]; see the module docstring for the formulas."""
    batch, width = token_loss.shape
    num_seq = float(num_samples_total if num_samples_total is not None else batch)
    if cfg.aggregation == "token_mean":
        num_tok = num_tokens_total if num_tokens_total is not None else float(mf.sum())
        return token_loss.sum() / max(num_tok, 1.0)
    if cfg.aggregation == "seq_mean_token_mean":
        per_seq = token_loss.sum(dim=1) / mf.sum(dim=1).clamp(min=1.0)
        return per_seq.sum() / num_seq
    if cfg.aggregation == "dr_grpo":
        return token_loss.sum() / (num_seq * float(max_tokens if max_tokens is not None else width))
    raise ValueError(f"cfg.aggregation: unknown aggregation {cfg.aggregation!r}")


@torch.no_grad()
def _diagnostics(terms: TokenTerms, prox: Tensor, beh: Tensor, m: Tensor) -> dict[str, float]:
    n = int(m.sum())
    if n == 0:
        keys = ("is_weight_mean", "is_weight_max", "ess", "clipped_frac", "masked_frac")
        return {k: 0.0 for k in (*keys, "mismatch_kl", "ratio_mean", "num_tokens")}
    d = (prox - beh)[m].double()
    w = torch.exp(d)
    return {
        "is_weight_mean": float(w.mean()),
        "is_weight_max": float(w.max()),
        "ess": float(w.sum() ** 2 / (n * (w * w).sum())),
        "clipped_frac": float(terms.clipped[m].sum()) / n,
        "masked_frac": float(terms.dropped[m].sum()) / n,
        "mismatch_kl": float((w - 1.0 - d).mean()),
        "ratio_mean": float(terms.ratio[m].double().mean()),
        "num_tokens": float(n),
    }


def _validate_inputs(
    logprobs: Tensor,
    proximal_logprobs: Tensor | None,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
) -> Tensor:
    """Check shapes, dtypes and finiteness under the mask; return the mask as bool [B, T]."""
    _check_tensor("logprobs", logprobs, floating=True)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs: must have shape [B, T], got {tuple(logprobs.shape)}")
    shape = logprobs.shape
    _check_tensor("mask", mask, floating=False)
    if mask.shape != shape:
        raise ValueError(f"mask: shape {tuple(mask.shape)} != logprobs shape {tuple(shape)}")
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask: values must be 0 or 1")
    m = mask.to(device=logprobs.device, dtype=torch.bool)
    if proximal_logprobs is None and cfg.name in NEEDS_PROXIMAL:
        raise ValueError(f"proximal_logprobs: required by loss {cfg.name!r}")
    named = {"behavior_logprobs": behavior_logprobs, "proximal_logprobs": proximal_logprobs}
    for name, tensor in named.items():
        if tensor is None:
            continue
        _check_tensor(name, tensor, floating=True)
        if tensor.shape != shape:
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} != logprobs shape {tuple(shape)}"
            )
    _check_tensor("advantages", advantages, floating=True)
    if advantages.shape not in (shape, shape[:1]):
        raise ValueError(
            f"advantages: must have shape [B] or [B, T] = {tuple(shape)}, got {tuple(advantages.shape)}"
        )
    row_used = m.any(dim=1)
    named |= {"logprobs": logprobs, "advantages": advantages}
    for name, tensor in named.items():
        if tensor is None:
            continue
        used = m if tensor.dim() == 2 else row_used
        if not bool(torch.isfinite(tensor.detach()[used]).all()):
            raise ValueError(f"{name}: must be finite where mask is set (found nan or inf)")
    return m


def _validate_lag(token_lag: Tensor | None, m: Tensor, cfg: LossConfig) -> Tensor:
    """token_lag as a [B, T] tensor (zeros when not given to a loss that ignores it)."""
    if token_lag is None:
        if cfg.name in NEEDS_LAG:
            raise ValueError(f"token_lag: required by loss {cfg.name!r}")
        return torch.zeros(m.shape, dtype=torch.int64, device=m.device)
    _check_tensor("token_lag", token_lag, floating=False)
    if token_lag.shape != m.shape:
        raise ValueError(
            f"token_lag: shape {tuple(token_lag.shape)} != logprobs shape {tuple(m.shape)}"
        )
    if bool((token_lag[m] < 0).any()):
        raise ValueError("token_lag: must be >= 0 where mask is set")
    return torch.where(m, token_lag.to(m.device), 0)


def _check_tensor(name: str, value: object, *, floating: bool) -> None:
    if not isinstance(value, Tensor):
        raise ValueError(f"{name}: must be a torch.Tensor, got {type(value).__name__}")
    if floating and not value.is_floating_point():
        raise ValueError(f"{name}: must be a floating point tensor, got {value.dtype}")


def _validate_counts(
    num_samples_total: int | None,
    max_tokens: int | None,
    num_tokens_total: float | None,
    logprobs: object,
) -> None:
    for name, value in (
        ("num_samples_total", num_samples_total),
        ("max_tokens", max_tokens),
        ("num_tokens_total", num_tokens_total),
    ):
        if value is not None and (isinstance(value, bool) or not value > 0):
            raise ValueError(f"{name}: must be > 0, got {value!r}")
    if num_samples_total is not None and isinstance(logprobs, Tensor) and logprobs.dim() == 2:
        if num_samples_total < logprobs.shape[0]:
            raise ValueError(
                f"num_samples_total: must be >= the batch's {logprobs.shape[0]} samples, "
                f"got {num_samples_total}"
            )
