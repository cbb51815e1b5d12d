"""bench/cpu_sampler.py: CPU seconds read from /proc for the processes of pids.json, and the
per-step figures over the steady window computed from hand-made samples."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.cpu_sampler import CpuSampler


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_reads_this_process_and_skips_a_missing_one(tmp_path: Path) -> None:
    (tmp_path / "pids.json").write_text(json.dumps({"me": os.getpid(), "gone": 2**22 + 7}))
    sum(i * i for i in range(300_000))  # some CPU of our own
    cpu = CpuSampler(tmp_path).read()
    assert set(cpu) == {"me"} and cpu["me"] > 0


def test_summary_over_the_steady_window(tmp_path: Path) -> None:
    """Steps at t = 100..120 (64 samples each); samples from t = 106: the window is 106 to
    116 (10 s), holding the steps at 107..116 (10 steps). learner 2 -> 6 CPU s, actor 1 -> 2."""
    sampler = CpuSampler(tmp_path)
    sampler.samples = [
        (100.0 + t, {"learner": 2.0 + 0.4 * (t - 6), "actor": 1.0 + 0.1 * (t - 6)})
        for t in range(1, 17)
    ]
    sampler.samples += [(117.0, {"actor": 2.2}), (118.0, {})]  # the learner ended: not used
    rows = [{"time": 100.0 + k, "samples": 64} for k in range(21)]
    out = sampler.summary(rows, skip_s=6.0)
    assert out is not None
    assert out["window_s"] == 10.0
    assert out["cpu_ms_per_step"] == pytest.approx({"learner": 400.0, "actor": 100.0})
    assert out["cpu_share"] == pytest.approx({"learner": 0.4, "actor": 0.1})
    assert out["samples_per_cpu_s"] == pytest.approx(10 * 64 / 5.0)
    assert sampler.summary(rows[:3], skip_s=6.0) is None  # too few steps inside
