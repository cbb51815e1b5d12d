"""W&B only when configured; the store and the inspector on a multi-turn trajectory."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from asyncrl.config import TrajectoriesConfig
from asyncrl.protocol.messages import Group, Trajectory
from learner.observe import start_wandb
from learner.trajectory_store import Kept, TrajectoryWriter, build_table, load_table
from tools.inspect import show, turns


def wandb_cfg(project: str) -> SimpleNamespace:
    return SimpleNamespace(metrics=SimpleNamespace(wandb_project=project, wandb_mode="offline"))


def test_wandb_is_not_imported_unless_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it would raise ImportError
    assert start_wandb(wandb_cfg(""), Path(".")) is None


def test_wandb_configured_but_missing_fails_naming_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ValueError, match=r"metrics.wandb_project.*asyncrl\[wandb\]"):
        start_wandb(wandb_cfg("my-project"), Path("."))


def multi_turn_trajectory() -> Trajectory:
    """Prompt [1, 2]; model turn [10, 11]; tool output [20, 21, 22] (mask 0); model turn [12]."""
    return Trajectory(
        tokens=np.array([1, 2, 10, 11, 20, 21, 22, 12], np.int32),
        prompt_len=2,
        loss_mask=np.array([1, 1, 0, 0, 0, 1], np.uint8),
        behavior_logprobs=np.array([-1.0, -2.0, 0, 0, 0, -0.5], np.float32),
        reward=0.75,
        min_policy_version=3,
        max_policy_version=4,
        finish_reason="stop",
        num_turns=2,
    )


def multi_turn_group() -> Group:
    return Group.build(
        group_id="a/0",
        prompt_id="p-1",
        credit_id=7,
        actor_id="a",
        seq=0,
        trajectories=[multi_turn_trajectory()],
        reward_components={"position": [0.5], "multiset": [1.0]},
    )


def test_multi_turn_trajectory_round_trips_and_shows_turn_by_turn(tmp_path: Path) -> None:
    group = multi_turn_group()
    learner = [np.array([-1.5, -2.0, 0, 0, 0, -0.25], np.float32)]
    columns = {
        "learner_logprobs": learner,
        "train_version": np.array([5]),
        "learner_version": np.array([5]),
        "staleness": np.array([2]),
        "advantage": np.array([0.0]),
        "task": ["lookup"],
    }
    writer = TrajectoryWriter(tmp_path, TrajectoriesConfig(), {"tokenizer_dir": ""})
    writer.write_sample(6, build_table(6, [group], [Kept(0, 0, "sample")], columns))
    record = load_table(tmp_path).record(0)
    assert record["components"] == {"multiset": 1.0, "position": 0.5}
    assert turns(record) == [("model", 0, 2), ("environment", 2, 5), ("model", 5, 6)]
    text = show(record, lambda ids: "".join(f"<{int(t)}>" for t in ids))
    assert "[model] <10><11>" in text and "[environment] <20><21><22>" in text
    assert "[model] <12>" in text and "reward components: multiset 1, position 0.5" in text
    assert f"{np.exp(-1.5 + 1.0):.4f}" in text  # the first token's IS weight π/μ
    assert "staleness 2" in text and "task lookup" in text


def test_sample_stays_bounded_and_spread_over_the_run(tmp_path: Path) -> None:
    cfg = TrajectoriesConfig(sample_every_steps=2, max_sampled_steps=4, max_flagged=3)
    writer = TrajectoryWriter(tmp_path, cfg, {"tokenizer_dir": ""})
    table = build_table(0, [multi_turn_group()], [Kept(0, 0, "sample")], {})
    for step in range(1, 65):  # as the learner does: a sample on every due step
        if writer.sample_due(step):
            writer.write_sample(step, {**table, "step": np.array([step])})
    steps = sorted(int(s) for s in load_table(tmp_path)["step"])
    stride = writer.meta["stride"]
    assert len(steps) <= 4 and stride == 8  # 32 due steps at stride 1 -> 4 at stride 8
    assert steps == [16, 32, 48, 64]  # spread evenly over the whole run
    assert writer.room(5) == 3 and writer.meta["flagged_dropped"] == 2


def test_reward_alarms_are_raised_like_the_stability_alarms(tmp_path: Path) -> None:
    """The reward monitor's alarms go through the observer: one alarms.jsonl, one shape."""
    import threading

    from asyncrl.config import RewardConfig, RunConfig
    from learner.alarms import RewardMonitor, read_alarms
    from learner.observe import LearnerObserver

    learner = SimpleNamespace(
        cfg=RunConfig(),
        run_dir=tmp_path,
        model_dir=tmp_path,
        conn=None,
        step=0,
        policy_version=0,
        live=None,
        stop_event=threading.Event(),
    )
    observer = LearnerObserver(learner)  # type: ignore[arg-type]
    monitor = RewardMonitor(RewardConfig(alarm_saturate_steps=2), tmp_path)
    traj = multi_turn_trajectory()
    group = Group.build(
        group_id="a/1",
        prompt_id="p-2",
        credit_id=8,
        actor_id="a",
        seq=1,
        trajectories=[traj, traj],
        reward_components={"format": [1.0, 1.0], "task": [0.0, 1.0]},
    )
    for step in range(3):
        monitor.step(step, [group], {"reward_mean": 0.5, "policy_version": 10 + step})
    for alarm in monitor.take_alarms():
        observer.raise_alarm(alarm)
    records = read_alarms(tmp_path / "alarms.jsonl")
    assert [(r["name"], r["action"]) for r in records] == [("reward:saturated:format", "warn")]
    assert records[0]["policy_version"] == 11 and records[0]["evidence"]["value"] == 1.0
    assert not learner.stop_event.is_set()


