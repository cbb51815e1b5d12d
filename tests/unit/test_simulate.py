"""bench/sim: the simulator reproduces hand-computed timelines exactly and obeys replay's rules.

Expected numbers come from the algebra of each case, never from the simulator. Times are
dyadic (1.0, 1.5, 0.5, 0.25) so every sum the simulator forms is exact in floating point and
the results compare with `==`. Notation: one actor with concurrency = B groups per step, group
size 2, so S = 2B samples per step; constant generation time g per batch, step time s, weight
sync d. By default the actor waits for weights >= c - η for credits granted at hub version c and
the learner asks for batch k+1 (version v+1) as soon as batch k arrives (pipelined request);
`OLD` turns both off, the earlier behaviour, whose algebra the first cases were derived for.
The hub caps the actor's credits by the admission window at the version the actor holds (w:
room (η + w + 1)·B - consumed - ready - in flight), and an idle actor loads new weights the
moment they land, so the window moves with each sync.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from sim_cases import MEASURED, OLD, B, S, one_actor

from bench.sim.cluster import ClusterAssumptions
from bench.sim.model import Simulation, SimulationStalled, simulate
from bench.sim.timing import (
    GenerationTime,
    LearnerTime,
    Spread,
    check_spread,
)
from replay import core
from replay.buffer import ReplayBuffer
from replay.core import ActorSlots


@pytest.mark.parametrize(("g", "s"), [(1.5, 0.5), (1.0, 1.5)])
def test_eta0_is_synchronous(g: float, s: float) -> None:
    # credits for step k+1 only after step k ends: generate, then train, in turn
    r = simulate(one_actor(0, g, s))
    assert r.samples_per_s == S / (g + s)
    assert r.learner_idle_fraction == g / (g + s)
    assert r.actor_idle_fraction == s / (g + s)
    assert r.staleness_histogram == [MEASURED * B]
    assert r.groups_dropped_stale == 0
    assert r.tokens_per_s == MEASURED * S * (1 + 3) / (MEASURED * (g + s))


@pytest.mark.parametrize("eta", [1, 2, 4])
def test_async_generation_bound(eta: int) -> None:
    # g > s: the actor never waits; batch k+1 starts at (k+1)g with the weights of step k-1,
    # which ended at kg + s < (k+1)g, and is consumed at version k+1: staleness exactly 1
    g, s = 1.5, 0.5
    r = simulate(one_actor(eta, g, s))
    assert r.samples_per_s == S / g
    assert r.learner_idle_fraction == (g - s) / g
    assert r.actor_idle_fraction == 0.0
    assert r.staleness_histogram == [0, MEASURED * B] + [0] * (eta - 1)


@pytest.mark.parametrize("eta", [1, 2, 4])
def test_async_learner_bound_unpipelined(eta: int) -> None:
    # s > g, learner asking after its step: admission lets batch k start only at version k - η,
    # so it carries version k - η and is consumed at version k: staleness exactly η; it is ready
    # in time since g <= η·s
    g, s = 1.0, 1.5
    r = simulate(one_actor(eta, g, s, **OLD))
    assert r.samples_per_s == S / s
    assert r.learner_idle_fraction == 0.0
    assert r.actor_idle_fraction == (s - g) / s
    assert r.staleness_histogram == [0] * eta + [MEASURED * B]


def test_pipelined_learner_bound_generates_each_batch_once() -> None:
    """η = 1, g <= s, d = 0: every batch is made once, one version behind, and kept.

    Derivation: when the learner starts training at version v, weights v have just landed and
    its batch (from the inbox) was made with weights v-1: staleness 1; consumed = (v+1)·B. The
    idle actor has loaded weights v, whose window (η + v + 1)·B = (v+2)·B leaves exactly B
    credits: it makes the batch for version v+1 with weights v in g and idles s - g until weights
    v+1 land. The window at weights v-1 would leave (v+1)·B - (v+1)·B = 0, so no group is made
    that goes stale. The last step sends no request, but the window at the actor's weights does
    not depend on the hub's version, so it is like the others: samples S/s, learner never idle,
    actor idle (s - g)/s, staleness 1, nothing dropped.
    """
    g, s = 0.5, 1.5
    r = simulate(one_actor(1, g, s))
    assert r.samples_per_s == S / s
    assert r.learner_idle_fraction == 0.0
    assert r.actor_idle_fraction == (s - g) / s
    assert r.staleness_histogram == [0, MEASURED * B]
    assert r.groups_dropped_stale == 0


def test_window_at_the_actors_version_drops_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The case above drops no group in the whole run; with the window at the hub's version
    (the earlier rule: every `room` asked at the learner's version) it drops B per step.

    Derivation of the earlier rule: at the start of step k the request for k+1 makes the hub
    adopt k+1 and serve batch k+1, made during step k-1 with weights k-1 (staleness 1).
    Admission at version k+1 then opens batch k+2 at once, one step before its weights: made with
    weights k it would be consumed at k+2 (staleness 2), so the adoption of k+2 at the next
    step's start drops it (B groups) and the actor makes it again with weights k+1. Every step
    drops B and keeps the actor busy 2g of s; the last step sends no request, so its actor idles
    throughout.
    """
    g, s = 0.5, 1.5
    sim = Simulation(one_actor(1, g, s))
    r = sim.run()
    assert sim.hub.state.counters["groups_dropped_stale"] == 0 and r.samples_per_s == S / s

    real = core.room

    def room_at_hub_version(
        buffer: ReplayBuffer, in_flight: int, eta: int, groups: int, _policy_version: int
    ) -> int:
        return real(buffer, in_flight, eta, groups, buffer.policy_version)

    monkeypatch.setattr(core, "room", room_at_hub_version)
    old = simulate(one_actor(1, g, s))
    assert old.samples_per_s == S / s
    assert old.learner_idle_fraction == 0.0
    assert old.actor_idle_fraction == ((MEASURED - 1) * (s - 2 * g) + s) / (MEASURED * s)
    assert old.staleness_histogram == [0, MEASURED * B]
    assert old.groups_dropped_stale == MEASURED * B


