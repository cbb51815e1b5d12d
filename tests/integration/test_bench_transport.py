"""bench/transport.py on a tiny budget, with real hub processes: the learner's request depth
follows the batch's bytes, and a run of the volatile and durable hubs alone reports the
durable / volatile ratio beside the depth it ran at, and how the durable hub's log reached the
disk (at 256 KB nearly all of it written from the received frames themselves, where the
filesystem takes O_DIRECT)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.transport import learner_in_flight

REPO = Path(__file__).resolve().parents[2]


def test_the_learner_keeps_64_mb_of_batches_requested_and_at_least_four() -> None:
    assert learner_in_flight(32 << 10, 64) == 32
    assert learner_in_flight(256 << 10, 16) == 16
    assert learner_in_flight(2 << 20, 4) == 8
    assert learner_in_flight(64 << 20, 4) == 4  # bigger batches: still 4 out
    assert learner_in_flight(32 << 10, 64, fixed=3) == 3  # --learner-in-flight


def takes_o_direct(directory: Path) -> bool:
    try:
        fd = os.open(directory / "probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    return True


def test_a_volatile_and_durable_run_reports_their_ratio(tmp_path: Path) -> None:
    out = tmp_path / "transport.json"
    cmd = [
        sys.executable,
        str(REPO / "bench" / "transport.py"),
        "--reps",
        "1",
        "--sizes",
        "262144",
        "--variants",
        "hub,hub_durable",
        "--bytes-per-rep",
        str(4 << 20),
        "--min-groups",
        "32",
        "--learner-in-flight",
        "2",
        "--out",
        str(out),
    ]
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the hubs' state directories
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = json.loads(out.read_text())["results"]
    assert result["partial"] and result["learner_in_flight"] == 2
    assert result["hub_groups_per_s"] > 0 and result["hub_durable_groups_per_s"] > 0
    assert result["durable_over_volatile"] > 0
    assert result["durable_over_volatile_stats"]["n"] == 1
    log = result["hub_durable_log"]
    assert log["mode"] == "durable" and log["commits"] > 0
    written = log["log_bytes_placed"] + log["log_bytes_copied"]
    assert written >= 2 * 32 * 262_000  # the warm-up and the measured repetition's groups
    if takes_o_direct(tmp_path):
        assert log["placed_share"] > 0.9, log
    else:  # through the page cache: nothing placed
        assert log["log_bytes_placed"] == 0, log
