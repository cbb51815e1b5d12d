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
- Spread: a generation batch or a learner step may also carry `spread`, equally spaced quantiles
  of its measured times (machine noise, the two sides slowing each other; any unit: only their
  shape counts). Each batch's modelled time is multiplied by a factor drawn from them and scaled
  to mean 1 (`Spread`), so the mean stays the modelled one while a pipeline with little slack
  waits as the real one does.
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


def check_spread(spread: Sequence[float], name: str) -> None:
    """ValueError unless `spread` is empty or >= 2 ascending, non-negative quantiles, mean > 0."""
    if not spread:
        return
    q = np.asarray(spread, dtype=np.float64)
    if q.size < 2 or q[0] < 0 or np.any(np.diff(q) < 0) or not np.all(np.isfinite(q)):
        raise ValueError(
            f"{name}: need >= 2 ascending, finite quantiles >= 0, got {list(spread)[:5]}..."
        )
    if quantile_mean(q) <= 0:
        raise ValueError(f"{name}: all quantiles are 0")


def quantile_mean(quantiles: Sequence[float]) -> float:
    """Mean of the distribution whose inverse CDF is linear between equally spaced quantiles."""
    q = np.asarray(quantiles, dtype=np.float64)
    return float(np.mean((q[:-1] + q[1:]) / 2))


class Spread:
    """Factors with mean 1 drawn from `spread` quantiles (inverse CDF, linear in between)."""

    def __init__(
        self, spread: Sequence[float], rng: np.random.Generator, chunk: int = 1 << 14
    ) -> None:
        self.q = np.asarray(spread, dtype=np.float64)
        self.q = self.q / quantile_mean(self.q) if self.q.size else self.q
        self.rng, self.chunk = rng, chunk
        self.pool: list[float] = []

    def draw(self) -> float:
        """One factor (1.0 when there is no spread; then the rng is never used)."""
        if not self.q.size:
            return 1.0
        if not self.pool:
            u = self.rng.random(self.chunk) * (self.q.size - 1)
            lo = np.floor(u).astype(np.int64)
            hi = np.minimum(lo + 1, self.q.size - 1)
            self.pool = (self.q[lo] + (u - lo) * (self.q[hi] - self.q[lo])).tolist()
        return self.pool.pop()


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
    spread: tuple[float, ...] = ()
    """Quantiles of measured batch times; empty = every batch takes the modelled time."""

    def __post_init__(self) -> None:
        if min(self.fixed_s, self.step_s, self.token_s, self.prefill_token_s) < 0:
            raise ValueError(f"generation: every coefficient must be >= 0, got {self}")
        check_spread(self.spread, "generation.spread")

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
    after_s: float = 0.0
    """After a step's publication, before the learner takes its next batch (metrics, logs):
    not part of `seconds`, and overlapping the actors' generation."""
    spread: tuple[float, ...] = ()
    """Quantiles of measured step times; empty = every step takes the modelled time."""

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"learner.world: must be >= 1, got {self.world}")
        if min(self.overhead_s, self.token_s, self.allreduce_s, self.snapshot_s, self.after_s) < 0:
            raise ValueError(f"learner: every time must be >= 0, got {self}")
        check_spread(self.spread, "learner.spread")

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
