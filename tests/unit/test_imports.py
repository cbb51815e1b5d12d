"""The core and the hub import neither torch nor vllm: a replay node runs on a CPU-only box."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODULES = [
    "asyncrl.config",
    "asyncrl.protocol.messages",
    "asyncrl.protocol.codec",
    "asyncrl.protocol.group_codec",
    "asyncrl.transport.sockets",
    "asyncrl.transport.connection",
    "asyncrl.transport.auth",
    "asyncrl.cli",
    "replay.buffer",
    "replay.core",
    "replay.prompts",
    "replay.server",
    "replay.main",
]

PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "vllm", "transformers"))
print(json.dumps(heavy))
"""


def test_core_and_replay_do_not_import_torch_or_vllm() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *MODULES],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


RAY_PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "ray")))
"""


def test_ray_stays_optional() -> None:
    """Every process role and the launcher module itself import Ray only when launching."""
    roles = ["launch.run", "actors.actor_main", "learner.loop", "replay.main", "launch.ray_cluster"]
    out = subprocess.run(
        [sys.executable, "-c", RAY_PROBE, *roles],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
