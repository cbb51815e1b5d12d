"""bench/stability.py at a tiny step budget: real runs of exactly --steps steps, well-formed JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_fixed_step_sweep_writes_wellformed_results(tmp_path: Path) -> None:
    out = tmp_path / "stability.json"
    cmd = [
        sys.executable,
        str(REPO / "bench" / "stability.py"),
        "--etas",
        "0,2",
        "--losses",
        "ppo,stale_clip",
        "--seeds",
        "1",
        "--steps",
        "12",
        "--out",
        str(out),
        "--set",
        f"model.cache_dir={json.dumps(str(tmp_path / 'models'))}",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [(p["loss"], p["max_staleness"]) for p in data["points"]] == [
        ("ppo", 0),
        ("stale_clip", 0),
        ("ppo", 2),
        ("stale_clip", 2),
    ]
    for point in data["points"]:
        assert point["steps"] == 12 and len(point["curve"]) == 12
        assert 0.0 <= point["final_reward"] <= 1.0
        assert point["staleness_mean"] <= point["max_staleness"]
    assert data["best_correcting_loss"] == "stale_clip"  # the only loss that is not ppo
    per_loss = data["per_loss"]["stale_clip"]
    gap = (
        per_loss["final_reward_by_eta"]["2"]["median"]
        - per_loss["final_reward_by_eta"]["0"]["median"]
    )
    assert data["final_reward_eta2_minus_eta0"] == pytest.approx(gap)
    assert data["command"].startswith("python bench/stability.py --etas 0,2")
    assert (tmp_path / "stability_reward.png").stat().st_size > 1000
