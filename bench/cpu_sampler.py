"""CPU time of a run's processes while it runs: what each costs per learner step, and its share.

On cores shared with other work, samples/s measures how much CPU the run's processes were given
as much as what they do with it. `CpuSampler` reads, every `interval_s`, the user + system CPU
seconds of every process that `asyncrl run` lists in `<run_dir>/pids.json` (Linux /proc; empty
elsewhere). `summary` then gives, over the steady part of the run (from `skip_s` after the
learner's first step to the last sample in which every process then running still runs), each
process's CPU milliseconds per learner step and
its share of one core, and the samples trained per CPU second of all of them together: a figure
that load from other work changes much less than samples/s.

```
  sampler thread:  every interval_s  pids.json -> /proc/<pid>/stat -> (time, {name: cpu_s})
  summary(rows):   [first step + skip_s, last sample]  -> cpu per step, share, samples / cpu s
```
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any


class CpuSampler:
    """A thread sampling the CPU seconds of a run's processes (use as a context manager)."""

    def __init__(self, run_dir: Path, interval_s: float = 1.0) -> None:
        self.run_dir = run_dir
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            cpu = self.read()
            if cpu:
                self.samples.append((time.time(), cpu))

    def read(self) -> dict[str, float]:
        """CPU seconds so far of every listed process still running."""
        try:
            pids = json.loads((self.run_dir / "pids.json").read_text())
        except (OSError, ValueError):
            return {}
        out = {}
        for name, pid in pids.items():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # gone, or no /proc
            out[name] = (int(fields[11]) + int(fields[12])) / self._tick  # utime + stime
        return out

    def summary(self, rows: list[dict[str, Any]], skip_s: float = 5.0) -> dict[str, Any] | None:
        """Per process CPU ms per learner step and share of a core, and samples per CPU second,
        over the steady window; None with too few samples or steps in it."""
        if not rows:
            return None
        start = rows[0]["time"] + skip_s
        steady = [(t, cpu) for t, cpu in self.samples if t >= start]
        if not steady:
            return None
        names = sorted(steady[0][1])  # the processes running then; the window ends before
        steady = [(t, cpu) for t, cpu in steady if set(names) <= set(cpu)]  # any of them exits
        if len(steady) < 3:
            return None
        (t0, first), (t1, last) = steady[0], steady[-1]
        inside = [r for r in rows if t0 < r["time"] <= t1]
        if len(inside) < 5:
            return None
        used = {n: last[n] - first[n] for n in names}
        samples = sum(r["samples"] for r in inside)
        return {
            "window_s": t1 - t0,
            "cpu_ms_per_step": {n: 1e3 * used[n] / len(inside) for n in names},
            "cpu_share": {n: used[n] / (t1 - t0) for n in names},
            "samples_per_cpu_s": samples / max(sum(used.values()), 1e-9),
        }