def test_outliers_are_judged_against_the_recent_steps(tmp_path: Path) -> None:
    """A reward far from the recent steps' mean, or a completion far longer, is kept."""
    import threading

    from asyncrl.config import RunConfig
    from learner.observe import LearnerObserver

    learner = SimpleNamespace(
        cfg=RunConfig(),
        run_dir=tmp_path,
        model_dir=tmp_path,
        conn=None,
        step=0,
        policy_version=0,
        live=None,
        stop_event=threading.Event(),
    )
    observer = LearnerObserver(learner)  # type: ignore[arg-type]

    def batch(rewards: list[float], completion: int = 4) -> SimpleNamespace:
        trajectories = []
        for reward in rewards:
            traj = Trajectory(
                tokens=np.arange(2 + completion, dtype=np.int32),
                prompt_len=2,
                loss_mask=np.ones(completion, np.uint8),
                behavior_logprobs=np.zeros(completion, np.float32),
                reward=reward,
                min_policy_version=0,
                max_policy_version=0,
                finish_reason="stop",
            )
            trajectories.append(traj)
        group = Group.build(
            group_id="g", prompt_id="p", credit_id=0, actor_id="a", seq=0, trajectories=trajectories
        )
        return SimpleNamespace(groups=[group])

    for _ in range(6):  # rewards around 0.5 (std 0.1), 4-token completions
        assert observer.outliers(batch([0.4, 0.5, 0.6, 0.5])) == []
    z = RunConfig().trajectories.outlier_z
    far = 0.5 + (z + 1) * 0.0707  # beyond z standard deviations of the recent rewards
    kept = observer.outliers(batch([0.5, far, 0.5, 0.5]))
    assert [(k.group, k.index, k.reason) for k in kept] == [(0, 1, "outlier:reward")]
    long = observer.outliers(batch([0.5, 0.4, 0.6, 0.5], completion=4 + int(z + 2)))
    assert {k.reason for k in long} == {"outlier:length"} and len(long) == 4
    assert observer.outliers(batch([0.5, 0.4, 0.6, 0.5], completion=1)) == []  # short: no


@pytest.mark.parametrize(
    ("settings", "first", "final", "waits_for"),
    [
        (["eval.every_versions=10"], 0, 40, 40),  # the run crossed 40: its evaluation is due
        (["eval.every_versions=10"], 0, 47, 40),  # the last multiple reached
        (["eval.every_versions=10"], 0, 7, 0),  # only the start was due (eval.at_start)
        (["eval.every_versions=10", "eval.at_start=false"], 0, 7, None),  # none due
        (["eval.every_versions=10"], 40, 47, None),  # resumed at 40: asked of an earlier process
        (["eval.every_versions=0"], 0, 40, None),  # evaluation off
    ],
)
def test_the_final_evaluation_is_waited_for_only_when_this_process_made_it_due(
    tmp_path: Path, settings: list[str], first: int, final: int, waits_for: int | None
) -> None:
    import threading

    from asyncrl.config import load_config
    from learner.observe import LearnerObserver

    learner = SimpleNamespace(
        cfg=load_config(None, settings),
        run_dir=tmp_path,
        model_dir=tmp_path,
        conn=None,
        step=0,
        policy_version=first,
        live=None,
        stop_event=threading.Event(),
    )
    observer = LearnerObserver(learner)  # type: ignore[arg-type]
    if waits_for is None:
        assert observer.wait_final_eval(
            final, timeout_s=60.0
        )  # returns at once: nothing to wait for
        return
    observer.last_eval = {"requested_version": waits_for - 10}  # an older evaluation
    assert not observer.wait_final_eval(final, timeout_s=0.3)  # times out, says so
    arrived = threading.Timer(
        0.2, lambda: setattr(observer, "last_eval", {"requested_version": waits_for})
    )
    arrived.start()  # as on the connection's thread
    assert observer.wait_final_eval(final, timeout_s=60.0)
    learner.stop_event.set()  # a stop signal ends the wait at once
    observer.last_eval = {}
    assert not observer.wait_final_eval(final, timeout_s=60.0)
