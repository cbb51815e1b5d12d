"""Group-relative advantages: the critic-free baseline of GRPO and Dr.GRPO.

The unit of data is a group: all `n` samples drawn for one prompt. A sample's advantage is its
reward minus the mean reward of its group, optionally divided by the group's standard deviation:

    GRPO     (std_norm=True):   A_ij = (r_ij - mean_j r_i) / (std_j r_i + eps)
    Dr.GRPO  (std_norm=False):  A_ij =  r_ij - mean_j r_i

The standard deviation is the unbiased one (Bessel's correction, `torch.std`), as in TRL and
veRL. A group of one sample has no baseline and gets advantage 0. A group whose rewards are all
equal gets advantage 0 either way (it carries no learning signal; `eps` keeps the division
finite). Advantages are per sequence; `policy_loss` broadcasts them over the sequence's tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, std_norm: bool, eps: float = 1e-6) -> Tensor:
    """Advantages [G, n] from rewards [G, n] (G groups of n samples each).

    `std_norm=True` is GRPO (centred and scaled by the group's std); False is Dr.GRPO (centred
    only, which avoids up-weighting groups whose rewards barely differ).
    """
    if not isinstance(rewards, Tensor):
        raise ValueError(f"rewards: must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards: must have shape [groups, group_size], got {tuple(rewards.shape)}"
        )
    if not rewards.is_floating_point():
        raise ValueError(f"rewards: must be a floating point tensor, got {rewards.dtype}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards: must be finite (found nan or inf)")
    if eps <= 0:
        raise ValueError(f"eps: must be > 0, got {eps!r}")
    if rewards.shape[1] == 1:
        return torch.zeros_like(rewards)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not std_norm:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)
