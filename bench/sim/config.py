"""What one simulated run is (`SimConfig`: the system's shape and its time models, from a run
config or given directly) and what it measures (`SimResult`); `SimulationStalled` when a
configuration cannot make progress. The event model itself is bench/sim/model.py."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from asyncrl.config import RunConfig

from .timing import GenerationTime, LearnerTime, LengthModel, WeightSync


class SimulationStalled(RuntimeError):
    """No event is left before `num_steps` steps: the configuration cannot make progress."""


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulated run: the shape of the system and its time models."""

    num_actors: int
    """Rollout actors A."""
    concurrency: int
    """Groups one actor generates together as one batch, at most (actor.concurrency)."""
    group_size: int
    """Samples per group (actor.group_size)."""
    groups_per_step: int
    """Groups per optimizer step B (learner.groups_per_step)."""
    max_staleness: int
    """η (replay.max_staleness)."""
    credit_window: int = 0
    """Credits one actor asks the hub to keep it supplied with (actor.num_window_credits);
    0 = concurrency. A larger window holds the next batch's credits while one generates, so no
    credit round trip (message_latency_s twice) sits between batches."""
    capacity_groups: int = 1_000_000
    """Hub capacity in groups (replay.capacity_groups); large = never binding."""
    sampling: Literal["fifo", "freshest"] = "fifo"
    """Which eligible groups a batch takes first (replay.sampling)."""
    publish_every: int = 1
    """Publish weights every N steps (learner.publish_every)."""
    num_steps: int = 40
    """Learner steps to simulate."""
    warmup_steps: int = 10
    """Steps excluded from the measurements (start-up transient)."""
    seed: int = 0
    """Seed of the response-length sampler and of the prompt source."""
    wait_for_weights: bool = True
    """asyncrl's actor: one that received credits issued at hub version c holds weights
    >= c - η before it generates (waiting for the broadcast). False = the earlier actor, which
    starts at once with whatever weights it has loaded."""
    pipeline_requests: bool = True
    """asyncrl's learner: the request for step k+1 (version v+1) goes out as soon as batch k
    arrives. False = a learner that requests (version v+1) only after its step."""
    weight_update: Literal["between_groups", "in_flight"] = "between_groups"
    """When an actor loads new weights (actor.weight_update): at the end of its batch, or,
    `in_flight`, also while it generates: the batch pauses `inflight_pause_s` and goes on under
    the new weights, its groups spanning versions (admitted by their oldest token)."""
    inflight_pause_s: float = 0.0
    """What one in-flight update costs a generating actor, a pause between two decode steps:
    the weight load and the KV recompute of the sequences in flight (their part that does not
    grow with the batch)."""
    inflight_pause_per_seq_s: float = 0.0
    """The pause's part per sequence of the batch (recomputing its context so far)."""
    message_latency_s: float = 0.0
    """One-way delay of every message between the actors, the hub and the learner (credits,
    groups, WeightsLoaded, SampleRequest, Version, batches): transport, decode and the
    receiver's scheduling. 0 = every message acts at the instant it is sent."""
    lengths: LengthModel = field(default_factory=LengthModel)
    generation: GenerationTime = field(default_factory=GenerationTime)
    learner: LearnerTime = field(default_factory=LearnerTime)
    sync: WeightSync = field(default_factory=WeightSync)

    def __post_init__(self) -> None:
        for name in ("num_actors", "concurrency", "group_size", "groups_per_step", "num_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.credit_window and self.credit_window < self.concurrency:
            raise ValueError(
                f"credit_window: must be 0 or >= concurrency = {self.concurrency}, "
                f"got {self.credit_window}"
            )
        if self.max_staleness < 0 or self.publish_every < 1:
            raise ValueError("max_staleness must be >= 0 and publish_every >= 1")
        if self.publish_every > self.max_staleness + 1:  # as asyncrl.config refuses it
            raise ValueError(
                f"publish_every: must be <= max_staleness + 1 = {self.max_staleness + 1}, "
                f"got {self.publish_every} (a version no published weights can serve)"
            )
        for name in ("inflight_pause_s", "inflight_pause_per_seq_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.weight_update not in ("between_groups", "in_flight"):
            raise ValueError(
                f"weight_update: between_groups or in_flight, got {self.weight_update!r}"
            )
        if not self.message_latency_s >= 0:
            raise ValueError(f"message_latency_s: must be >= 0, got {self.message_latency_s}")
        if not 0 <= self.warmup_steps < self.num_steps:
            raise ValueError(f"warmup_steps: must be in [0, num_steps), got {self.warmup_steps}")

    @property
    def samples_per_step(self) -> int:
        return self.groups_per_step * self.group_size

    @classmethod
    def from_run_config(cls, cfg: RunConfig, **kwargs: Any) -> SimConfig:
        """The shape of a real run (`asyncrl.config.RunConfig`); time models come in kwargs."""
        shape: dict[str, Any] = dict(
            num_actors=cfg.run.num_actors,
            concurrency=cfg.actor.concurrency,
            credit_window=cfg.actor.num_window_credits,
            group_size=cfg.actor.group_size,
            groups_per_step=cfg.learner.groups_per_step,
            max_staleness=cfg.replay.max_staleness,
            capacity_groups=cfg.replay.capacity_groups,
            sampling=cfg.replay.sampling,
            publish_every=cfg.learner.publish_every,
            weight_update=cfg.actor.weight_update,
        )
        return cls(**{**shape, **kwargs})


@dataclass(frozen=True)
class SimResult:
    """What one simulated run measured over its window."""

    steps: int
    window_s: float
    samples_per_s: float
    tokens_per_s: float
    """Tokens (prompt + completion) the learner trained on per second."""
    generated_samples_per_s: float
    """Samples the actors finished per second, dropped ones included."""
    learner_idle_fraction: float
    """Share of the window the learner waited for a batch."""
    actor_idle_fraction: float
    """Share of actor-time spent waiting for credits."""
    staleness_histogram: list[int]
    """Consumed groups by staleness 0..η."""
    mean_staleness: float
    groups_dropped_stale: int
    sync_s: float
    """Duration of one weight publication (model)."""
    mean_sync_latency_s: float
    """End of a step until its weights are available to actors (queueing included)."""
    mean_step_s: float
    mean_generate_s: float
    mean_batch_seqs: float
    inflight_updates: int
    """Weight loads that paused a generating actor (in_flight only)."""
    mixed_version_frac: float
    """Share of consumed groups whose tokens span more than one version."""
    tokens_per_weight_version: float
    """Completion tokens generated per weight load, over all actors."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
