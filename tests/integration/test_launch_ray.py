"""`asyncrl launch --ray` on a real local Ray head (2 CPUs, loopback), started by the test.

A tiny run trains end to end under the launcher with two actors and two learner ranks (FSDP2,
placed in a placement group, rank 0's node and port as their rendezvous), the hub on the node's
address with CURVE auth on; one actor's Ray worker is
SIGKILLed mid-run (its pid from the run's pids.json): Ray restarts it, the role process starts
again, rejoins the hub, and the run still ends at its step budget with every actor, the
restarted one included, holding the learner's final weights.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.transport.sockets import free_port

pytest.importorskip("ray", reason="Ray not installed (pip install '.[ray]')")

REPO = Path(__file__).resolve().parents[2]
STEPS = 300


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Ray head on 127.0.0.1 with 2 CPUs; stopped through the pid of `ray start --block`."""
    port = free_port()
    temp = tmp_path_factory.mktemp("ray")
    cmd = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        "--block",
        "--num-cpus=2",
        "--num-gpus=0",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={temp}",
    ]
    head = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True
    )
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while (
        subprocess.run(
            [sys.executable, "-m", "ray.scripts.scripts", "status", f"--address={address}"],
            capture_output=True,
        ).returncode
        != 0
    ):
        assert head.poll() is None, "ray start exited"
        assert time.monotonic() < deadline, "the Ray head did not come up within 120 s"
        time.sleep(1)
    yield address
    head.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)  # the process group this test created
        head.wait()


@pytest.mark.slow
def test_launch_trains_and_survives_a_killed_actor_worker(ray_head: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    keys = tmp_path / "keys"  # the hub binds the node's address: CURVE auth, as on a cluster
    subprocess.run(
        [sys.executable, "-m", "asyncrl", "keygen", str(keys), "--clients", "1"], check=True
    )
    overrides = [
        f"replay.auth_dir={json.dumps(str(keys))}",
        f"learner.max_steps={STEPS}",
        "run.num_actors=2",
        "learner.world=2",
        "launch.hub_cpus=0.2",
        "launch.actor_cpus=0.4",
        "launch.learner_cpus=0.5",
        "run.progress_every_s=1",
        f"model.cache_dir={json.dumps(str(tmp_path / 'models'))}",
    ]
    cmd = [
        sys.executable,
        "-m",
        "asyncrl",
        "launch",
        str(REPO / "configs" / "tiny_cpu.toml"),
        "--ray",
        ray_head,
        "--run-dir",
        str(run_dir),
        *[a for o in overrides for a in ("--set", o)],
    ]
    log = tmp_path / "launch.log"
    with log.open("w") as out_file:
        launcher = subprocess.Popen(cmd, stdout=out_file, stderr=subprocess.STDOUT)
        try:
            kill_an_actor_worker_mid_run(run_dir, launcher)
            launcher.wait(timeout=420)
        finally:
            if launcher.poll() is None:
                launcher.kill()  # by pid
                launcher.wait()
    out = log.read_text()
    assert launcher.returncode == 0, out[-4000:]
    assert "actor-1's Ray worker is gone" in out, out[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    learner = json.loads((run_dir / "learner_summary.json").read_text())
    for name in ("actor-0", "actor-1"):
        status = json.loads((run_dir / f"{name}.json").read_text())
        assert status["policy_version"] == STEPS, (name, status)
        assert status["weights_digest"] == learner["weights_digest"], name
    assert "with 2 rank(s)" in (run_dir / "learner.log").read_text()
    for log in ("hub.log", "actor-0.log", "actor-1.log", "learner.log", "learner-rank1.log"):
        assert (run_dir / log).is_file(), log


def kill_an_actor_worker_mid_run(run_dir: Path, launcher: subprocess.Popen[bytes]) -> int:
    """Once 20 steps are logged, SIGKILL actor-1's Ray worker (by pid); return that pid."""
    deadline = time.monotonic() + 300
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 20):
        assert launcher.poll() is None, "the launcher exited early"
        assert time.monotonic() < deadline, "no training progress under the launcher"
        time.sleep(0.5)
    worker_pid, _ = json.loads((run_dir / "pids.json").read_text())["actor-1"]
    os.kill(worker_pid, signal.SIGKILL)
    return worker_pid
