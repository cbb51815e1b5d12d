"""End to end: `asyncrl run` on a tiny budget, as a subprocess, for η = 4 and η = 0.

Asserts what a user relies on: exit code 0, versions advanced one per step, every consumed
group within the staleness bound, every actor holding the learner's final weights (same
policy_version, same weights digest), and the run directory's artefacts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *overrides: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "asyncrl",
        "run",
        str(REPO / "configs" / "tiny_cpu.toml"),
        "--run-dir",
        str(run_dir),
        "--set",
        f"model.cache_dir={json.dumps(str(tmp_path / 'models'))}",
        *[arg for o in overrides for arg in ("--set", o)],
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=480)
    return run_dir, proc


def _check_run(run_dir: Path, proc: subprocess.CompletedProcess[str], steps: int, eta: int) -> None:
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert 0 <= r["staleness_max"] <= eta, r
        assert sum(r["staleness_hist"][eta + 1 :]) == 0, r
    learner = json.loads((run_dir / "learner_summary.json").read_text())
    assert learner["policy_version"] == steps
    actors = sorted(run_dir.glob("actor-*.json"))
    assert actors, "no actor status files"
    for path in actors:
        status = json.loads(path.read_text())
        assert status["policy_version"] == steps, status
        assert status["weights_digest"] == learner["weights_digest"], status
    for name in ("config.toml", "reward.png", "summary.json", "learner_config.toml"):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / "tb").iterdir()), "no TensorBoard events"
    assert (run_dir / "checkpoints" / "latest").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["staleness_max"] <= eta
    assert "step" in proc.stdout and "done:" in proc.stdout


@pytest.mark.parametrize(("eta", "steps"), [(4, 6), (1, 12)])
def test_run_async(tmp_path: Path, eta: int, steps: int) -> None:
    run_dir, proc = _run(tmp_path, f"learner.max_steps={steps}", f"replay.max_staleness={eta}")
    _check_run(run_dir, proc, steps=steps, eta=eta)
    # One actor pushes in grant order and the hub grants it credits only within the window at
    # the weights it holds: each of its groups is consumed by version w + η, so none goes stale.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["dropped_stale"] for r in rows) == 0


@pytest.mark.slow
def test_run_with_in_flight_weight_updates(tmp_path: Path) -> None:
    steps = 40
    run_dir, proc = _run(
        tmp_path,
        f"learner.max_steps={steps}",
        "replay.max_staleness=1",
        "actor.weight_update=in_flight",
        "actor.max_new_tokens=16",
    )
    _check_run(run_dir, proc, steps=steps, eta=1)
    status = json.loads((run_dir / "actor-0.json").read_text())["stats"]
    assert status["inflight_updates"] > 0, status  # weights arrived mid-generation
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(r["mixed_version_frac"] > 0 for r in rows)
    for r in rows:  # every trained token within the bound, counted token by token
        assert sum(r["staleness_hist_tokens"][2:]) == 0, r
        assert sum(r["staleness_hist_trajectories"][2:]) == 0, r


@pytest.mark.slow
def test_run_synchronous_eta0_two_actors(tmp_path: Path) -> None:
    run_dir, proc = _run(
        tmp_path, "learner.max_steps=4", "replay.max_staleness=0", "run.num_actors=2"
    )
    _check_run(run_dir, proc, steps=4, eta=0)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["staleness_max"] == 0 for r in rows)
    assert len(list(run_dir.glob("actor-*.json"))) == 2


@pytest.mark.slow
def test_resume_continues_the_version_count(tmp_path: Path) -> None:
    run_dir, proc = _run(tmp_path, "learner.max_steps=3")
    _check_run(run_dir, proc, steps=3, eta=4)
    cmd = [
        sys.executable,
        "-m",
        "asyncrl",
        "run",
        str(REPO / "configs" / "tiny_cpu.toml"),
        "--resume",
        "--run-dir",
        str(run_dir),
        "--set",
        f"model.cache_dir={json.dumps(str(tmp_path / 'models'))}",
        "--set",
        "learner.max_steps=5",
    ]
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=480)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4, 5]
    learner = json.loads((run_dir / "learner_summary.json").read_text())
    assert learner["policy_version"] == 5
    for path in run_dir.glob("actor-*.json"):
        status = json.loads(path.read_text())
        assert (
            status["policy_version"] == 5 and status["weights_digest"] == learner["weights_digest"]
        )
