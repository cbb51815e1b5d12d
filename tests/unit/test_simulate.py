"""bench/sim: the simulator reproduces hand-computed timelines exactly and obeys replay's rules.

Expected numbers come from the algebra of each case, never from the simulator. Times are
dyadic (1.0, 1.5, 0.5, 0.25) so every sum the simulator forms is exact in floating point and
the results compare with `==`. Notation: one actor with concurrency = B groups per step, group
size 2, so S = 2B samples per step; constant generation time g per batch, step time s, weight
sync d. By default the actor waits for weights >= c - η for credits granted at hub version c and
the learner asks for batch k+1 (version v+1) as soon as batch k arrives (pipelined request);
`OLD` turns both off, the earlier behaviour, whose algebra the first cases were derived for.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from replay import admission

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.sim.calibrate import calibrate, load_points, nnls  # noqa: E402
from bench.sim.cluster import ClusterAssumptions  # noqa: E402
from bench.sim.hub import FreeSlots  # noqa: E402
from bench.sim.model import SimConfig, SimulationStalled, simulate  # noqa: E402
from bench.sim.timing import GenerationTime, LearnerTime, LengthModel, WeightSync  # noqa: E402

B, GROUP_SIZE = 4, 2
S = B * GROUP_SIZE
WARMUP, STEPS = 8, 20
MEASURED = STEPS - WARMUP
OLD = {"wait_for_weights": False, "pipeline_requests": False}


def one_actor(eta: int, g: float, s: float, d: float = 0.0, **kw: object) -> SimConfig:
    base: dict[str, object] = dict(
        num_actors=1, concurrency=B, group_size=GROUP_SIZE, groups_per_step=B,
        max_staleness=eta, num_steps=STEPS, warmup_steps=WARMUP,
        lengths=LengthModel(median_tokens=3, sigma=0.0, prompt_tokens=1),
        generation=GenerationTime(fixed_s=g), learner=LearnerTime(overhead_s=s),
        sync=WeightSync(num_buckets=1, bucket_latency_s=d),
    )  # fmt: skip
    return SimConfig(**(base | kw))  # type: ignore[arg-type]


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


def test_pipelined_learner_bound_regenerates_the_window_end() -> None:
    # η = 1, 2g <= s: at the start of step k (weights k just landed) the request for k+1 makes
    # the hub adopt k+1 and serve batch k+1, which the actor made during step k-1 with weights
    # k-1 (staleness 1). Admission then opens batch k+2 at once, one step earlier than the
    # weights it needs: made with weights k it would be consumed at k+2 (staleness 2), so the
    # adoption of k+2 at the next step's start drops it (B groups) and the actor makes it again
    # with weights k+1 while that step runs. So every step trains on staleness-1 groups, drops
    # B and keeps the actor busy 2g of s; the last step sends no request, so its actor idles
    # throughout, and the learner's final Version drops that step's window-end batch.
    g, s = 0.5, 1.5
    r = simulate(one_actor(1, g, s))
    assert r.samples_per_s == S / s
    assert r.learner_idle_fraction == 0.0
    assert r.actor_idle_fraction == ((MEASURED - 1) * (s - 2 * g) + s) / (MEASURED * s)
    assert r.staleness_histogram == [0, MEASURED * B]
    assert r.groups_dropped_stale == MEASURED * B


def test_eta0_with_slow_sync_regenerates_every_batch() -> None:
    # the earlier actor and learner: credits come with Version(v+1) but weights v+1 land d
    # later: the batch started at once carries v, arrives stale (1 > 0), is dropped and
    # regenerated with v+1 (d < g), so a step costs g + s + g and drops B groups
    g, s, d = 1.0, 0.5, 0.25
    r = simulate(one_actor(0, g, s, d, **OLD))
    assert r.samples_per_s == S / (2 * g + s)
    assert r.learner_idle_fraction == 2 * g / (2 * g + s)
    assert r.actor_idle_fraction == s / (2 * g + s)
    assert r.groups_dropped_stale == MEASURED * B
    assert r.staleness_histogram == [MEASURED * B]
    assert r.sync_s == d and r.mean_sync_latency_s == d


def test_eta0_without_weight_wait_pipelined() -> None:
    # pipelined learner, actor not waiting: the credits for step k+1 come at the step's start;
    # the batch made at once with weights v is stale on arrival at g, dropped, and made again
    # with v+1 (landed at s + d <= g): a step costs 2g and drops B groups
    g, s, d = 1.0, 0.5, 0.25
    r = simulate(one_actor(0, g, s, d, wait_for_weights=False))
    assert r.samples_per_s == S / (2 * g)
    assert r.learner_idle_fraction == (2 * g - s) / (2 * g)
    assert r.groups_dropped_stale == MEASURED * B
    assert r.staleness_histogram == [MEASURED * B]


def test_actor_waits_for_weights() -> None:
    # asyncrl's actor in the same case waits for the credits' version (c - η = c at η = 0):
    # a step costs g + s + d and nothing is dropped
    g, s, d = 1.0, 0.5, 0.25
    r = simulate(one_actor(0, g, s, d))
    assert r.samples_per_s == S / (g + s + d)
    assert r.learner_idle_fraction == (g + d) / (g + s + d)
    assert r.groups_dropped_stale == 0


def test_capacity_bound_comes_from_replay_admission(monkeypatch: pytest.MonkeyPatch) -> None:
    # capacity = B with η = 4 and concurrency 2B: admission caps stored + in flight at B, so the
    # actor regenerates only after the learner took the last batch. The pipelined request takes
    # batch k+1 out at the start of step k, when weights k have just landed, so batch k+2 is
    # made then with weights k and consumed at k+2: staleness 2 (1 for a learner asking after
    # its step), not η = 4
    calls: list[dict[str, int]] = []
    real = admission.credits_available

    def spy(**kw: int) -> int:
        calls.append(kw)
        return real(**kw)

    monkeypatch.setattr(admission, "credits_available", spy)
    g, s = 1.0, 1.5
    r = simulate(one_actor(4, g, s, capacity_groups=B, concurrency=2 * B))
    assert r.staleness_histogram == [0, 0, MEASURED * B, 0, 0]
    assert r.samples_per_s == S / s
    assert calls and all(c["stored"] + c["in_flight"] <= B for c in calls)
    assert all(c["capacity"] == B and c["max_staleness"] == 4 for c in calls)


def test_no_credit_from_admission_stalls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "credits_available", lambda **kw: 0)
    with pytest.raises(SimulationStalled, match="no event left after 0 of"):
        simulate(one_actor(1, 1.0, 1.0))


def test_free_slots_shortcut_matches_full_allocate() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        slots = FreeSlots()
        full: dict[str, int] = {}
        for i in range(int(rng.integers(1, 40))):
            actor, n = f"a{i:03d}", int(rng.integers(1, 6))
            slots.add(actor, n)
            full[actor] = n
            if rng.random() < 0.3:
                slots.add(actor, -n)
                del full[actor]
        total = int(rng.integers(0, 60))
        assert admission.allocate(total, slots.candidates(total)) == admission.allocate(total, full)


def test_generation_time_is_bounded_by_the_longest_sample() -> None:
    gen = GenerationTime(fixed_s=0.5, step_s=0.25, token_s=0.125)
    assert gen.seconds([4, 1, 1, 2], prompt_tokens=7) == 0.5 + 0.25 * 4 + 0.125 * 8


def test_cluster_assumptions_use_the_real_bucket_plan() -> None:
    derived = ClusterAssumptions().derived()
    assert derived["num_params"] == 8_030_261_248  # Llama-3.1-8B
    assert derived["num_buckets"] == 16  # 16.06 GB in buckets of at most 1 GiB
    assert derived["sync"]["seconds"] == pytest.approx(16_060_522_496 / 50e9 + 16 * 5e-3)


def test_nnls_recovers_exact_coefficients() -> None:
    a = np.array([[1.0, 2.0, 30.0], [1.0, 5.0, 10.0], [1.0, 9.0, 70.0], [1.0, 1.0, 5.0]])
    x = np.array([0.5, 0.0, 0.02])
    assert nnls(a, a @ x) == pytest.approx(x, abs=1e-12)


def synthetic_measurements(path: Path) -> None:
    """Points as bench/staleness.py would measure them, made by a known ground truth."""
    lengths = LengthModel(median_tokens=24, sigma=0.6, max_tokens=128, prompt_tokens=16)
    measured_lengths = lengths.sample(np.random.default_rng(1), 4000).tolist()
    points = []
    for eta in (0, 1, 2, 4):
        r = simulate(SimConfig(
            num_actors=2, concurrency=4, group_size=4, groups_per_step=4, max_staleness=eta,
            num_steps=60, warmup_steps=10, seed=eta + 10, lengths=lengths,
            generation=GenerationTime(fixed_s=0.05, step_s=0.002, token_s=0.0004),
            learner=LearnerTime(overhead_s=0.1, token_s=0.0008),
            sync=WeightSync(num_buckets=1, bucket_latency_s=0.01),
        ))  # fmt: skip
        points.append({
            "max_staleness": eta, "samples_per_s": {"median": r.samples_per_s},
            "learner_wait_fraction": r.learner_idle_fraction,
            "actor_wait_fraction": r.actor_idle_fraction, "step_time_s": r.mean_step_s,
            "generate_time_s": r.mean_generate_s, "generate_batch_seqs": r.mean_batch_seqs,
            "response_lengths": measured_lengths, "prompt_tokens": 16, "sync_s": 0.01, "loss": 0.0,
        })  # fmt: skip
    config = {"run": {"num_actors": 2}, "actor": {"concurrency": 4, "group_size": 4},
              "learner": {"groups_per_step": 4}}  # fmt: skip
    path.write_text(json.dumps({"config": config, "points": points}))


def test_calibration_reproduces_synthetic_points(tmp_path: Path) -> None:
    measured = tmp_path / "staleness.json"
    synthetic_measurements(measured)
    cal = calibrate(load_points(measured)).to_dict()
    assert cal["sync_s"] == pytest.approx(0.01)
    for point in cal["points"]:
        assert abs(point["rel_err_samples_per_s"]) < 0.05
        assert abs(point["abs_err_learner_wait_fraction"]) < 0.05
        assert abs(point["abs_err_actor_wait_fraction"]) < 0.05


def test_load_points_names_the_bad_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"points": [{"max_staleness": 0, "samples_per_s": "fast"}]}))
    with pytest.raises(ValueError, match=r"points\[0\]\.response_lengths"):
        load_points(bad)
    with pytest.raises(ValueError, match="not found"):
        load_points(tmp_path / "missing.json")


def test_cli_calibrate_and_predict(tmp_path: Path) -> None:
    measured, out, png = tmp_path / "m.json", tmp_path / "sim.json", tmp_path / "sim.png"
    synthetic_measurements(measured)
    script = str(REPO / "bench" / "simulate.py")
    predict = [sys.executable, script, "predict", "--world", "8", "--actors", "6",
               "--groups-per-step", "4", "--concurrency", "2", "--group-size", "4",
               "--eta", "0", "2", "--measure", "3", "--warmup", "2", "--repeats", "2",
               "--jobs", "1", "--measured", str(measured), "--out", str(out),
               "--png", str(png)]  # fmt: skip
    subprocess.run(predict, check=True, capture_output=True, cwd=tmp_path)
    data = json.loads(out.read_text())
    assert [p["max_staleness"] for p in data["predictions"]] == [0, 2]
    assert data["assumptions"]["world"] == 8 and data["command"].startswith("python bench/")
    assert data["calibration"]["status"] == "ok" and png.stat().st_size > 0
    calibrate_cmd = [sys.executable, script, "calibrate", "--measured", str(measured),
                     "--out", str(out)]  # fmt: skip
    subprocess.run(calibrate_cmd, check=True, capture_output=True, cwd=tmp_path)
    again = json.loads(out.read_text())
    assert again["predictions"] == data["predictions"]
    assert len(again["calibration"]["points"]) == 4
