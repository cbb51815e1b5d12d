"""Time models of the simulator: response lengths, one generation batch, one learner step,
one weight publication.

Each model is a frozen dataclass with few parameters so that `calibrate.py` can fit them to
measured runs and `cluster.py` can derive them from hardware figures.

- Generation (continuous batching, decode-bound): every decode step emits one token for each
  sequence still running and costs ``step_s + token_s * running``. Summed over the steps of a
  batch this is exactly ``fixed_s + step_s * max(len) + token_s * sum(len)`` (plus prefill): the
  batch ends when its longest sample ends, so a long tail costs ``step_s`` per tail token while
  the batch's other slots sit empty.
- Learner step: ``overhead_s + tokens * token_s / world + allreduce_s + snapshot_s`` where
  `tokens` counts prompt and completion tokens of the whole batch (data-parallel ranks share
  them evenly) and `snapshot_s` is the copy of the weights into staging buffers (the only part of
  a publication the learner waits for).
- Weight publication: ``total_bytes / bandwidth + num_buckets * bucket_latency_s``; actors keep
  generating with old weights meanwhile (non-blocking).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True)
class LengthModel:
    """Completion lengths in tokens: resampled from measured lengths, else a clipped lognormal."""

    measured: tuple[int, ...] = ()
    """Measured completion lengths; when given they are resampled and the lognormal is unused."""
    median_tokens: float = 1024.0
    """Lognormal median completion length in tokens."""
    sigma: float = 0.9
    """Lognormal shape (std of log length): 0 = constant length, ~1 = a long tail."""
    max_tokens: int = 8192
    """Generation limit (actor.max_new_tokens): longer samples are truncated here."""
    prompt_tokens: int = 256
    """Prompt length in tokens (constant)."""

    def __post_init__(self) -> None:
        if self.median_tokens < 1 or self.sigma < 0 or self.max_tokens < 1:
            raise ValueError(f"lengths: need median >= 1, sigma >= 0, max >= 1, got {self}")
        if self.measured and min(self.measured) < 1:
            raise ValueError("lengths.measured: lengths must be >= 1 token")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` completion lengths (int64, in [1, max_tokens])."""
        if self.measured:
            return rng.choice(np.asarray(self.measured, dtype=np.int64), size=n)
        if self.sigma == 0:
            return np.full(n, min(round(self.median_tokens), self.max_tokens), dtype=np.int64)
        raw = rng.lognormal(math.log(self.median_tokens), self.sigma, size=n)
        return np.clip(np.rint(raw), 1, self.max_tokens).astype(np.int64)

    def mean_tokens(self) -> float:
        """Expected completion length (analytic for the unclipped lognormal)."""
        if self.measured:
            return float(np.mean(self.measured))
        return min(self.median_tokens * math.exp(self.sigma**2 / 2), float(self.max_tokens))


@dataclass(frozen=True, kw_only=True)
class GenerationTime:
    """Seconds for one actor to generate one batch of sequences."""

    fixed_s: float = 0.0
    """Per-batch overhead: scheduling, detokenising, scoring, pushing."""
    step_s: float = 0.0
    """Cost of one decode step regardless of batch size (reading the weights once)."""
    token_s: float = 0.0
    """Marginal cost of one generated token in a decode step (KV reads, per-token compute)."""
    prefill_token_s: float = 0.0
    """Cost per prompt token (prefill)."""

    def __post_init__(self) -> None:
        if min(self.fixed_s, self.step_s, self.token_s, self.prefill_token_s) < 0:
            raise ValueError(f"generation: every coefficient must be >= 0, got {self}")

    def seconds(self, lengths: Sequence[int], prompt_tokens: int) -> float:
        """Time of a batch with these completion lengths (one prompt per sequence)."""
        return (
            self.fixed_s
            + self.step_s * max(lengths)
            + self.token_s * sum(lengths)
            + self.prefill_token_s * (prompt_tokens * len(lengths))
        )


@dataclass(frozen=True, kw_only=True)
class LearnerTime:
    """Seconds of one optimizer step over `tokens` tokens on `world` data-parallel ranks."""

    world: int = 1
    """Learner ranks L (data parallel: tokens are split evenly)."""
    overhead_s: float = 0.0
    """Fixed per-step cost: optimizer update, collation, launch latencies."""
    token_s: float = 0.0
    """Seconds per token on one rank (forward + backward)."""
    allreduce_s: float = 0.0
    """Exposed gradient reduction time per step (not hidden behind backward)."""
    snapshot_s: float = 0.0
    """Copying weights into staging buffers before a publication; the learner waits for it."""

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"learner.world: must be >= 1, got {self.world}")
        if min(self.overhead_s, self.token_s, self.allreduce_s, self.snapshot_s) < 0:
            raise ValueError(f"learner: every time must be >= 0, got {self}")

    def seconds(self, tokens: int) -> float:
        """Step time for a batch holding `tokens` tokens in all."""
        compute = self.token_s * tokens / self.world
        return self.overhead_s + compute + self.allreduce_s + self.snapshot_s


@dataclass(frozen=True, kw_only=True)
class WeightSync:
    """One publication: all buckets from the learner to every actor (broadcast)."""

    total_bytes: int = 0
    """Bytes of all parameters (the bucket plan's total_bytes)."""
    num_buckets: int = 0
    """Buckets in the plan; each pays `bucket_latency_s`."""
    bandwidth_bytes_per_s: float = math.inf
    """Bottleneck link bandwidth of the broadcast (pipelined: independent of receivers)."""
    bucket_latency_s: float = 0.0
    """Per-bucket start-up cost (announce, collective launch, tree depth latency)."""

    def __post_init__(self) -> None:
        if self.total_bytes < 0 or self.num_buckets < 0 or self.bucket_latency_s < 0:
            raise ValueError(f"sync: sizes and latency must be >= 0, got {self}")
        if self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"sync.bandwidth_bytes_per_s: must be > 0, got {self}")

    @property
    def seconds(self) -> float:
        """Time from the end of a step until actors can swap the new weights in."""
        return self.total_bytes / self.bandwidth_bytes_per_s + self.num_buckets * (
            self.bucket_latency_s
        )
