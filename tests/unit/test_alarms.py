"""Stability alarms over recorded metric streams: real healthy runs must not fire; the same
streams with a fault written into them must fire the right detector, near the fault, with the
evidence (values and window) in the alarm."""

from __future__ import annotations

import copy
import gzip
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from asyncrl.config import AlarmsConfig, load_config
from learner.alarms import ALARMS_FILE, Alarm, AlarmMonitor, read_alarms, scan

DATA = Path(__file__).resolve().parents[1] / "data"
STREAMS = ("metrics_tiny_cpu_decoupled_eta4.jsonl.gz", "metrics_tiny_cpu_ppo_eta0.jsonl.gz")
CFG = AlarmsConfig()


def stream(name: str = STREAMS[0]) -> list[dict[str, Any]]:
    """A real metrics.jsonl of a tiny run (tests/data/README.md says how it was made)."""
    with gzip.open(DATA / name, "rt") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("name", STREAMS)
def test_healthy_runs_fire_nothing(name: str) -> None:
    rows = stream(name)
    assert len(rows) >= 800
    assert scan(rows, CFG) == []


@pytest.mark.parametrize("name", STREAMS)
def test_a_reward_component_that_keeps_varying_does_not_saturate(name: str) -> None:
    rows = stream(name)
    for row in rows:
        row["reward/verifier"] = row["reward_mean"]
    assert scan(rows, CFG) == []


def edit(rows: list[dict[str, Any]], first: int, last: int, change: Callable[[dict], None]) -> list:
    """A copy of `rows` with `change` applied to steps first..last (inclusive)."""
    out = copy.deepcopy(rows)
    for row in out:
        if first <= row["step"] <= last:
            change(row)
    return out


def fired(rows: list[dict[str, Any]], name: str) -> Alarm:
    alarms = [a for a in scan(rows, CFG) if a.name == name]
    assert alarms, f"{name} did not fire; fired: {[a.name for a in scan(rows, CFG)]}"
    return alarms[0]


def test_nan_fires_at_once_even_during_warm_up() -> None:
    rows = edit(stream(), 5, 5, lambda r: r.update(entropy=None))
    alarm = fired(rows, "nan")
    assert alarm.step == 5 and "entropy" in alarm.message
    assert alarm.evidence["values"] == {"entropy": None}
    live = AlarmMonitor(CFG).observe({"step": 1, "policy_version": 1, "loss": math.inf})
    assert [a.name for a in live] == ["nan"]


def test_ess_collapse() -> None:
    alarm = fired(edit(stream(), 700, 760, lambda r: r.update(ess=0.05)), "ess_collapse")
    assert 700 < alarm.step <= 700 + CFG.window_steps
    assert alarm.evidence["median"] < CFG.ess_min and alarm.evidence["threshold"] == CFG.ess_min
    assert len(alarm.evidence["values"]) == CFG.window_steps
    assert alarm.evidence["window"] == [alarm.step - CFG.window_steps + 1, alarm.step]


def test_is_weight_blowup() -> None:
    alarm = fired(
        edit(stream(), 700, 760, lambda r: r.update(is_weight_max=500.0)), "is_weight_blowup"
    )
    assert (
        700 < alarm.step <= 700 + CFG.window_steps and alarm.evidence["median"] > CFG.is_weight_max
    )
    assert "blew up" in alarm.message and alarm.evidence["values"][-1] == 500.0


def test_kl_spike_needs_more_than_one_step() -> None:
    one = edit(stream(), 700, 700, lambda r: r.update(mismatch_kl=5.0))
    assert [a for a in scan(one, CFG) if a.name == "kl_spike"] == []
    alarm = fired(edit(stream(), 700, 702, lambda r: r.update(mismatch_kl=5.0)), "kl_spike")
    assert alarm.step == 701 and alarm.evidence["value"] == 5.0
    assert alarm.evidence["earlier_median"] < 0.5 and len(alarm.evidence["earlier_values"]) == 20


def test_entropy_collapse() -> None:
    rows = edit(stream(), 400, 10**6, lambda r: r.update(entropy=r["entropy"] * 0.02))
    alarm = fired(rows, "entropy_collapse")
    assert 400 < alarm.step <= 400 + CFG.window_steps
    assert alarm.evidence["recent"] < CFG.entropy_collapse_frac * alarm.evidence["earlier"]


def test_reward_jump_with_length_collapse_and_blow_up() -> None:
    short = edit(stream(), 300, 10**6, lambda r: r.update(reward_mean=1.0, response_len_mean=1.0))
    alarm = fired(short, "reward_jump_length")
    assert 300 < alarm.step <= 300 + 2 * CFG.window_steps and "collapsed" in alarm.message
    assert alarm.evidence["length_ratio"] < CFG.length_collapse_ratio
    assert alarm.evidence["reward_recent"] - alarm.evidence["reward_earlier"] >= CFG.reward_jump
    long = edit(stream(), 300, 10**6, lambda r: r.update(reward_mean=1.0, response_len_mean=40.0))
    assert "blew up" in fired(long, "reward_jump_length").message


