"""bench/staleness.py on a tiny budget: the sweep runs the real system and writes well-formed JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sweep_writes_wellformed_results(tmp_path: Path) -> None:
    out = tmp_path / "staleness.json"
    cmd = [
        sys.executable,
        str(REPO / "bench" / "staleness.py"),
        "--etas",
        "0,4",
        "--losses",
        "decoupled_ppo",
        "--budget-s",
        "45",
        "--out",
        str(out),
        "--set",
        f"model.cache_dir={json.dumps(str(tmp_path / 'models'))}",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[1/2] loss=decoupled_ppo η=0" in proc.stdout
    data = json.loads(out.read_text())
    assert data["speedup_eta4_vs_eta0"] > 0
    assert [(p["loss"], p["max_staleness"]) for p in data["points"]] == [
        ("decoupled_ppo", 0),
        ("decoupled_ppo", 4),
    ]
    for point in data["points"]:
        eta = point["max_staleness"]
        assert point["steps"] >= 3 and point["samples_per_s"] > 0
        assert 0.0 <= point["learner_wait_fraction"] <= 1.0
        assert 0.0 <= point["actor_wait_fraction"] <= 1.0
        assert len(point["staleness_hist"]) == eta + 2 and point["staleness_hist"][-1] == 0
        assert 0.0 <= point["final_reward"] <= 1.0
        for key in ("step_time_quantiles", "generate_time_quantiles"):  # the simulator's spread
            q = point[key]
            assert len(q) == 101 and q == sorted(q) and q[0] > 0, (key, q)
        assert point["reward_at_fixed_steps"]["steps"] >= 3
        assert point["weight_update"] == "between_groups" and point["inflight_updates"] == 0
        assert point["tokens_per_weight_version"] > 0
        assert point["config"] == {"actor": {"weight_update": "between_groups"}}
        assert point["inflight_pause_s"] == 0.0 and point["weights_loaded"] >= 1
        assert point["weight_load_s"] > 0 and len(point["loadavg"]) == 3
    assert data["inflight_eta1_over_between_eta4"] is None  # no in-flight point in this sweep
    assert data["inflight_eta1_over_between_eta4_per_seed"] == []
    table = data["by_mode"]["between_groups"]
    assert table["samples_per_s"]["4"]["median"] == data["points"][1]["samples_per_s"]
    assert table["dropped_stale"]["0"]["n"] == 1
    assert "file" in data["final_reward_eta8_minus_eta0_from"]  # η = 8 not swept here
    for name in ("staleness_throughput.png", "staleness_reward.png"):
        assert (tmp_path / name).stat().st_size > 1000
