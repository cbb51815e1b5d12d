"""launch.run's metrics tail: new records only, torn lines left for later or skipped."""

from __future__ import annotations

from pathlib import Path

from launch.run import progress_line
from learner.metrics_log import MetricsTail, read_metrics


def _row(step: int) -> str:
    return (
        f'{{"step": {step}, "policy_version": {step}, "time_s": {step * 0.1}, "reward_mean": 0.5, '
        f'"staleness_max": 1, "staleness_mean": 0.5, "samples": 64, "samples_per_s": 640.0, '
        f'"wait_data_s": 0.0}}\n'
    )


def test_tail_reads_each_line_once_and_waits_for_the_newline(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path, keep=3)
    assert tail.poll() == []  # no file yet
    path.write_text(_row(1) + _row(2) + _row(3)[:20])  # the third line is being written
    assert [r["step"] for r in tail.poll()] == [1, 2]
    offset = tail.offset
    assert tail.poll() and tail.offset == offset  # nothing new: nothing re-read
    with path.open("a") as f:
        f.write(_row(3)[20:] + _row(4) + _row(5))
    assert [r["step"] for r in tail.poll()] == [3, 4, 5]  # the last `keep`
    assert tail.offset == path.stat().st_size
    assert "step    5" in progress_line(tail.poll(), 1.0)


def test_a_torn_line_continued_after_a_crash_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(_row(1) + _row(2)[:15] + _row(3) + "\n")  # crash mid-line, resumed run
    assert [r["step"] for r in read_metrics(path)] == [1]
    with path.open("a") as f:
        f.write(_row(4))
    assert [r["step"] for r in read_metrics(path)] == [1, 4]