@pytest.mark.parametrize("flags", [OLD, {"wait_for_weights": False}], ids=["old", "no-wait"])
def test_eta0_actor_not_waiting_gets_credits_with_the_weights(flags: dict[str, bool]) -> None:
    """η = 0, d < g, an actor that would start at once with whatever weights it holds.

    Derivation: after step v the actor holds weights v and consumed = (v+1)·B, so the window at
    its version, (v+1)·B - consumed, is 0: no credit, whatever the hub's version (v+1 on the
    step's end, or on its start when pipelined). Weights v+1 land d after the step; the idle
    actor loads them and gets B credits, generates in g, and the learner trains s: a step costs
    g + s + d, as for the actor that waits itself, and nothing is made that is dropped.
    """
    g, s, d = 1.0, 0.5, 0.25
    r = simulate(one_actor(0, g, s, d, **flags))
    assert r.samples_per_s == S / (g + s + d)
    assert r.learner_idle_fraction == (g + d) / (g + s + d)
    assert r.actor_idle_fraction == (s + d) / (g + s + d)
    assert r.groups_dropped_stale == 0
    assert r.staleness_histogram == [MEASURED * B]
    assert r.sync_s == d and r.mean_sync_latency_s == d


def test_actor_waits_for_weights() -> None:
    # asyncrl's actor in the same case waits for the credits' version (c - η = c at η = 0):
    # a step costs g + s + d and nothing is dropped
    g, s, d = 1.0, 0.5, 0.25
    r = simulate(one_actor(0, g, s, d))
    assert r.samples_per_s == S / (g + s + d)
    assert r.learner_idle_fraction == (g + d) / (g + s + d)
    assert r.groups_dropped_stale == 0


def test_capacity_bound_comes_from_replay_core(monkeypatch: pytest.MonkeyPatch) -> None:
    # capacity = B with η = 4 and concurrency 2B: admission caps stored + in flight at B, so the
    # actor regenerates only after the learner took the last batch. The pipelined request takes
    # batch k+1 out at the start of step k, when weights k have just landed, so batch k+2 is
    # made then with weights k and consumed at k+2: staleness 2 (1 for a learner asking after
    # its step), not η = 4
    calls: list[dict[str, int]] = []
    real = core.credits_available

    def spy(**kw: int) -> int:
        calls.append(kw)
        return real(**kw)

    monkeypatch.setattr(core, "credits_available", spy)
    g, s = 1.0, 1.5
    r = simulate(one_actor(4, g, s, capacity_groups=B, concurrency=2 * B))
    assert r.staleness_histogram == [0, 0, MEASURED * B, 0, 0]
    assert r.samples_per_s == S / s
    assert calls and all(c["stored"] + c["in_flight"] <= B for c in calls)
    assert all(c["capacity"] == B and c["max_staleness"] == 4 for c in calls)


