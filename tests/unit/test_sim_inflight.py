"""bench/sim's in-flight weight updates against hand-computed timelines.

The setup of tests/unit/test_simulate.py (tests/unit/sim_cases.py): one actor with concurrency = B groups per step, group
size 2 (S = 2B samples per step), completions of exactly 3 tokens, constant generation time g
per batch, step time s, weight sync d, pause p per in-flight update. Times are dyadic, so every
sum the simulator forms is exact and results compare with `==`. Expected numbers come from the
algebra of each case, never from the simulator.
"""

from __future__ import annotations

import pytest
from sim_cases import MEASURED, TOKENS, B, S, one_actor

from bench.sim.calibrate import Calibration, LearnerFit, sim_config_for
from bench.sim.cluster import ClusterAssumptions
from bench.sim.model import simulate
from bench.sim.points import parse_point
from bench.sim.timing import GenerationTime, LearnerTime

IN_FLIGHT = {"weight_update": "in_flight", "inflight_pause_s": 0.25}


@pytest.mark.parametrize("eta", [1, 2, 4])
def test_generation_bound_actor_pauses_once_per_batch(eta: int) -> None:
    """g = 1.75 > s = 0.5, d = 0.25, p = 0.25: every batch takes g + p = 2 and spans 2 versions.

    Derivation: batch k runs [2k, 2k + 2) and is trained from 2k + 2 to 2k + 2.5, whose weights
    (version k + 1) land at 2k + 2.75, inside batch k + 1 = [2k + 2, 2k + 4): the actor loads
    them in flight (one pause p, so the batch ends at 2k + 4 = start + g + p) and reports them;
    the next version lands at 2k + 4.75, after that batch. So batch k + 1 starts with version k
    (landed at 2k + 0.75) and ends with k + 1; the learner trains it at version k + 1: staleness
    1 counted from its oldest tokens, every group mixed. The learner waits 2 - s = 1.5 of every
    2 s; the actor never idles. One load per batch: TOKENS · S tokens per weight version.
    Between groups the same run has no pause: S samples every g.
    """
    r = simulate(one_actor(eta, 1.75, 0.5, 0.25, **IN_FLIGHT))
    assert r.samples_per_s == S / 2.0
    assert r.learner_idle_fraction == 1.5 / 2.0
    assert r.actor_idle_fraction == 0.0
    assert r.staleness_histogram == [0, MEASURED * B] + [0] * (eta - 1)
    assert r.groups_dropped_stale == 0
    assert r.inflight_updates == MEASURED
    assert r.mixed_version_frac == 1.0
    assert r.tokens_per_weight_version == TOKENS * S
    between = simulate(one_actor(eta, 1.75, 0.5, 0.25))
    assert between.samples_per_s == S / 1.75
    assert between.inflight_updates == 0 and between.mixed_version_frac == 0.0


@pytest.mark.parametrize(
    ("eta", "g", "s"),
    [
        (0, 1.5, 0.5),  # synchronous: weights land before the batch they serve starts
        (1, 0.5, 1.5),  # learner-bound: the actor idles, waiting for weights v+1, when they land
    ],
)
def test_weights_that_land_between_batches_change_nothing(eta: int, g: float, s: float) -> None:
    """Without a sync landing mid-batch (see test_simulate.py for both timelines) in-flight
    updates never happen, and the run is the between-groups run exactly."""
    in_flight = simulate(one_actor(eta, g, s, 0.25, **IN_FLIGHT))
    assert in_flight.inflight_updates == 0
    assert in_flight == simulate(one_actor(eta, g, s, 0.25))


def test_pause_per_sequence_scales_with_the_batch() -> None:
    """The case of the first test with the pause split into 0.125 + 0.015625 per sequence:
    with S = 8 sequences per batch the pause is again 0.25, so the same timeline."""
    split = {"inflight_pause_s": 0.125, "inflight_pause_per_seq_s": 0.015625}
    r = simulate(one_actor(1, 1.75, 0.5, 0.25, **(IN_FLIGHT | split)))
    assert r.samples_per_s == S / 2.0 and r.inflight_updates == MEASURED


