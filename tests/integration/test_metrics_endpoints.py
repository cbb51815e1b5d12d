"""Live Prometheus endpoints of the hub, an actor and the learner, scraped during a real run.

`asyncrl run` on a tiny budget with `[metrics]` ports set; while it trains, each endpoint is
fetched with a real HTTP client until its metrics show work done (groups received and consumed
at the hub, groups pushed by the actor, training steps and the staleness histogram at the
learner). Ports are chosen free by the test.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from asyncrl.transport.sockets import free_port

REPO = Path(__file__).resolve().parents[2]


def scrape(port: int) -> dict[str, float]:
    """name{labels} -> value of every sample the endpoint serves ({} when it is not up)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    samples = {}
    for line in text.splitlines():
        match = re.fullmatch(r"([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)", line)
        if match and not line.startswith("#"):
            samples[match.group(1)] = float(match.group(2))
    return samples


def value(samples: dict[str, float], name: str) -> float:
    """The sample of metric `name` (any labels); -1 when absent."""
    found = [v for k, v in samples.items() if k == name or k.startswith(name + "{")]
    return found[0] if found else -1.0


def test_every_process_serves_live_metrics(tmp_path: Path) -> None:
    hub, actor, learner = free_port(), free_port(), free_port()
    overrides = [
        f"metrics.hub_port={hub}",
        f"metrics.actor_port={actor}",
        f"metrics.learner_port={learner}",
        "learner.max_steps=400",
        f"model.cache_dir={json.dumps(str(tmp_path / 'models'))}",
    ]
    cmd = [
        sys.executable,
        "-m",
        "asyncrl",
        "run",
        str(REPO / "configs" / "tiny_cpu.toml"),
        "--run-dir",
        str(tmp_path / "run"),
        "--quiet",
        *[a for o in overrides for a in ("--set", o)],
    ]
    run = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: dict[str, dict[str, float]] = {}
    want = {
        "hub": (
            hub,
            [
                "asyncrl_hub_groups_received_total",
                "asyncrl_hub_groups_consumed_total",
                "asyncrl_hub_policy_version",
                "asyncrl_hub_clients_alive",
            ],
        ),
        "actor": (actor, ["asyncrl_actor_groups_pushed_total", "asyncrl_actor_tokens_per_s"]),
        "learner": (
            learner,
            [
                "asyncrl_learner_reward_mean",
                "asyncrl_learner_step",
                "asyncrl_learner_staleness_hist",
                "asyncrl_learner_ess",
            ],
        ),
    }
    try:
        deadline = time.monotonic() + 300
        while len(seen) < len(want) and run.poll() is None and time.monotonic() < deadline:
            for role, (port, names) in want.items():
                samples = scrape(port)
                if role not in seen and all(value(samples, n) > 0 for n in names[:2]):
                    seen[role] = samples
            time.sleep(0.5)
    finally:
        run.send_signal(signal.SIGINT)  # Ctrl-C: `asyncrl run` stops every child by pid
        try:
            run.wait(timeout=120)
        except subprocess.TimeoutExpired:
            run.kill()
            run.wait()
    assert set(seen) == set(want), f"endpoints that showed work: {sorted(seen)}"
    for role, (_, names) in want.items():
        for name in names:
            assert value(seen[role], name) >= 0, (role, name)
    assert 'role="learner"' in next(k for k in seen["learner"] if "staleness_hist" in k)