def test_no_credit_from_admission_stalls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "credits_available", lambda **kw: 0)
    with pytest.raises(SimulationStalled, match="no event left after 0 of"):
        simulate(one_actor(1, 1.0, 1.0))


def test_actor_slots_shortcut_matches_core_grant() -> None:
    """`ActorSlots.grant` hands `allocate` only the first `total` actors in its order; the grant
    must equal `core.grant` over every actor, also when several versions have the same room
    (the capacity binds) and their actors interleave by free slots."""
    rng = np.random.default_rng(0)
    num_shortcut = num_tied = 0
    for _ in range(200):
        eta, groups = int(rng.integers(0, 3)), int(rng.integers(1, 6))
        buffer = ReplayBuffer(
            capacity=int(rng.integers(groups, 30)), max_staleness=eta, batch_groups=groups
        )
        buffer.drop_stale(int(rng.integers(0, 5)))
        slots, full, versions = ActorSlots(), {}, {}
        for _ in range(6):  # rounds of changes on the same ActorSlots, then a grant
            for _ in range(int(rng.integers(1, 25))):
                actor = f"a{int(rng.integers(0, 40)):03d}".encode()
                if rng.random() < 0.4:
                    versions[actor] = int(rng.integers(versions.get(actor, 0), 5))
                    slots.move(actor, versions[actor])
                full[actor] = full.get(actor, 0) + int(rng.integers(-full.get(actor, 0), 5))
                slots.set(actor, full[actor])
                if rng.random() < 0.05:
                    slots.remove(actor)
                    full.pop(actor)
                    versions.pop(actor, None)
            free = {actor: n for actor, n in full.items() if n > 0}
            in_flight = int(rng.integers(0, 12))
            room = functools.partial(core.room, buffer, in_flight, eta, groups)
            every = {actor: versions.get(actor, 0) for actor in free}
            expected = core.grant(buffer, in_flight, eta, groups, free, every)
            got = slots.grant(room)
            assert got == expected and list(got) == list(expected)  # the same order, too
            rooms = sorted({room(u) for u in every.values()}, reverse=True)
            if rooms and rooms[0] < len(free):
                candidates = slots.candidates(rooms[0], {u: room(u) for u in every.values()})
                assert len(candidates) <= rooms[0]  # the shortcut: at most `total` actors
                num_shortcut += 1
                num_tied += len({u for u in every.values() if room(u) == rooms[0]}) > 1
    assert num_shortcut > 200 and num_tied > 50  # both paths were exercised


def test_generation_time_is_bounded_by_the_longest_sample() -> None:
    gen = GenerationTime(fixed_s=0.5, step_s=0.25, token_s=0.125)
    assert gen.seconds([4, 1, 1, 2], prompt_tokens=7) == 0.5 + 0.25 * 4 + 0.125 * 8


def test_cluster_assumptions_use_the_real_bucket_plan() -> None:
    derived = ClusterAssumptions().derived()
    assert derived["num_params"] == 8_030_261_248  # Llama-3.1-8B
    assert derived["num_buckets"] == 16  # 16.06 GB in buckets of at most 1 GiB
    assert derived["sync"]["seconds"] == pytest.approx(16_060_522_496 / 50e9 + 16 * 5e-3)


def test_cluster_actors_ask_for_the_real_actors_credit_window() -> None:
    from bench.simulate import sim_config

    default = sim_config(ClusterAssumptions(), eta=4, measure=2, warmup=1, seed=0)
    assert (default.concurrency, default.credit_window) == (8, 16)  # actor.num_window_credits
    narrow = sim_config(ClusterAssumptions(credit_window=8), eta=4, measure=2, warmup=1, seed=0)
    assert narrow.credit_window == 8


