"""The learner's sections: the policy loss (`loss`), the optimizer loop (`learner`) and weight
broadcast (`weights`). Loaded and composed by asyncrl/config.py."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from asyncrl.config_checks import require


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The policy loss family of DESIGN §5 behind one signature."""

    name: Literal[
        "ppo", "decoupled_ppo", "truncated_is", "masked_is", "gspo", "cispo", "m2po", "stale_clip"
    ] = "decoupled_ppo"
    """Which objective: plain PPO/GRPO clip, AReaL's decoupled PPO, truncated IS, masked IS
    (IcePop-style two-sided mask), sequence-level geometric-mean ratio (GSPO), CISPO, M2PO's
    second-moment masking, or PPO with a clip range that shrinks with each token's staleness."""
    clip_low: float = 0.2
    """ε_low: the ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.28
    """ε_high (clip-higher): the ratio is clipped above at 1 + clip_high."""
    is_cap: float = 2.0
    """C: truncated IS weight min(π_prox/μ, C); decoupled PPO masks tokens with π_prox/μ > C."""
    mask_low: float = 0.5
    """α of masked IS: tokens with ratio < α are masked."""
    mask_high: float = 2.0
    """β of masked IS: tokens with ratio > β are masked."""
    m2_bound: float = 0.04
    """τ of m2po: the fewest tokens of largest (log π_prox/μ)² are masked so that the kept
    tokens' mean of (log π_prox/μ)² stays <= τ (M2PO's value: 0.04)."""
    clip_lag_scale: float = 0.1
    """κ of stale_clip: a token made `lag` versions before the one trained has its clip ranges
    multiplied by 1 + κ·lag (κ >= 0: wider for staler tokens) or divided by 1 + |κ|·lag
    (κ < 0: narrower); 0 = plain ppo."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "dr_grpo"] = "token_mean"
    """How token losses become one number."""
    adv_std_norm: bool = True
    """Divide group-centred rewards by the group's std (GRPO); off = Dr.GRPO style."""

    def __post_init__(self) -> None:
        require(0 <= self.clip_low < 1, "loss.clip_low", "must be in [0, 1)", self.clip_low)
        require(self.clip_high >= 0, "loss.clip_high", "must be >= 0", self.clip_high)
        require(self.is_cap >= 1, "loss.is_cap", "must be >= 1", self.is_cap)
        require(0 <= self.mask_low <= 1, "loss.mask_low", "must be in [0, 1]", self.mask_low)
        require(self.mask_high >= 1, "loss.mask_high", "must be >= 1", self.mask_high)
        require(self.m2_bound > 0, "loss.m2_bound", "must be > 0", self.m2_bound)
        require(
            math.isfinite(self.clip_lag_scale),
            "loss.clip_lag_scale",
            "must be a finite number",
            self.clip_lag_scale,
        )


