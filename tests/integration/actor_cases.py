"""A real hub and a learner for the actor's integration tests: the run config, `python -m`
processes ended by pid, the hub started on an endpoint, an `Actor` connected to a fresh hub
(`actor_on_hub`), and `Learner`, a learner-role `HubConnection` that requests groups and
publishes weights."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from actors.actor import Actor
from actors.engines.torch_engine import TorchEngine
from actors.envs.sort_task import write_dataset
from asyncrl.config import RunConfig, load_config, to_toml
from asyncrl.protocol.messages import (
    Batch,
    Group,
    SampleRequest,
    Stats,
    StatsRequest,
    WeightsAnnounce,
)
from asyncrl.transport.connection import HubConnection

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 180.0  # generous deadlines (vLLM startup on a loaded box); never asserted as speed
ACTOR_ID = "actor-under-test"


def write_config(tmp: Path, model_dir: Path, engine: str) -> tuple[RunConfig, Path]:
    overrides = [
        f"model.path={json.dumps(str(model_dir))}",
        f"actor.engine={engine}",
        "actor.group_size=4",
        "actor.concurrency=2",
        "actor.max_new_tokens=8",
        "actor.vllm_kv_cache_gib=0.25",
        "learner.groups_per_step=2",
        "replay.max_staleness=1000",
        "replay.capacity_groups=12",
        "replay.heartbeat_interval_s=0.2",
        "task.num_prompts=400",
        f"weights.bucket_bytes={64 * 1024}",
    ]
    cfg = load_config(None, overrides)
    path = tmp / "config.toml"
    path.write_text(to_toml(cfg))
    return cfg, path


def python_m(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "asyncrl", *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def end(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, dump: bool = False) -> int:
    """Signal a process we started (by pid) and reap it; SIGKILL if it lingers (after asking
    it, with `dump`, to write its threads' stacks to its log: actors register SIGUSR1 for it)."""
    if proc.poll() is None:
        os.kill(proc.pid, sig)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            if dump:
                os.kill(proc.pid, signal.SIGUSR1)
                time.sleep(2)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def start_hub(
    tmp: Path, config: Path, dataset: Path, bind: str
) -> tuple[subprocess.Popen[bytes], str]:
    endpoint_file = tmp / f"hub-{time.monotonic_ns()}.endpoint"
    proc = python_m(
        [
            "replay",
            "--config",
            str(config),
            "--dataset",
            str(dataset),
            "--bind",
            bind,
            "--endpoint-file",
            str(endpoint_file),
            "--log-level",
            "WARNING",
        ],
        tmp / "hub.log",
    )
    deadline = time.monotonic() + WAIT_S
    while not endpoint_file.exists():
        assert proc.poll() is None, (tmp / "hub.log").read_text()
        assert time.monotonic() < deadline, "the hub did not start"
        time.sleep(0.05)
    return proc, endpoint_file.read_text().strip()


@contextlib.contextmanager
def actor_on_hub(
    tmp: Path, cfg: RunConfig, config: Path, model_dir: Path, make_env: Callable[[], Any]
) -> Iterator[tuple[Actor, str, Path]]:
    """A hub on `config` with a fresh sort dataset and an `Actor` (TorchEngine, `make_env`)
    connected to it as ACTOR_ID: (actor, hub endpoint, dataset). Both end on exit."""
    dataset = write_dataset(tmp / "prompts.jsonl", cfg.task)
    hub, endpoint = start_hub(tmp, config, dataset, "tcp://127.0.0.1:0")
    conn = HubConnection(
        endpoint,
        role="actor",
        client_id=ACTOR_ID,
        config_hash=cfg.config_hash(),
        concurrency=cfg.actor.num_window_credits,
    )
    try:
        conn.start(timeout_s=WAIT_S)
        actor = Actor(
            cfg,
            actor_id=ACTOR_ID,
            conn=conn,
            engine=TorchEngine(model_dir),
            tokenizer=AutoTokenizer.from_pretrained(model_dir),
            make_env=make_env,
        )
        yield actor, endpoint, dataset
    finally:
        conn.close()
        end(hub)


class Learner:
    """This process's side: batches, versions, stats, weight announcements."""

    def __init__(self, endpoint: str, cfg: RunConfig) -> None:
        self.conn = HubConnection(
            endpoint,
            role="learner",
            client_id="test-learner",
            config_hash=cfg.config_hash(),
            heartbeat_interval_s=0.2,
        )
        self.conn.start(timeout_s=WAIT_S)
        self.request_id = 0
        self.policy_version = 0

    def reply(self, wanted: type, timeout_s: float = WAIT_S) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.conn.recv(timeout_s=0.5)
            if isinstance(msg, wanted) and getattr(msg, "request_id", self.request_id) == (
                self.request_id
            ):
                return msg
        raise TimeoutError(f"no {wanted.__name__} from the hub")

    def groups(self, num_groups: int = 2) -> list[Group]:
        self.request_id += 1
        self.conn.send(
            SampleRequest(
                request_id=self.request_id,
                num_groups=num_groups,
                policy_version=self.policy_version,
            )
        )
        return list(self.reply(Batch).groups)

    def stats(self) -> dict[str, Any]:
        self.conn.send(StatsRequest())
        return self.reply(Stats).stats

    def announce(self, announcement: dict[str, Any]) -> None:
        self.conn.send(
            WeightsAnnounce(
                policy_version=int(announcement["policy_version"]),
                plan_hash=str(announcement["plan_hash"]),
                announcement=announcement,
            )
        )
