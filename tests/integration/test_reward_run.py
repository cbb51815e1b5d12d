"""End to end: `asyncrl run configs/tiny_reward_cpu.toml` for a few steps, with the served
reward model started (and ended, by pid) by `asyncrl run`; its metrics show every component."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMPONENTS = ("task", "reward_model", "overlong", "format", "repetition")


@pytest.mark.slow
def test_composed_reward_run_with_the_served_reward_model(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "asyncrl",
        "run",
        str(REPO / "configs" / "tiny_reward_cpu.toml"),
        "--run-dir",
        str(run_dir),
        "--set",
        "learner.max_steps=3",
        "--set",
        f"model.cache_dir={json.dumps(str(tmp_path / 'models'))}",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        for name in COMPONENTS:
            assert f"reward/{name}" in row, (name, row)
        assert row["reward/failed"] == 0.0  # the served model answered every request
    # the reward model really scored: its values vary with the completions
    assert len({r["reward/reward_model"] for r in rows}) > 1
    server = json.loads((run_dir / "reward_server.json").read_text())  # written at its exit
    assert server["samples_scored"] == actor_items(run_dir) and not server["errors"]
    pids = json.loads((run_dir / "pids.json").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pids["reward-server"], 0)  # ended with the run
    seen = [json.loads(line) for line in (run_dir / "reward_provenance.jsonl").open()]
    checkpoints = {
        p["provenance"]["components"]["reward_model"].get("reward_model_hash") for p in seen
    }
    assert checkpoints == {server["model_hash"]}  # every trajectory names the checkpoint
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_codes"]["reward-server"] == 0
    actor = json.loads((run_dir / "actor-0.json").read_text())["stats"]
    assert actor["reward/items"] > 0 and actor["reward_failures"] == 0
    assert actor.get("reward/canary_alarms", 0) == 0  # no known-wrong canary above the margin


def actor_items(run_dir: Path) -> int:
    """Items the actors scored (episodes and canaries): each went through the server once."""
    stats = [json.loads(p.read_text())["stats"] for p in run_dir.glob("actor-*.json")]
    return sum(int(s["reward/items"]) for s in stats)
