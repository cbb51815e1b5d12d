"""The metric log read back from both sinks: JSON lines and TensorBoard event files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from learner.metrics_log import METRICS_FILE, MetricsLog, read_metrics


def _events(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_both_sinks_read_back(tmp_path: Path) -> None:
    with MetricsLog(tmp_path) as log:
        for step in range(3):
            log.log(
                step, {"reward": 0.5 * step, "num_tokens": 10 + step, "staleness": [0, 1, 1, step]}
            )
        # flushed each step: readable while the log is still open
        assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [0, 1, 2]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in records] == [0.0, 0.5, 1.0]
    assert records[2]["staleness"] == [0.0, 1.0, 1.0, 2.0]
    assert records[1]["num_tokens"] == 11
    assert all(isinstance(r["time"], float) for r in records)

    acc = _events(tmp_path)
    assert set(acc.Tags()["scalars"]) == {"reward", "num_tokens"}
    reward = acc.Scalars("reward")
    assert [(e.step, e.value) for e in reward] == [(0, 0.0), (1, 0.5), (2, 1.0)]
    hist = acc.Histograms("staleness")
    assert [h.step for h in hist] == [0, 1, 2]
    last = hist[-1].histogram_value
    assert (last.num, last.sum, last.min, last.max) == (4, 4.0, 0.0, 2.0)


def test_non_finite_values_and_numpy_inputs(tmp_path: Path) -> None:
    with MetricsLog(tmp_path) as log:
        log.log(
            np.int64(4),
            {"loss": float("nan"), "lr": np.float32(0.25), "w": np.array([1.0, np.inf, 3.0])},
        )
    (record,) = read_metrics(tmp_path / METRICS_FILE)
    assert record["loss"] is None and record["lr"] == 0.25 and record["w"] == [1.0, None, 3.0]
    acc = _events(tmp_path)
    assert np.isnan(acc.Scalars("loss")[0].value)
    assert acc.Histograms("w")[0].histogram_value.num == 2


def test_reopening_appends(tmp_path: Path) -> None:
    with MetricsLog(tmp_path) as log:
        log.log(0, {"reward": 0.1})
    with MetricsLog(tmp_path) as log:
        log.log(1, {"reward": 0.2})
    assert [r["reward"] for r in read_metrics(tmp_path / METRICS_FILE)] == [0.1, 0.2]
    assert [e.step for e in _events(tmp_path).Scalars("reward")] == [0, 1]


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    with MetricsLog(tmp_path) as log:
        log.log(0, {"reward": 1.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 1, "rew')
    assert read_metrics(tmp_path / METRICS_FILE) == [read_metrics(tmp_path / METRICS_FILE)[0]]
    assert read_metrics(tmp_path / "nowhere" / METRICS_FILE) == []


@pytest.mark.parametrize(
    ("step", "metrics", "match"),
    [
        (-1, {}, "step: must be an integer"),
        (1.5, {}, "step: must be an integer"),
        (0, {"step": 1}, "metrics.step: reserved"),
        (0, {"name": "x"}, "metrics.name: must be a number"),
        (0, {"hist": [1, "a"]}, "metrics.hist: a list must hold only numbers"),
        (0, {3: 1.0}, "metrics: keys must be"),
    ],
)
def test_bad_input_names_the_key(tmp_path: Path, step: object, metrics: dict, match: str) -> None:
    with MetricsLog(tmp_path) as log, pytest.raises(ValueError, match=match):
        log.log(step, metrics)  # type: ignore[arg-type]
    assert read_metrics(tmp_path / METRICS_FILE) == []


def test_log_after_close_is_refused(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path)
    log.close()
    log.close()
    with pytest.raises(ValueError, match="after close"):
        log.log(0, {"reward": 1.0})


def test_reading_metrics_imports_neither_torch_nor_tensorboard() -> None:
    """The launcher's progress line and the tools read metrics.jsonl without loading them."""
    code = (
        "import sys, learner.metrics_log; "
        "assert not {m.split('.')[0] for m in sys.modules} & {'torch', 'tensorboard'}"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