def test_reward_jump_with_entropy_collapse() -> None:
    rows = edit(
        stream(), 300, 10**6, lambda r: r.update(reward_mean=1.0, entropy=r["entropy"] * 0.2)
    )
    alarm = fired(rows, "reward_jump_entropy")
    assert 300 < alarm.step <= 300 + 2 * CFG.window_steps
    assert alarm.evidence["recent"] < CFG.entropy_drop_ratio * alarm.evidence["earlier"]


def test_length_change_without_a_reward_jump_is_not_a_reward_jump() -> None:
    rows = edit(stream(), 300, 10**6, lambda r: r.update(response_len_mean=1.0))
    assert not [a for a in scan(rows, CFG) if a.name.startswith("reward_jump")]


def test_grad_norm_spike() -> None:
    alarm = fired(edit(stream(), 700, 705, lambda r: r.update(grad_norm=500.0)), "grad_norm_spike")
    assert alarm.step == 701 and alarm.evidence["floor"] == CFG.grad_norm_min


def test_staleness_drift() -> None:
    rows = edit(stream(STREAMS[1]), 400, 10**6, lambda r: r.update(staleness_mean=3.0))
    alarm = fired(rows, "staleness_drift")
    assert 400 < alarm.step <= 400 + CFG.window_steps
    assert alarm.evidence["warmup"] == 0.0 and alarm.evidence["recent"] >= CFG.staleness_drift


def test_component_saturation() -> None:
    rows = stream()
    for row in rows:  # a format reward that varies, then is maxed out on every sample
        row["reward/format"] = 1.0 if row["step"] >= 600 else row["reward_mean"] * 0.9
    alarm = fired(rows, "component_saturation")
    assert 600 + CFG.window_steps - 1 <= alarm.step <= 600 + CFG.window_steps + 1
    assert alarm.evidence["key"] == "reward/format" and set(alarm.evidence["values"]) == {1.0}


def test_cooldown_keeps_one_episode_to_one_alarm() -> None:
    rows = edit(stream(), 700, 1000, lambda r: r.update(ess=0.05))
    alarms = [a for a in scan(rows, CFG) if a.name == "ess_collapse"]
    assert len(alarms) == math.ceil((1000 - alarms[0].step + 1) / CFG.cooldown_steps)
    assert all(
        b.step - a.step == CFG.cooldown_steps for a, b in zip(alarms, alarms[1:], strict=False)
    )


def test_alarm_records_are_strict_json() -> None:
    alarm = AlarmMonitor(CFG).observe({"step": 3, "policy_version": 3, "entropy": math.nan})[0]
    text = json.dumps(alarm.to_json(), allow_nan=False)
    assert json.loads(text)["evidence"]["values"] == {"entropy": None}


def test_alarms_jsonl_holds_one_record_shape_and_older_files_still_read(tmp_path: Path) -> None:
    """`Alarm.record` is every line's shape; a reward alarm of an older run ({"alarm", "step",
    "evidence"}) reads back in it, and a torn last line is skipped."""
    alarm = Alarm("reward:canary", 4, 9, "canary rewarded", {"actor": "a"})
    lines = [
        json.dumps(alarm.record("pause")),
        json.dumps({"alarm": "saturated:format", "step": 6, "evidence": {"value": 1.0}}),
        '{"name": "nan", "st',
    ]
    path = tmp_path / ALARMS_FILE
    path.write_text("\n".join(lines))
    first, older = read_alarms(path)
    assert first == {**alarm.to_json(), "action": "pause"}
    assert older == {
        "name": "reward:saturated:format",
        "step": 6,
        "policy_version": 6,
        "message": json.dumps({"value": 1.0}),
        "evidence": {"value": 1.0},
        "action": "warn",
    }
    assert set(first) == set(older)
    assert read_alarms(tmp_path / "none.jsonl") == []


def test_actions_name_known_alarms() -> None:
    cfg = load_config(None, ['alarms.pause_on=["nan", "kl_spike"]', 'alarms.stop_on=["all"]'])
    assert cfg.alarms.names("pause_on") == ("nan", "kl_spike")
    assert "component_saturation" in cfg.alarms.names("stop_on")
    with pytest.raises(ValueError, match="alarms.stop_on: unknown alarms"):
        load_config(None, ['alarms.stop_on=["nan", "typo"]'])
    with pytest.raises(ValueError, match="alarms.kl_spike_factor"):
        load_config(None, ["alarms.kl_spike_factor=1"])
