"""Helpers of the simulator tests (test_simulate.py, test_sim_calibration.py,
test_sim_inflight.py): the one-actor
case whose algebra test_simulate.py's docstring sets out, and measurements made by a known
ground truth for calibration."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bench.sim.model import SimConfig, simulate
from bench.sim.timing import (
    GenerationTime,
    LearnerTime,
    LengthModel,
    WeightSync,
)

B, GROUP_SIZE, TOKENS = 4, 2, 3  # completions of exactly TOKENS tokens
S = B * GROUP_SIZE
WARMUP, STEPS = 8, 20
MEASURED = STEPS - WARMUP
OLD = {"wait_for_weights": False, "pipeline_requests": False}


def one_actor(eta: int, g: float, s: float, d: float = 0.0, **kw: object) -> SimConfig:
    base: dict[str, object] = dict(
        num_actors=1,
        concurrency=B,
        group_size=GROUP_SIZE,
        groups_per_step=B,
        max_staleness=eta,
        num_steps=STEPS,
        warmup_steps=WARMUP,
        lengths=LengthModel(median_tokens=TOKENS, sigma=0.0, prompt_tokens=1),
        generation=GenerationTime(fixed_s=g),
        learner=LearnerTime(overhead_s=s),
        sync=WeightSync(num_buckets=1, bucket_latency_s=d),
    )
    return SimConfig(**(base | kw))  # type: ignore[arg-type]


def synthetic_measurements(path: Path, message_latency_s: float = 0.0, sigma: float = 0.6) -> None:
    """Points as bench/staleness.py would measure them, made by a known ground truth. With
    `sigma` = 0 every batch and step takes the same time, and the points say so (quantiles)."""
    lengths = LengthModel(median_tokens=24, sigma=sigma, max_tokens=128, prompt_tokens=16)
    measured_lengths = lengths.sample(np.random.default_rng(1), 4000).tolist()
    points = []
    for eta in (0, 1, 2, 4):
        r = simulate(
            SimConfig(
                num_actors=2,
                concurrency=4,
                group_size=4,
                groups_per_step=4,
                max_staleness=eta,
                num_steps=60,
                warmup_steps=10,
                seed=eta + 10,
                lengths=lengths,
                message_latency_s=message_latency_s,
                generation=GenerationTime(fixed_s=0.05, step_s=0.002, token_s=0.0004),
                learner=LearnerTime(overhead_s=0.1, token_s=0.0008),
                sync=WeightSync(num_buckets=1, bucket_latency_s=0.01),
            )
        )
        points.append(
            {
                "max_staleness": eta,
                "samples_per_s": {"median": r.samples_per_s},
                "learner_wait_fraction": r.learner_idle_fraction,
                "actor_wait_fraction": r.actor_idle_fraction,
                "step_time_s": r.mean_step_s,
                "generate_time_s": r.mean_generate_s,
                "generate_batch_seqs": r.mean_batch_seqs,
                "response_lengths": measured_lengths,
                "prompt_tokens": 16,
                "sync_s": 0.01,
                "loss": 0.0,
            }
        )
        if sigma == 0:
            points[-1]["step_time_quantiles"] = [r.mean_step_s] * 2
            points[-1]["generate_time_quantiles"] = [r.mean_generate_s] * 2
    config = {
        "run": {"num_actors": 2},
        "actor": {"concurrency": 4, "credit_window": 4, "group_size": 4},
        "learner": {"groups_per_step": 4},
    }
    path.write_text(json.dumps({"config": config, "points": points}))
