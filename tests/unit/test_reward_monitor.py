"""learner/alarms.py RewardMonitor: learner-side reward metrics and run-level alarms (reward
jump with collapse, saturation, canary alarms from the actors)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from asyncrl.config import RewardConfig
from asyncrl.protocol.messages import Group, Trajectory
from learner.alarms import RewardMonitor, component_means


def group(components: dict[str, list[float]], metadata: dict | None = None) -> Group:
    n = len(next(iter(components.values())))
    trajs = [
        Trajectory(
            tokens=np.arange(3, dtype=np.int32),
            prompt_len=1,
            loss_mask=np.ones(2, np.uint8),
            behavior_logprobs=np.zeros(2, np.float32),
            reward=0.0,
            min_policy_version=0,
            max_policy_version=0,
            finish_reason="stop",
        )
        for _ in range(n)
    ]
    return Group.build(
        group_id="g",
        prompt_id="p",
        credit_id=0,
        actor_id="a",
        seq=0,
        trajectories=trajs,
        reward_components=components,
        metadata=metadata,
    )


def test_component_means_per_step() -> None:
    groups = [group({"task": [1.0, 0.0], "rm": [2.0, 4.0]}), group({"task": [1.0, 1.0]})]
    assert component_means(groups) == {"reward/task": 0.75, "reward/rm": 3.0}


def test_reward_jump_with_length_collapse_raises_an_alarm(tmp_path: Path) -> None:
    mon = RewardMonitor(RewardConfig(alarm_window_steps=3, alarm_reward_jump=0.3), tmp_path)
    g = [group({"task": [0.0, 1.0]})]
    for step in range(3):
        mon.step(step, g, {"reward_mean": 0.1, "response_len_mean": 40.0, "entropy": 1.0})
    assert not mon.alarms and not mon.take_alarms()
    for step in range(3, 6):  # reward jumps while answers shrink to a few tokens
        mon.step(step, g, {"reward_mean": 0.9, "response_len_mean": 4.0, "entropy": 0.9})
    [alarm] = mon.take_alarms()
    assert alarm.name == "reward:reward_jump_collapse" and alarm.step == 5
    assert alarm.evidence["length_before"] == 40.0 and alarm.evidence["length_after"] == 4.0
    assert "reward_jump_collapse" in alarm.message
    assert mon.take_alarms() == [] and mon.alarms == [alarm]  # taken once, kept in the record


def test_a_reward_jump_without_collapse_is_learning_not_an_alarm() -> None:
    mon = RewardMonitor(RewardConfig(alarm_window_steps=2))
    g = [group({"task": [0.0, 1.0]})]
    for step, reward in enumerate([0.1, 0.1, 0.9, 0.9]):
        mon.step(step, g, {"reward_mean": reward, "response_len_mean": 10.0, "entropy": 1.0})
    assert not mon.alarms


def test_a_saturated_component_raises_an_alarm_once() -> None:
    mon = RewardMonitor(RewardConfig(alarm_saturate_steps=3))
    for step in range(6):
        mon.step(step, [group({"task": [0.0, 1.0], "rm": [5.0, 5.0]})], {"reward_mean": 0.5})
    assert [a.name for a in mon.alarms] == ["reward:saturated:rm"]


def test_canary_alarms_from_actors_are_repeated_with_evidence() -> None:
    evidence = {"label": "hedged", "reward": 1.0, "completion": "3 or 4"}
    meta = {"reward": {"canary": {"alarms": [evidence]}, "flags": {"hedged": 2}}}
    mon = RewardMonitor(RewardConfig())
    out = mon.step(7, [group({"task": [0.0]}, meta)], {"reward_mean": 0.0})
    assert out["reward/canary_alarms"] == 1.0 and out["reward/flag/hedged"] == 2.0
    assert mon.alarms[0].name == "reward:canary"
    assert mon.alarms[0].evidence["label"] == "hedged" and mon.alarms[0].policy_version == 7
