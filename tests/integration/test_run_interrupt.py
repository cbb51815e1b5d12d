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


@pytest.mark.parametrize("how", ["ctrl_c", "sigterm"])
def test_ctrl_c_stops_every_process(tmp_path: Path, how: str) -> None:
    """Ctrl-C (SIGINT to the whole foreground group) and a scheduler's stop (SIGTERM to
    `asyncrl run` alone) both stop every process by pid and leave a checkpoint."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "asyncrl", "run", str(REPO / "configs" / "tiny_cpu.toml"),
        "--run-dir", str(run_dir), "--set", f"model.cache_dir={json.dumps(str(tmp_path / 'models'))}",
    ]  # fmt: skip
    # A new session = its own process group, as a terminal gives a foreground job.
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 3):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "no learner steps within 240 s"
            time.sleep(0.5)
        pids = json.loads((run_dir / "pids.json").read_text())
        assert set(pids) == {"hub", "actor-0", "learner"}
        if how == "ctrl_c":
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        else:
            proc.send_signal(signal.SIGTERM)  # the run process only: it must stop the rest
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
    assert (run_dir / "reward.png").is_file()
    assert (run_dir / "checkpoints" / "latest").is_file()  # the learner checkpointed on its way out
