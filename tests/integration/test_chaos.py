"""The short variants of bench/chaos.py and bench/soak.py, run as they are run by hand: seeded
SIGKILLs of hub, actor and learner under `asyncrl run` lose and repeat nothing; actors flooding
a slow learner keep the hub's memory bounded and every group accounted for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def bench(script: str, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.mark.slow
def test_chaos_short(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    proc = bench(
        "chaos.py",
        "--duration-s",
        "100",
        "--interval-s",
        "8",
        "--min-steps",
        "2",
        "--quiet-s",
        "10",
        "--seed",
        "3",
        "--run-dir",
        str(tmp_path),
        "--model-cache",
        str(tmp_path / "models"),
        "--out",
        str(out),
        timeout_s=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["lost"] == 0 and result["duplicated"] == 0
    assert result["kills_total"] >= 2 and result["consumed"] > 0
    assert result["acked"] == result["produced"]
    assert sum(result["restarts"].values()) >= result["kills_total"] - 1  # the last may be pending
    assert "Traceback" not in result["run_ended"]


@pytest.mark.slow
def test_soak_short(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = bench(
        "soak.py",
        "--duration-s",
        "20",
        "--actors",
        "2",
        "--capacity",
        "64",
        "--durability",
        "durable",
        "--out",
        str(out),
        timeout_s=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["unaccounted"] == 0 and result["unacked_at_end"] == 0 and result["bounded"]
    assert result["consumed"] == result["consumed_distinct"] > 0
    assert (
        result["hub_held_at_end"] <= 64 + 8
    )  # credits stop the actors at capacity (+ a lent batch)
    assert result["pushed"] > result["consumed"]  # the actors were ahead of the learner
