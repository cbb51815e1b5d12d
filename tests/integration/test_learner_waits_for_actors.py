"""The learner holds its first step until run.num_actors actors are connected.

Hub, learner and actors are real processes (started and ended by pid). An actor that joins
late, here started only once the learner has said it waits for it, still trains from the first
step's weights and ends on the learner's final ones; with a short learner.wait_actors_s the
learner starts with the actors it has and says how many are missing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.config import RunConfig, load_config
from launch.processes import Processes
from launch.run import prepare, wait_for_file

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, *overrides: str) -> RunConfig:
    return load_config(
        REPO / "configs" / "tiny_cpu.toml",
        [
            f"model.cache_dir={json.dumps(str(tmp_path / 'models'))}",
            f"run.run_dir={json.dumps(str(tmp_path / 'run'))}",
            "run.num_actors=2",
            "learner.max_steps=2",
            "replay.max_staleness=0",
            *overrides,
        ],
    )


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    started = Processes(run_dir)
    yield started
    started.stop(list(started.procs), grace_s=30)  # by pid; a no-op for those already gone


def _start(procs: Processes, cfg: RunConfig) -> str:
    """Hub and learner; returns the hub endpoint."""
    run_dir = Path(cfg.run.run_dir)
    config_path, dataset = prepare(cfg, run_dir)
    args = ["--config", str(config_path)]
    hub = procs.start(
        "hub",
        [
            "replay",
            *args,
            "--dataset",
            str(dataset),
            "--endpoint-file",
            str(run_dir / "hub.endpoint"),
        ],
        threads=1,
    )
    endpoint = wait_for_file(run_dir / "hub.endpoint", hub, timeout_s=60)
    procs.start(
        "learner", ["learner", *args, "--hub", endpoint, "--run-dir", str(run_dir)], threads=1
    )
    return endpoint


def _start_actor(procs: Processes, cfg: RunConfig, endpoint: str, index: int) -> None:
    run_dir = Path(cfg.run.run_dir)
    name = f"actor-{index}"
    procs.start(
        name,
        [
            "actor",
            "--config",
            str(run_dir / "config.toml"),
            "--hub",
            endpoint,
            "--actor-id",
            name,
            "--index",
            str(index),
            "--status-file",
            str(run_dir / f"{name}.json"),
        ],
        threads=1,
    )


def _wait_for_log(procs: Processes, name: str, text: str, timeout_s: float = 240) -> str:
    log = procs.run_dir / f"{name}.log"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        content = log.read_text() if log.is_file() else ""
        if text in content:
            return content
        failed = procs.failed()
        assert not failed, f"{failed} exited with an error:\n{content[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"{name}.log never showed {text!r}:\n{content[-3000:]}")


def _finish(procs: Processes) -> dict:
    learner = procs.procs["learner"]
    assert learner.wait(timeout=300) == 0, (procs.run_dir / "learner.log").read_text()[-3000:]
    procs.stop([n for n in procs.procs if n.startswith("actor-")], grace_s=30)
    return json.loads((procs.run_dir / "learner_summary.json").read_text())


def test_a_late_actor_is_waited_for_and_ends_on_the_final_weights(
    tmp_path: Path, procs: Processes
) -> None:
    cfg = _config(tmp_path)
    endpoint = _start(procs, cfg)
    _start_actor(procs, cfg, endpoint, 0)
    _wait_for_log(procs, "learner", "waiting for actors: 1 of 2 connected (actor-0)")
    # The learner has said it waits for the second actor: no step can have run yet.
    metrics = procs.run_dir / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text()
    _start_actor(procs, cfg, endpoint, 1)
    summary = _finish(procs)
    assert summary["policy_version"] == 2
    assert summary["actors_loaded"] == {"actor-0": 2, "actor-1": 2}
    for name in ("actor-0", "actor-1"):
        status = json.loads((procs.run_dir / f"{name}.json").read_text())
        assert status["policy_version"] == 2, status
        assert status["weights_digest"] == summary["weights_digest"], status
    rows = [json.loads(line) for line in (procs.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def test_past_wait_actors_s_the_learner_starts_with_the_actors_it_has(
    tmp_path: Path, procs: Processes
) -> None:
    cfg = _config(tmp_path, "learner.wait_actors_s=1.0")
    endpoint = _start(procs, cfg)
    _start_actor(procs, cfg, endpoint, 0)
    log = _wait_for_log(procs, "learner", "starting with them")
    # actor-0 may still be loading its engine then: 0 or 1 of 2
    assert "of run.num_actors=2 actors connected within learner.wait_actors_s=1 s" in log
    summary = _finish(procs)
    assert summary["policy_version"] == 2
    assert summary["actors_loaded"] == {"actor-0": 2}
