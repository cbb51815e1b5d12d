"""The learner's per-step metric log: `metrics.jsonl` for tools and plots, TensorBoard for people.

`MetricsLog(run_dir).log(step, metrics)` appends one JSON object per line to
`<run_dir>/metrics.jsonl`:

    {"step": 12, "time": 1733170000.12, "reward": 0.41, "staleness": [0, 1, 1, 2], ...}

and writes each value to TensorBoard event files under `<run_dir>/tb/`: numbers as scalars,
lists as histograms (e.g. the staleness of every group in the step's batch). The JSON line is
flushed on every call, so a crash loses nothing already logged and `tail -f` sees each step as
it happens; TensorBoard gets one event per step (all of the step's values in one summary),
written by a background thread and flushed within about a second, and `close()` drains them.
Opening the log again on the same run directory appends (a resumed run continues the same file;
TensorBoard orders by step).

Values: ints and floats (bools count as ints), or lists/tuples of numbers. A non-finite number
is written as `null` in the JSON (strict JSON has no NaN) and as NaN to TensorBoard; non-finite
entries of a list are left out of its histogram. `step` and `time` are reserved keys. Keys may
contain `/` to group TensorBoard panels (`loss/clipped_frac`). Only one process (rank 0) should
log to a run directory.
"""

from __future__ import annotations

import json
import math
import numbers
import queue
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from torch.utils.tensorboard.summary import histogram

from launch import run as asyncrl_run

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
_RESERVED = ("step", "time")

Value = float | int | list[float] | list[int]


class MetricsLog:
    """Append-only metric log of one run directory (JSON lines + TensorBoard)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        """The JSON-lines file, one object per logged step."""
        self._file = open(self.path, "a", encoding="utf-8")  # closed in close()
        self._writer = EventFileWriter(str(self.run_dir / TB_DIR))
        self._tb_queue: queue.Queue[tuple[dict[str, Value], int, float] | None] = queue.Queue()
        self._tb_thread = threading.Thread(
            target=self._tb_loop, name="asyncrl-tensorboard", daemon=True
        )
        self._tb_thread.start()

    def log(self, step: int, metrics: dict[str, Value]) -> None:
        """Record `metrics` for optimizer step `step`; both sinks are flushed before returning."""
        if self._file.closed:
            raise ValueError("MetricsLog: log() after close()")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step: must be an integer >= 0, got {step!r}")
        clean = {key: _clean(key, value) for key, value in metrics.items()}
        record: dict[str, Any] = {"step": int(step), "time": time.time()}
        record.update({k: _json_value(v) for k, v in clean.items()})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        self._tb_queue.put((clean, int(step), record["time"]))

    def close(self) -> None:
        """Flush and close both sinks (idempotent)."""
        if not self._file.closed:
            self._file.close()
            self._tb_queue.put(None)
            self._tb_thread.join()
            self._writer.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _tb_loop(self) -> None:
        """The only user of the SummaryWriter: write queued steps, flush when idle or each 1 s."""
        last_flush = time.monotonic()
        while True:
            try:
                item = self._tb_queue.get(timeout=1.0)
            except queue.Empty:
                item = ()  # nothing new: just flush below
            if item is None:
                self._writer.flush()
                return
            if item:
                clean, step, wall = item
                summary = _summary(clean)
                self._writer.add_event(Event(wall_time=wall, step=step, summary=summary))
            if self._tb_queue.empty() or time.monotonic() - last_flush > 1.0:
                self._writer.flush()
                last_flush = time.monotonic()


def _summary(clean: dict[str, float | int | list[float]]) -> Summary:
    """All of one step's values in one summary: numbers as scalars, lists as histograms."""
    summary = Summary()
    for key, value in clean.items():
        if isinstance(value, list):
            finite = np.asarray([v for v in value if math.isfinite(v)], dtype=np.float64)
            if finite.size:
                summary.value.extend(histogram(key, finite, bins="auto").value)
        else:
            summary.value.add(tag=key, simple_value=float(value))
    return summary


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of `<run_dir>/metrics.jsonl`, in order (a torn line is skipped)."""
    return asyncrl_run.read_metrics(Path(run_dir) / METRICS_FILE)


def _clean(key: str, value: object) -> float | int | list[float]:
    """Plain Python number or list of floats, or ValueError naming the key."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"metrics: keys must be non-empty strings, got {key!r}")
    if key in _RESERVED:
        raise ValueError(f"metrics.{key}: reserved key")
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, list | tuple | np.ndarray):
        items = list(np.asarray(value).ravel()) if isinstance(value, np.ndarray) else list(value)
        if not all(isinstance(v, numbers.Real) for v in items):
            raise ValueError(f"metrics.{key}: a list must hold only numbers")
        return [float(v) for v in items]
    raise ValueError(
        f"metrics.{key}: must be a number or a list of numbers, got {type(value).__name__}"
    )


def _json_value(value: float | int | list[float]) -> Any:
    if isinstance(value, list):
        return [v if math.isfinite(v) else None for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
