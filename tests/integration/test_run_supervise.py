"""`asyncrl run` survives SIGKILL of each of its processes: the durable hub comes back on its
state directory and endpoint, the actor comes back as a new session, the learner resumes from
its checkpoint; the run still reaches max_steps and ends with one line, never a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from learner.metrics_log import read_metrics

REPO = Path(__file__).resolve().parents[2]
STEPS = 24


def steps_done(run_dir: Path) -> int:
    """The learner's last logged step: read while it writes (a line in progress is left for
    later) and across its SIGKILL (a torn line is skipped), as `asyncrl run` reads it."""
    return max((r["step"] for r in read_metrics(run_dir / "metrics.jsonl")), default=0)


@pytest.mark.slow
def test_run_restarts_a_killed_hub_actor_and_learner(tmp_path: Path) -> None:
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
        "--set",
        f"learner.max_steps={STEPS}",
        "--set",
        "learner.checkpoint_every=3",
        "--set",
        'replay.durability="durable"',
        "--set",
        "run.restart_backoff_s=0.2",
        "--set",
        "run.max_wall_s=0",
        "--set",
        "replay.heartbeat_timeout_s=5.0",
        "--set",
        "weights.timeout_s=10.0",  # a publication to the killed actor fails within 10 s
    ]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    killed: list[str] = []
    try:
        deadline = time.monotonic() + 420
        for name, at_step in (("hub", 3), ("actor-0", 8), ("learner", 14)):
            while steps_done(run_dir) < at_step:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline, f"no step {at_step} within the deadline"
                time.sleep(0.2)
            pid = json.loads((run_dir / "pids.json").read_text())[name]
            os.kill(pid, signal.SIGKILL)
            killed.append(name)
        out, _ = proc.communicate(timeout=max(10.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.terminate()  # by pid: asyncrl run stops its children (by pid) on SIGTERM
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out and "run ended: the learner finished" in out
    actor = json.loads((run_dir / "actor-0.json").read_text())
    assert actor["policy_version"] == STEPS  # the restarted actor was sent the learner's weights
    for name in killed:
        assert f"run: {name} exited with code -9; restart 1 of" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] == {"hub": 1, "actor-0": 1, "learner": 1}
    assert steps_done(run_dir) == STEPS
    learner = json.loads((run_dir / "learner_summary.json").read_text())
    assert learner["policy_version"] == STEPS
    hub_log = (run_dir / "hub.log").read_text()
    assert "recovered from" in hub_log  # the second hub took the first one's state


@pytest.mark.slow
def test_a_process_that_keeps_crashing_ends_the_run_with_one_line(tmp_path: Path) -> None:
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
        "--set",
        "run.max_restarts=1",
        "--set",
        "run.restart_backoff_s=0.05",
    ]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        pids: list[int] = []
        deadline = time.monotonic() + 240
        while len(pids) < 2:  # the hub, then the hub restarted once
            assert proc.poll() is None and time.monotonic() < deadline
            path = run_dir / "pids.json"
            pid = json.loads(path.read_text()).get("hub") if path.is_file() else None
            if pid and pid not in pids and (run_dir / "hub.endpoint").is_file():
                pids.append(pid)
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out[-3000:] + err[-3000:]
    assert "Traceback" not in out + err
    (line,) = [x for x in err.splitlines() if x.startswith("run ended:")]
    assert "hub exited with code -9 after 1 restarts (run.max_restarts=1)" in line


def test_a_setting_that_cannot_work_ends_the_run_with_one_line(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "asyncrl",
        "run",
        str(REPO / "configs" / "tiny_cpu.toml"),
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        'model.path="/nonexistent/model"',
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "run ended: model.path: directory not found: '/nonexistent/model'"
    ]