@pytest.mark.parametrize("d", [0.0, 0.5])
def test_eta0_message_latency_adds_four_hops_per_step(d: float) -> None:
    # a cycle: the step ends, the sync lands (d), WeightsLoaded reaches the hub (L), the
    # credits reach the actor (L), it generates (g), its groups reach the hub (L), the batch
    # reaches the learner (L), the step runs (s): period g + s + d + 4L
    g, s, lat = 1.5, 0.5, 0.25
    r = simulate(one_actor(0, g, s, d, message_latency_s=lat))
    period = g + s + d + 4 * lat
    assert r.samples_per_s == S / period
    assert r.learner_idle_fraction == (g + d + 4 * lat) / period
    assert r.actor_idle_fraction == (s + d + 4 * lat) / period
    assert r.staleness_histogram == [MEASURED * B]


def test_a_credit_window_hides_the_credit_round_trip() -> None:
    # generation-bound at η = 4: holding only one batch's credits, the actor waits a round
    # trip (2L) for the next ones after each push; with a window of two batches it already
    # holds them and generates back to back, as with no latency at all
    g, s, lat = 1.5, 0.5, 0.25
    one = simulate(one_actor(4, g, s, message_latency_s=lat))
    assert one.samples_per_s == S / (g + 2 * lat)
    assert one.actor_idle_fraction == 2 * lat / (g + 2 * lat)
    two = simulate(one_actor(4, g, s, message_latency_s=lat, credit_window=2 * B))
    assert two.samples_per_s == S / g
    assert two.actor_idle_fraction == 0.0
    assert two.learner_idle_fraction == (g - s) / g
    with pytest.raises(ValueError, match="credit_window: must be 0 or >= concurrency"):
        one_actor(4, g, s, credit_window=B - 1)


def test_a_constant_spread_changes_nothing() -> None:
    # every quantile equal: each factor is exactly 1, the hand-computed timeline stays exact
    g, s = 1.5, 0.5
    flat = one_actor(
        1,
        g,
        s,
        generation=GenerationTime(fixed_s=g, spread=(2.0, 2.0, 2.0)),
        learner=LearnerTime(overhead_s=s, spread=(0.3,) * 5),
    )
    assert simulate(flat) == simulate(one_actor(1, g, s))


def test_spread_draws_have_mean_one_within_the_quantiles() -> None:
    # quantiles 1, 2, 3 (seconds): uniform on [1, 3], mean 2, so factors lie in [0.5, 1.5]
    spread = Spread((1.0, 2.0, 3.0), np.random.default_rng(0))
    draws = np.array([spread.draw() for _ in range(40_000)])
    assert 0.5 <= draws.min() and draws.max() <= 1.5
    assert draws.mean() == pytest.approx(1.0, abs=0.01)
    assert np.mean(draws < 1.0) == pytest.approx(0.5, abs=0.01)


def test_spread_makes_a_balanced_pipeline_wait() -> None:
    # g = s: with constant times the learner never waits at η = 1; with times that vary
    # (same means) each step waits for the slower of the two sides, so throughput falls
    g = s = 1.0
    steady = simulate(one_actor(1, g, s, num_steps=400, warmup_steps=20))
    assert steady.learner_idle_fraction == 0.0 and steady.samples_per_s == S / g
    wide = (0.5, 1.0, 1.5)
    noisy = simulate(
        one_actor(
            1,
            g,
            s,
            num_steps=400,
            warmup_steps=20,
            generation=GenerationTime(fixed_s=g, spread=wide),
            learner=LearnerTime(overhead_s=s, spread=wide),
        )
    )
    assert noisy.mean_step_s == pytest.approx(s, rel=0.05)
    assert noisy.mean_generate_s == pytest.approx(g, rel=0.05)
    assert noisy.learner_idle_fraction > 0.05
    assert noisy.samples_per_s < 0.95 * steady.samples_per_s


@pytest.mark.parametrize(
    ("spread", "why"),
    [
        ((1.0,), "need >= 2"),
        ((2.0, 1.0), "ascending"),
        ((-1.0, 1.0), ">= 0"),
        ((0.0, 0.0), "all quantiles are 0"),
        ((1.0, float("inf")), "finite"),
    ],
)
def test_bad_spread_is_refused_by_name(spread: tuple[float, ...], why: str) -> None:
    with pytest.raises(ValueError, match="learner.spread: .*" + why):
        LearnerTime(overhead_s=1.0, spread=spread)
    with pytest.raises(ValueError, match=why):
        check_spread(spread, "x")
