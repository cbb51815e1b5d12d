"""Ctrl-C on `asyncrl run`: every child stops, nothing is orphaned, the run directory is usable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes; /proc tells
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def _start_run(tmp_path: Path) -> tuple[subprocess.Popen[str], Path, dict[str, int]]:
    """`asyncrl run` on the embedded default, in its own session (as a terminal gives a foreground
    job its own process group), returned once the learner has made 3 steps."""
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
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        start_new_session=True,
        # as from a terminal: SIGHUP not ignored, even when pytest itself runs under nohup
        # (`asyncrl run` keeps an inherited SIG_IGN on purpose, and would then run to its end)
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    try:
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 3):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "no learner steps within 240 s"
            time.sleep(0.5)
        pids = json.loads((run_dir / "pids.json").read_text())
    except BaseException:
        proc.kill()
        raise
    assert set(pids) == {"hub", "actor-0", "learner"}
    return proc, run_dir, pids


def _logs(run_dir: Path) -> str:
    """The children's logs (tails), for a failure message."""
    return "\n".join(
        f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}"
        for log in sorted(run_dir.glob("*.log"))
    )


@pytest.mark.parametrize("how", ["ctrl_c", "sigterm", "sighup"])
def test_ctrl_c_stops_every_process_in_order(tmp_path: Path, how: str) -> None:
    """Ctrl-C (SIGINT to the whole foreground group), a scheduler's stop (SIGTERM to
    `asyncrl run` alone) and a closed terminal (SIGHUP) all stop every child by pid, in order: the learner checkpoints and
    hands its final weights to the still-running actor before the actor and the hub stop, and
    no child has to be killed. (The children run in their own process groups, so the terminal's
    SIGINT reaches `asyncrl run` alone.)"""
    proc, run_dir, pids = _start_run(tmp_path)
    try:
        if how == "ctrl_c":
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        else:  # the run process only: it must stop the rest
            proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGHUP)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted" in out
    for name, pid in pids.items():
        assert not _alive(pid), f"{name} (pid {pid}) survived Ctrl-C"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["steps"] >= 3
    assert summary["exit_codes"] == {"hub": 0, "actor-0": 0, "learner": 0}, _logs(run_dir)
    assert (run_dir / "reward.png").is_file()
    # the learner checkpointed on its way out ...
    assert (run_dir / "checkpoints" / "latest").is_file(), _logs(run_dir)
    # ... and the actor, still running then, loaded its final weights
    learner = json.loads((run_dir / "learner_summary.json").read_text())
    actor = json.loads((run_dir / "actor-0.json").read_text())
    assert learner["actors_loaded"] == {"actor-0": learner["policy_version"]}, _logs(run_dir)
    assert actor["weights_digest"] == learner["weights_digest"], _logs(run_dir)


def test_no_child_outlives_a_killed_run(tmp_path: Path) -> None:
    """`asyncrl run` SIGKILLed (no chance to stop anyone): every child is told by the kernel
    (SIGTERM on its parent's death) and exits by itself; nothing is orphaned."""
    proc, run_dir, pids = _start_run(tmp_path)
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 200  # the learner's graceful exit waits on weight broadcasts
    while any(_alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    alive = {name: pid for name, pid in pids.items() if _alive(pid)}
    for pid in alive.values():
        os.kill(pid, signal.SIGKILL)  # by pid, so that a failure leaves nothing behind
    assert not alive, f"outlived asyncrl run: {alive}\n{_logs(run_dir)}"
