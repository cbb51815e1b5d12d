"""What the learner logs each step, and its log: `metrics.jsonl` for tools and plots,
TensorBoard for people, and the readers of the file (`read_metrics`, `MetricsTail`).

```
  learner step ──row──> MetricsLog.log(step, row) ──> <run_dir>/metrics.jsonl  (one JSON line)
     row: loss statistics, staleness, throughput,      └─> <run_dir>/tb/       (TensorBoard)
     episode_metrics, version_metrics (here),                     │
     reward/<...> (learner/alarms.py RewardMonitor)               v
                                      read_metrics / MetricsTail: asyncrl run's progress line,
                                      asyncrl report, the benchmarks
```

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

Besides the loss, the row says how the batch's episodes ended (finish reasons, failed rewards,
turns and tool calls: `episode_metrics`) and how stale it was (per trajectory, per model token,
and the share of trajectories made by more than one policy version: `version_metrics`).

Reading needs neither torch nor tensorboard (they are imported when a `MetricsLog` opens), so
the launcher and the tools read metrics without loading them.
"""

from __future__ import annotations

import collections
import json
import math
import numbers
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncrl.protocol.messages import Group

if TYPE_CHECKING:  # imported when a MetricsLog opens: reading needs no torch or tensorboard
    from tensorboard.compat.proto.summary_pb2 import Summary

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
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

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
        from tensorboard.compat.proto.event_pb2 import Event

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
    from tensorboard.compat.proto.summary_pb2 import Summary
    from torch.utils.tensorboard.summary import histogram

    summary = Summary()
    for key, value in clean.items():
        if isinstance(value, list):
            finite = np.asarray([v for v in value if math.isfinite(v)], dtype=np.float64)
            if finite.size:
                summary.value.extend(histogram(key, finite, bins="auto").value)
        else:
            summary.value.add(tag=key, simple_value=float(value))
    return summary


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


# --- reading metrics.jsonl ----------------------------------------------------------------------


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every complete record of a metrics.jsonl, in order (a torn line is skipped, the line
    being written is left for later); [] when there is no file."""
    return MetricsTail(Path(path), keep=None).poll()


class MetricsTail:
    """The records a growing metrics.jsonl gained since the last poll, parsed once each: the
    progress line of a long run costs its new lines, not the whole file every second."""

    def __init__(self, path: Path, keep: int | None = 10) -> None:
        self.path = path
        self.offset = 0
        self.recent: deque[dict[str, Any]] = deque(maxlen=keep)

    def poll(self) -> list[dict[str, Any]]:
        """The last `keep` records (all of them with keep=None), new ones read first."""
        if self.path.is_file():
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
            complete = data.rfind(b"\n") + 1  # a line without its newline is still being written
            for line in data[:complete].splitlines():
                try:
                    self.recent.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # blank, or torn by a crash and continued by a resumed learner
            self.offset += complete
        return list(self.recent)


# --- what a step's row says about its batch -----------------------------------------------------


def episode_metrics(groups: Sequence[Group]) -> dict[str, float]:
    """Per-sample means of how the batch's episodes went: finish reasons (`finish/<reason>`,
    fractions), failed rewards, and for multi-turn tasks turns, tool calls, failed and malformed
    calls, tool and environment seconds."""
    num = sum(g.size for g in groups)
    reasons = collections.Counter(r for g in groups for r in g.finish_reasons)
    out = {f"finish/{reason}": count / num for reason, count in sorted(reasons.items())}
    out["reward_failed_frac"] = sum(1 for g in groups for f in g.reward_failed if f) / num
    if any(g.num_turns for g in groups):
        out["turns_mean"] = sum(sum(g.num_turns) for g in groups) / num
        out["tool_s_mean"] = sum(sum(g.tool_s) for g in groups) / num
        out["env_s_mean"] = sum(sum(g.env_s) for g in groups) / num
        for key in ("tool_calls", "tool_errors", "malformed_calls"):
            out[f"{key}_per_episode"] = sum(int(g.metadata.get(key, 0)) for g in groups) / num
    return out


def version_metrics(groups: Sequence[Group], version: int, eta: int) -> dict[str, Any]:
    """Staleness (`version` minus the producing version) counted per trajectory (its oldest
    token, what the hub's bound uses) and per model token; and the share of trajectories
    made by more than one version (in-flight updates, multi-turn episodes)."""
    per_traj, per_token, mixed = [], np.zeros(eta + 2, np.int64), 0
    for g in groups:
        for t in g.trajectories():
            per_traj.append(version - t.min_policy_version)
            mixed += t.max_policy_version > t.min_policy_version
            ages = version - t.token_versions()[t.loss_mask.astype(bool)]
            per_token += np.bincount(np.clip(ages, 0, eta + 1), minlength=eta + 2)
    return {
        "staleness_hist_trajectories": staleness_histogram(per_traj, eta),
        "staleness_hist_tokens": per_token.tolist(),
        "staleness_tokens_mean": float(
            (per_token * np.arange(eta + 2)).sum() / max(per_token.sum(), 1)
        ),
        "mixed_version_frac": mixed / max(len(per_traj), 1),
    }


def staleness_histogram(values: Sequence[int], max_staleness: int) -> list[int]:
    """Counts of staleness 0..max_staleness, then one bin for anything staler."""
    hist = [0] * (max_staleness + 2)
    for v in values:
        hist[min(max(v, 0), max_staleness + 1)] += 1
    return hist
