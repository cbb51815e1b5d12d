"""bench/sim's calibration: least squares that recover known coefficients, a fit that
reproduces measurements made by a known ground truth (the message latency included), points
files refused by field, and the calibrate / predict command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sim_cases import synthetic_measurements

from bench.sim.calibrate import calibrate, nnls
from bench.sim.points import load_points

REPO = Path(__file__).resolve().parents[2]


def test_nnls_recovers_exact_coefficients() -> None:
    a = np.array([[1.0, 2.0, 30.0], [1.0, 5.0, 10.0], [1.0, 9.0, 70.0], [1.0, 1.0, 5.0]])
    x = np.array([0.5, 0.0, 0.02])
    assert nnls(a, a @ x) == pytest.approx(x, abs=1e-12)


def test_calibration_reproduces_synthetic_points(tmp_path: Path) -> None:
    measured = tmp_path / "staleness.json"
    synthetic_measurements(measured)
    cal = calibrate(load_points(measured)).to_dict()
    assert cal["sync_s"] == pytest.approx(0.01)
    assert cal["message_latency_s"] == 0.0  # no time quantiles: not fitted
    assert cal["latency_fit"]["status"].startswith("no η = 0 point with time quantiles")
    for point in cal["points"]:
        assert abs(point["rel_err_samples_per_s"]) < 0.05
        assert abs(point["abs_err_learner_wait_fraction"]) < 0.05
        assert abs(point["abs_err_actor_wait_fraction"]) < 0.05


def test_calibration_recovers_the_message_latency(tmp_path: Path) -> None:
    # made with 4 ms per message and constant times; fitted from the η = 0 point alone, then the
    # η >= 1 points (out of sample for the latency) are reproduced with it
    measured = tmp_path / "staleness.json"
    synthetic_measurements(measured, message_latency_s=0.004, sigma=0.0)
    cal = calibrate(load_points(measured)).to_dict()
    assert cal["latency_fit"]["hops_per_step"] == [pytest.approx(4.0)]
    assert cal["message_latency_s"] == pytest.approx(0.004, rel=0.05)
    for point in cal["points"]:
        assert abs(point["own_times"]["rel_err_samples_per_s"]) < 0.05, point


def test_load_points_names_the_bad_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"points": [{"max_staleness": 0, "samples_per_s": "fast"}]}))
    with pytest.raises(ValueError, match=r"points\[0\]\.response_lengths"):
        load_points(bad)
    with pytest.raises(ValueError, match="not found"):
        load_points(tmp_path / "missing.json")
    synthetic_measurements(tmp_path / "good.json")
    good = json.loads((tmp_path / "good.json").read_text())
    good["points"][1]["step_time_quantiles"] = [0.03, 0.02]
    bad.write_text(json.dumps(good))
    with pytest.raises(ValueError, match=r"points\[1\]\.step_time_quantiles: .*ascending"):
        load_points(bad)


def test_cli_calibrate_and_predict(tmp_path: Path) -> None:
    measured, out, png = tmp_path / "m.json", tmp_path / "sim.json", tmp_path / "sim.png"
    synthetic_measurements(measured)
    script = str(REPO / "bench" / "simulate.py")
    predict = [
        sys.executable,
        script,
        "predict",
        "--world",
        "8",
        "--actors",
        "6",
        "--groups-per-step",
        "4",
        "--concurrency",
        "2",
        "--group-size",
        "4",
        "--eta",
        "0",
        "2",
        "--measure",
        "3",
        "--warmup",
        "2",
        "--repeats",
        "2",
        "--jobs",
        "1",
        "--measured",
        str(measured),
        "--out",
        str(out),
        "--png",
        str(png),
    ]
    subprocess.run(predict, check=True, capture_output=True, cwd=tmp_path)
    data = json.loads(out.read_text())
    assert [p["max_staleness"] for p in data["predictions"]] == [0, 2]
    assert [p["weight_update"] for p in data["predictions_in_flight"]] == ["in_flight"] * 2
    assert data["derived"]["inflight_pause_s"]["per_seq"] > 0
    assert data["assumptions"]["world"] == 8 and data["command"].startswith("python bench/")
    assert data["calibration"]["status"] == "ok" and png.stat().st_size > 0
    calibrate_cmd = [
        sys.executable,
        script,
        "calibrate",
        "--measured",
        str(measured),
        "--out",
        str(out),
    ]
    subprocess.run(calibrate_cmd, check=True, capture_output=True, cwd=tmp_path)
    again = json.loads(out.read_text())
    assert again["predictions"] == data["predictions"]
    assert len(again["calibration"]["points"]) == 4
