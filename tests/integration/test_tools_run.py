"""`asyncrl run configs/tiny_tools_cpu.toml`: the tiny model learns a task that needs a tool.

The lookup task's value is random per row, so only a tool call reveals it; a model that learns
to call the tool with the prompt's key and copy the answer earns the reward. A shortened run
(1,500 steps, about a minute on 2 idle cores) must raise the mean reward by at least 0.4 from
its first tenth of steps to its last, with multi-turn trajectories (tool calls counted by the
actor, episodes ending by `stop`) and every consumed group within the staleness bound.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 1500


@pytest.mark.slow
def test_tiny_tools_cpu_learns_to_call_the_tool(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "asyncrl",
        "run",
        str(REPO / "configs" / "tiny_tools_cpu.toml"),
        "--run-dir",
        str(run_dir),
        "--set",
        f"model.cache_dir={json.dumps(str(tmp_path / 'm'))}",
        "--set",
        f"learner.max_steps={STEPS}",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) >= STEPS // 2, "the run stopped early (run.max_wall_s)"
    tenth = max(len(rows) // 10, 1)
    first = sum(r["reward_mean"] for r in rows[:tenth]) / tenth
    last = sum(r["reward_mean"] for r in rows[-tenth:]) / tenth
    assert last - first >= 0.4, (first, last)
    assert all(r["staleness_max"] <= 4 for r in rows)
    assert max(r["response_len_mean"] for r in rows) > 3  # model + tool tokens: several turns
    status = json.loads((run_dir / "actor-0.json").read_text())
    stats = status.get("stats", status)
    assert stats["tool_calls"] > 0, stats
    assert stats["turns"] > stats["episodes"]
