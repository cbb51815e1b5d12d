"""bench/learner_step.py on a tiny budget: both scoring layouts run and the JSON is well formed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_learner_step_bench_writes_both_ways(tmp_path: Path) -> None:
    out = tmp_path / "learner_step.json"
    cmd = [
        sys.executable,
        str(REPO / "bench" / "learner_step.py"),
        "--prompt-lens",
        "6,20",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--out",
        str(out),
        "--set",
        f"model.cache_dir={json.dumps(str(tmp_path / 'models'))}",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["command"].startswith("python bench/learner_step.py")
    assert [p["prompt_len"] for p in data["points"]] == [6, 20]
    for point in data["points"]:
        assert point["plain_step_ms"]["median"] > 0 and point["shared_step_ms"]["median"] > 0
        assert point["speedup"] > 0


def test_learner_step_bench_refuses_prompts_past_the_model(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(REPO / "bench" / "learner_step.py"),
        "--prompt-lens",
        "200",
        "--out",
        str(tmp_path / "x.json"),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--prompt-lens" in proc.stderr
    assert not (tmp_path / "x.json").exists()
