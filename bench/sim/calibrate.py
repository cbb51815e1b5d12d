"""Calibration: fit the simulator's free time parameters to measured runs, report its error.

Input: the JSON written by `bench/staleness.py` (default `bench/results/staleness.json`), one
measured run per staleness bound. Numbers may be plain or `{"median": x, "min": .., "max": ..}`
(the median is used). Fields read:

    config                     top level, optional: RunConfig.to_dict() of the runs (missing
                               keys take asyncrl.config defaults)
    points[]:
      max_staleness            η of this run (int)
      config                   optional per-point overrides, same nesting as the top level
      samples_per_s            learner throughput: samples trained per second
      learner_wait_fraction    learner time waiting for a batch / wall time
      actor_wait_fraction      actor time waiting for credits / wall time, mean over actors
      step_time_s              mean learner step (collate + forward/backward + optimizer), no wait
      generate_time_s          mean seconds of one actor generation batch (engine.generate)
      response_lengths         completion lengths in tokens of the run's samples (or a sample)
      prompt_tokens            mean prompt length in tokens
      generate_batch_seqs      optional: mean sequences per generation batch
                               (default actor.concurrency * actor.group_size)
      step_tokens              optional: mean tokens (prompt + completion) per learner step
                               (default groups_per_step * group_size * (prompt + mean length))
      sync_s                   optional: mean seconds of one weight publication (default 0)
      loss                     optional: the loss of the run; learner times are fitted per loss
      steps                    optional: learner steps of the run (with dropped_stale: the
                               actor's rounds, for its time outside generation)
      dropped_stale            optional: groups dropped as stale over the run
      config.actor.weight_update  optional: between_groups (default) or in_flight
      inflight_updates         optional: weight loads that paused generation over the run
      inflight_pause_s         optional: seconds one such pause took (load + KV recompute)
      generation_batches       optional: [[seqs, max_len, total_tokens, seconds], ...] per batch
      step_records             optional: [[tokens, seconds], ...] per learner step
      step_time_quantiles      optional: equally spaced quantiles of the learner step times
      generate_time_quantiles  optional: the same of the actors' generation batch times
      (anything else is ignored)

Free parameters, fitted by non-negative least squares on relative errors:
- generation: fixed_s, step_s, token_s of `timing.GenerationTime` (a batch's expected longest
  sample is estimated by resampling the measured lengths at the batch's size), one fit for all
  points (generation does not depend on the loss);
- learner: overhead_s and token_s of `timing.LearnerTime` (world from the config), per loss
  (the losses do different work per step);
- weight sync: the measured mean `sync_s` as one constant per publication;
- in-flight pause: the mean measured `inflight_pause_s` of the in-flight points that had
  updates (their `generate_time_s` includes the pauses, which come off it first: the model
  adds them back where weights land mid-batch);
- message latency (`SimConfig.message_latency_s`), from the η = 0 points alone: there every
  hand-off is on the critical path and generation and training never overlap, so a step's
  mean period is the sum of the mean times plus latency × the hops of one cycle, whatever the
  times' spread. Each η = 0 point that carries its time quantiles is simulated with its own
  times at latency 0 and at a small latency δ (the same draws, so the difference is hops × δ
  per step exactly); the latency is the mean over those points of (measured period -
  simulated period) / hops, at least 0 (and 0 without such points: with mean times only,
  several actors generating side by side would wait for the slowest of them, and that wait
  would pass for latency). The points at η ≥ 1 then test it out of sample.

Two times are not fitted but read off each point's own clock and averaged:
- the learner's time per step outside its optimizer step and its wait for data (weight
  snapshot for the publication, the Version message, the metrics log):
  S / samples_per_s · (1 - learner_wait_fraction) - step_time_s, per loss; it is simulated
  after the step's publication (`LearnerTime.after_s`), as the learner logs its metrics while
  the actors already generate with the new weights;
- the actor's time per round outside engine.generate and its waits (scoring, packing and
  pushing groups, loading weights): (1 - actor_wait_fraction) · wall / rounds - generate_time_s,
  with rounds = (steps · B + dropped_stale) / concurrency (full rounds assumed); when a point
  lacks `steps`, 0.

Times vary from batch to batch as the point's measured quantiles say (`step_time_quantiles`,
`generate_time_quantiles`; `spread=False` uses the mean times only): with little slack between
the two sides (η = 1 here), the variation is what makes the learner wait.

Output: the fitted parameters, the residuals of both fits, and per point the simulated run
next to the measured one: relative error of samples/s, absolute (and, where the measured value
is at least 0.05, relative) error of the learner and actor wait fractions. Each point is also
simulated with its own measured times (`own_times`: generation, step, sync of that run), which
separates the event model's error from the time models' fit; and, to show what each refinement
adds, with its own mean times only (no spread, no latency) and with their spread but no latency
(`own_times_rel_err_samples_per_s_with`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .model import SimConfig, simulate
from .points import Point
from .timing import GenerationTime, LearnerTime, LengthModel, WeightSync

REL_FLOOR = 0.05  # below this a wait fraction's relative error is not meaningful


@dataclass(frozen=True)
class LearnerFit:
    """The learner's time model for one loss."""

    overhead_s: float
    token_s: float
    outside_s: float
    """Per step outside the optimizer step and the wait (from the points' own clocks)."""