@dataclass(frozen=True, kw_only=True)
class LearnerConfig:
    """The training loop."""

    groups_per_step: int = 8
    """Groups (prompts) per optimizer step; the hub's admission rule uses it too."""
    micro_batch_samples: int = 64
    """Samples per forward/backward micro-batch (gradients accumulate across them)."""
    share_prompt: bool = True
    """Score each group's prompt once: pack it with its completions into one row, each
    completion attending to the prompt and to itself only (same log-probs and gradients as one
    row per sample; the prompt's share of the learner's compute drops by the group size)."""
    packed_row_tokens: int = 256
    """Longest packed row (tokens) with share_prompt: completions that do not fit start another
    row with the prompt again. Attention in a row costs its length squared."""
    minibatches: int = 1
    """Optimizer steps per batch (PPO minibatches, AReaL's ppo_n_minibatches): the batch's rows
    are split into this many parts, one AdamW step each. π_prox is the policy at the batch's
    start (one extra no-grad forward when > 1), so from the second minibatch on the clip on
    π_θ/π_prox binds; with 1, π_prox = π_θ.detach() and costs nothing."""
    max_steps: int = 200
    """Optimizer steps before the learner stops."""
    lr: float = 1e-3
    """AdamW learning rate."""
    lr_staleness_decay: float = 0.0
    """κ: each step's learning rate is lr / (1 + κ·ℓ), ℓ = the mean version lag of the batch's
    produced tokens (the version trained minus the one that made the token); 0 = constant."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 = off)."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps (0 = only at the end)."""
    publish_every: int = 1
    """Publish weights to actors every N steps."""
    world: int = 1
    """Learner ranks (torch.distributed world size): FSDP2 over gloo on CPU, nccl on GPU.
    `asyncrl learner` starts this many local ranks itself, or joins the ranks a launcher
    (torchrun, srun) started through RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the learner trains: `auto` = this rank's GPU (LOCAL_RANK) when CUDA is present,
    else the CPU."""
    dist_timeout_s: float = 3600.0
    """Timeout of the learner ranks' collectives (s); ranks > 0 wait in one while rank 0
    waits for data, so it must exceed the longest wait for a batch."""
    wait_actors_s: float = 600.0
    """Before its first step the learner waits up to this long for run.num_actors actors to
    connect, so that every actor holds the starting weights and a short run does not end before
    an actor that is still loading its engine has joined. Past it, the learner starts with the
    actors connected by then and says how many are missing (0 = do not wait)."""

    def __post_init__(self) -> None:
        require(
            self.groups_per_step >= 1,
            "learner.groups_per_step",
            "must be >= 1",
            self.groups_per_step,
        )
        require(
            self.micro_batch_samples >= 1,
            "learner.micro_batch_samples",
            "must be >= 1",
            self.micro_batch_samples,
        )
        require(
            1 <= self.minibatches <= self.groups_per_step,
            "learner.minibatches",
            "must be between 1 and learner.groups_per_step",
            self.minibatches,
        )
        require(
            self.packed_row_tokens >= 1,
            "learner.packed_row_tokens",
            "must be >= 1",
            self.packed_row_tokens,
        )
        require(self.max_steps >= 1, "learner.max_steps", "must be >= 1", self.max_steps)
        require(self.lr > 0, "learner.lr", "must be > 0", self.lr)
        require(self.grad_clip >= 0, "learner.grad_clip", "must be >= 0", self.grad_clip)
        require(
            self.checkpoint_every >= 0,
            "learner.checkpoint_every",
            "must be >= 0",
            self.checkpoint_every,
        )
        require(
            self.publish_every >= 1, "learner.publish_every", "must be >= 1", self.publish_every
        )
        require(self.world >= 1, "learner.world", "must be >= 1", self.world)
        require(
            self.dist_timeout_s > 0, "learner.dist_timeout_s", "must be > 0", self.dist_timeout_s
        )
        require(
            self.groups_per_step >= self.world,
            "learner.groups_per_step",
            f"must be >= learner.world ({self.world}): every rank trains on whole groups",
            self.groups_per_step,
        )
        require(
            self.wait_actors_s >= 0, "learner.wait_actors_s", "must be >= 0", self.wait_actors_s
        )
        require(
            self.lr_staleness_decay >= 0,
            "learner.lr_staleness_decay",
            "must be >= 0",
            self.lr_staleness_decay,
        )


@dataclass(frozen=True, kw_only=True)
class WeightsConfig:
    """Weight broadcast from the learner to the actors."""

    backend: Literal["gloo", "nccl"] = "gloo"
    """Transfer backend: gloo (CPU, torch.distributed) or nccl (GPU, cupy)."""
    bucket_bytes: int = 64 * 1024 * 1024
    """Largest flat bucket in bytes; parameters are packed by dtype in a fixed order."""
    timeout_s: float = 60.0
    """A broadcast or group formation slower than this aborts and re-forms without laggards."""
    host: str = "127.0.0.1"
    """Address the learner's rendezvous store listens on (announced through the hub)."""

    def __post_init__(self) -> None:
        require(
            self.bucket_bytes >= 1024, "weights.bucket_bytes", "must be >= 1024", self.bucket_bytes
        )
        require(self.timeout_s > 0, "weights.timeout_s", "must be > 0", self.timeout_s)
