"""bench/zmq_framing.py on a tiny budget: every layout moves the same bytes and the JSON is whole."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.zmq_framing import LAYOUTS, message

REPO = Path(__file__).resolve().parents[2]


def test_every_layout_carries_the_same_bytes() -> None:
    four, one = message("frames_4", 32768)
    assert one == 1 and len(four) == 4
    for layout in LAYOUTS:
        frames, groups = message(layout, 32768)
        assert sum(map(len, frames)) == groups * sum(map(len, four)), layout
    assert [len(message(k, 32768)[0]) for k in LAYOUTS] == [4, 2, 1, 32]


def test_the_benchmark_writes_wellformed_results(tmp_path: Path) -> None:
    out = tmp_path / "zmq_framing.json"
    cmd = [
        sys.executable,
        str(REPO / "bench" / "zmq_framing.py"),
        "--reps",
        "1",
        "--sizes",
        "32768",
        "--bytes-per-rep",
        str(4 << 20),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["command"].startswith("python") and data["config"]["reps"] == 1
    (result,) = data["results"]
    assert set(result["layouts"]) == set(LAYOUTS)
    for layout, figures in result["layouts"].items():
        for key in ("sender_cpu_us_per_group", "receiver_cpu_us_per_group", "groups_per_s"):
            assert figures[key]["median"] > 0, (layout, key)
    assert result["sender_cpu_over_frames_4"]["frames_4"] == 1.0