@dataclass(frozen=True)
class Calibration:
    """Fitted time models and how well the simulator then reproduces each point."""

    generation: GenerationTime
    learner: dict[str, LearnerFit]
    """Per loss."""
    sync_s: float
    message_latency_s: float
    inflight_pause_s: float
    """Mean pause of one in-flight update over the in-flight points with updates (0 without)."""
    latency_fit: dict[str, Any]
    """How the latency was found: per η = 0 point its estimate and the hops per step."""
    generation_fit_rel_err: list[float]
    step_fit_rel_err: list[float]
    points: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in (
            "rel_err_samples_per_s",
            "abs_err_learner_wait_fraction",
            "abs_err_actor_wait_fraction",
        ):
            errs = [abs(p[key]) for p in self.points]
            out[f"max_abs_{key}"] = max(errs) if errs else None
            own = [abs(p["own_times"][key]) for p in self.points]
            out[f"own_times_max_abs_{key}"] = max(own) if own else None
        return out


# --- fitting -----------------------------------------------------------------------------------


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a few columns: the best non-negative subset solution."""
    best, best_res = np.zeros(a.shape[1]), float(np.sum(b**2))
    for size in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), size):
            x_sub = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            if np.any(x_sub < 0):
                continue
            x = np.zeros(a.shape[1])
            x[list(cols)] = x_sub
            res = float(np.sum((a @ x - b) ** 2))
            if res < best_res * (1 - 1e-9):
                best, best_res = x, res
    return best


def expected_max(lengths: Sequence[int], batch: float, draws: int = 2000, seed: int = 0) -> float:
    """E[max of `batch` lengths drawn from `lengths`], by resampling."""
    rng = np.random.default_rng(seed)
    n = max(1, round(batch))
    return float(rng.choice(np.asarray(lengths), size=(draws, n)).max(axis=1).mean())


def fit_generation(points: Sequence[Point]) -> tuple[GenerationTime, list[float]]:
    """fixed_s, step_s, token_s from mean batch times (and per-batch records when present)."""
    rows, target = [], []
    for p in points:
        mean_len = float(np.mean(p.response_lengths))
        max_len = expected_max(p.response_lengths, p.batch_seqs)
        rows.append([1.0, max_len, p.batch_seqs * mean_len])
        target.append(p.generate_time_s)
    for p in points:
        for _seqs, max_len, total, seconds in p.generation_batches:
            rows.append([1.0, max_len, total])
            target.append(seconds)
    a, b = np.asarray(rows), np.asarray(target)
    x = nnls(a / b[:, None], np.ones_like(b))
    errs = ((a @ x - b) / b)[: len(points)]
    gen = GenerationTime(fixed_s=float(x[0]), step_s=float(x[1]), token_s=float(x[2]))
    return gen, [float(e) for e in errs]


def fit_learner(points: Sequence[Point]) -> tuple[float, float, list[float]]:
    """overhead_s and per-rank token_s from mean step times (and per-step records)."""
    rows, target = [], []
    for p in points:
        rows.append([1.0, p.step_tokens / p.cfg.learner.world])
        target.append(p.step_time_s)
    for p in points:
        for tokens, seconds in p.step_records:
            rows.append([1.0, tokens / p.cfg.learner.world])
            target.append(seconds)
    a, b = np.asarray(rows), np.asarray(target)
    x = nnls(a / b[:, None], np.ones_like(b))
    errs = ((a @ x - b) / b)[: len(points)]
    return float(x[0]), float(x[1]), [float(e) for e in errs]


def sim_config_for(
    point: Point,
    cal: Calibration,
    num_steps: int = 60,
    warmup_steps: int = 10,
    own_times: bool = False,
    spread: bool = True,
) -> SimConfig:
    """The simulated counterpart of a measured point under a calibration (or, with
    `own_times`, under the point's own measured generation, step and sync times). With
    `spread`, batch and step times vary as the point's measured ones did (their quantiles)."""
    lengths = LengthModel(
        measured=point.response_lengths,
        max_tokens=max(point.response_lengths),
        prompt_tokens=round(point.prompt_tokens),
    )
    fit = cal.learner[point.loss]
    learner = LearnerTime(
        world=point.cfg.learner.world,
        overhead_s=fit.overhead_s,
        token_s=fit.token_s,
        after_s=fit.outside_s,
    )
    generation = dataclasses.replace(
        cal.generation, fixed_s=cal.generation.fixed_s + point.actor_outside_s
    )
    sync_s = cal.sync_s
    if own_times:
        generation = GenerationTime(fixed_s=point.generate_time_s + point.actor_outside_s)
        learner = LearnerTime(overhead_s=point.step_time_s, after_s=point.learner_outside_s)
        sync_s = point.sync_s
    if spread:
        generation = dataclasses.replace(generation, spread=point.generate_spread)
        learner = dataclasses.replace(learner, spread=point.step_spread)
    return SimConfig.from_run_config(
        point.cfg,
        num_steps=num_steps,
        warmup_steps=warmup_steps,
        lengths=lengths,
        generation=generation,
        learner=learner,
        sync=WeightSync(num_buckets=1, bucket_latency_s=sync_s),
        message_latency_s=cal.message_latency_s,
        inflight_pause_s=point.inflight_pause_s if own_times else cal.inflight_pause_s,
    )


def fit_latency(
    points: Sequence[Point],
    cal: Calibration,
    num_steps: int,
    warmup_steps: int,
    spread: bool,
    delta_s: float = 1e-3,
) -> tuple[float, dict[str, Any]]:
    """The message latency that closes the η = 0 points' period gap (see the module docstring)."""
    estimates, hops = [], []
    for p in points:
        if p.max_staleness != 0 or not (spread and p.step_spread and p.generate_spread):
            continue  # with mean times only, parallel actors' waits would pass for latency
        base = sim_config_for(p, cal, num_steps, warmup_steps, True, spread)
        at0 = simulate(base)
        atd = simulate(dataclasses.replace(base, message_latency_s=delta_s))
        per_step = base.samples_per_step
        period0, period_d = per_step / at0.samples_per_s, per_step / atd.samples_per_s
        k = (period_d - period0) / delta_s
        estimates.append((per_step / p.samples_per_s - period0) / k)
        hops.append(k)
    if not estimates:
        return 0.0, {"status": "no η = 0 point with time quantiles (or spread off): latency 0"}
    latency = max(0.0, float(np.mean(estimates)))
    return latency, {"status": "ok", "per_point_s": estimates, "hops_per_step": hops}


def calibrate(
    points: Sequence[Point], num_steps: int = 60, warmup_steps: int = 10, spread: bool = True
) -> Calibration:
    """Fit the time models, then simulate every point and compare (`spread`: see
    `sim_config_for`)."""
    gen, gen_errs = fit_generation(points)
    learner: dict[str, LearnerFit] = {}
    step_errs = [0.0] * len(points)
    for loss in sorted({p.loss for p in points}):
        idx = [i for i, p in enumerate(points) if p.loss == loss]
        overhead, token_s, errs = fit_learner([points[i] for i in idx])
        outside = float(np.mean([points[i].learner_outside_s for i in idx]))
        learner[loss] = LearnerFit(overhead, token_s, outside)
        for i, e in zip(idx, errs, strict=True):
            step_errs[i] = e
    sync_s = float(np.mean([p.sync_s for p in points]))
    pauses = [p.inflight_pause_s for p in points if p.inflight_updates > 0]
    cal = Calibration(
        generation=gen,
        learner=learner,
        sync_s=sync_s,
        message_latency_s=0.0,
        inflight_pause_s=float(np.mean(pauses)) if pauses else 0.0,
        latency_fit={},
        generation_fit_rel_err=gen_errs,
        step_fit_rel_err=step_errs,
        points=[],
    )
    latency, how = fit_latency(points, cal, num_steps, warmup_steps, spread)
    cal = dataclasses.replace(cal, message_latency_s=latency, latency_fit=how)
    bare = dataclasses.replace(cal, message_latency_s=0.0)
    for p in points:
        sim = simulate(sim_config_for(p, cal, num_steps, warmup_steps, spread=spread))
        own = simulate(sim_config_for(p, cal, num_steps, warmup_steps, True, spread))
        # what each refinement adds: own times with mean times only, then with their spread
        steps = (num_steps, warmup_steps, True)
        ablation = {
            "mean_times": simulate(sim_config_for(p, bare, *steps, spread=False)),
            "spread_no_latency": simulate(sim_config_for(p, bare, *steps, spread=spread)),
        }
        cal.points.append(
            _compare(p, sim.to_dict())
            | {"own_times": _compare(p, own.to_dict())}
            | {
                "own_times_rel_err_samples_per_s_with": {
                    k: r.samples_per_s / p.samples_per_s - 1 for k, r in ablation.items()
                }
            }
        )
    return cal


def _compare(p: Point, sim: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "max_staleness": p.max_staleness,
        "loss": p.loss,
        "weight_update": p.cfg.actor.weight_update,
        "measured": {
            "samples_per_s": p.samples_per_s,
            "learner_wait_fraction": p.learner_wait_fraction,
            "actor_wait_fraction": p.actor_wait_fraction,
            "mean_staleness": p.mean_staleness,
            "groups_dropped_stale_per_step": p.dropped_per_step,
        },
        "simulated": {
            "samples_per_s": sim["samples_per_s"],
            "learner_wait_fraction": sim["learner_idle_fraction"],
            "actor_wait_fraction": sim["actor_idle_fraction"],
            "staleness_histogram": sim["staleness_histogram"],
            "groups_dropped_stale": sim["groups_dropped_stale"],
            "mean_staleness": sim["mean_staleness"],
            "groups_dropped_stale_per_step": sim["groups_dropped_stale"] / sim["steps"],
        },
        "rel_err_samples_per_s": sim["samples_per_s"] / p.samples_per_s - 1.0,
    }
    for key in ("learner_wait_fraction", "actor_wait_fraction"):
        measured, simulated = row["measured"][key], row["simulated"][key]
        row[f"abs_err_{key}"] = simulated - measured
        row[f"rel_err_{key}"] = simulated / measured - 1.0 if measured >= REL_FLOOR else None
    return row