def test_bad_inflight_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="inflight_pause_s"):
        one_actor(1, 1.0, 1.0, 0.0, inflight_pause_s=-1.0)
    with pytest.raises(ValueError, match="weight_update"):
        one_actor(1, 1.0, 1.0, 0.0, weight_update="sometimes")


def test_cluster_pause_is_the_weight_copy_plus_the_recompute() -> None:
    """2 · bytes over HBM, and per sequence its share of the prompt plus half a completion at
    the prefill rate; a kept cache (inflight_recompute = 0) leaves the copy only."""
    a = ClusterAssumptions()
    n = 8_000_000_000
    fixed, per_seq = a.inflight_pause(n)
    assert fixed == pytest.approx(2 * n * 2 / (4.8e12 * 0.7))
    tokens = 512 / 16 + a.lengths().mean_tokens() / 2
    assert per_seq == pytest.approx(tokens * 2 * n / (989e12 * 0.5))
    kept = ClusterAssumptions(inflight_recompute=0.0).inflight_pause(n)
    assert kept == (fixed, 0.0)


def test_calibration_point_takes_its_mode_and_removes_the_pauses() -> None:
    """An in-flight point: its mode reaches the simulation, and the measured pauses (4 updates
    of 0.05 s over 10 steps = 10 rounds here) come off its mean generation time."""
    raw = {
        "max_staleness": 1,
        "samples_per_s": 100.0,
        "learner_wait_fraction": 0.0,
        "actor_wait_fraction": 0.5,
        "step_time_s": 0.1,
        "generate_time_s": 0.05,
        "response_lengths": [3, 3],
        "prompt_tokens": 6,
        "steps": 10,
        "dropped_stale": 0,
        "inflight_updates": 4,
        "inflight_pause_s": 0.05,
        "loss": "decoupled_ppo",
        "config": {"actor": {"weight_update": "in_flight"}},
    }
    base = {"actor": {"concurrency": 4, "group_size": 16}, "learner": {"groups_per_step": 4}}
    p = parse_point(base, raw, "test")
    assert p.cfg.actor.weight_update == "in_flight"
    assert p.generate_time_s == pytest.approx(0.05 - 4 * 0.05 / 10)
    cal = Calibration(
        generation=GenerationTime(fixed_s=0.01),
        learner={"decoupled_ppo": LearnerFit(0.1, 0.0, 0.0)},
        sync_s=0.0,
        message_latency_s=0.0,
        inflight_pause_s=0.02,
        latency_fit={},
        generation_fit_rel_err=[],
        step_fit_rel_err=[],
        points=[],
    )
    own = sim_config_for(p, cal, own_times=True, spread=False)
    assert own.weight_update == "in_flight" and own.inflight_pause_s == 0.05
    fitted = sim_config_for(p, cal, spread=False)
    assert fitted.weight_update == "in_flight" and fitted.inflight_pause_s == 0.02


@pytest.mark.parametrize(("g", "a"), [(1.5, 0.25), (0.5, 1.0)])
def test_learner_time_after_publication_overlaps_generation(g: float, a: float) -> None:
    """η = 0, s = 0.5, d = 0, the learner busy `a` after each publication (metrics, logs).

    Derivation: weights land as step k ends; the actor generates batch k+1 in g while the
    learner spends a, then the learner waits g - a if g > a: period s + max(g, a), learner idle
    max(0, g - a) of it. Without the overlap (a counted in the step) the period would be
    g + s + a.
    """
    s = 0.5
    r = simulate(one_actor(0, g, s, 0.0, learner=LearnerTime(overhead_s=s, after_s=a)))
    assert r.samples_per_s == S / (s + max(g, a))
    assert r.learner_idle_fraction == max(0.0, g - a) / (s + max(g, a))
