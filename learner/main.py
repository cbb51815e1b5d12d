"""`asyncrl learner`: the learner process, one rank or N (spawned here or by a launcher).

    asyncrl learner --config C --hub EP [--world N] [--run-dir D] [--resume]

Rank 0 connects to the hub and runs `Learner.train` (learner/loop.py); ranks > 0 build the same
sharded model and follow rank 0's commands (learner/parallel.py). Without RANK/WORLD_SIZE in the
environment and with N > 1, this process starts N local ranks of itself and waits for them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Sequence
from pathlib import Path

import torch

from asyncrl.config import RunConfig, load_config, to_toml
from asyncrl.metrics import start as start_metrics
from asyncrl.models.tiny import ensure_model
from asyncrl.transport.connection import HubConnection
from learner.loop import Learner
from learner.metrics_log import MetricsLog
from learner.observe import LearnerObserver
from learner.parallel import (
    Op,
    Ranks,
    init_world,
    leave_world,
    ranks_from_env,
    send_command,
    spawn_local,
)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl learner", description="Run the learner.")
    p.add_argument("--config", required=True, help="run config TOML")
    p.add_argument("--hub", required=True, help="hub endpoint")
    p.add_argument("--run-dir", default="", help="overrides run.run_dir")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    p.add_argument("--world", type=int, default=0, help="learner ranks (overrides learner.world)")
    p.add_argument(
        "--wait-actors-s",
        type=float,
        default=20.0,
        help="at exit, wait this long for actors to load the final weights",
    )
    return p.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    """`asyncrl learner`: train until learner.max_steps (or SIGTERM), then checkpoint.

    With `--world N` (or learner.world = N) and no RANK/WORLD_SIZE in the environment, this
    process starts N local ranks of itself and waits for them; under torchrun / srun / an
    indexed Job each process is one rank and joins through those variables.
    """
    args = parse_args(argv)
    overrides = list(args.set) + (
        [f"run.run_dir={json.dumps(args.run_dir)}"] if args.run_dir else []
    )
    cfg = load_config(args.config, overrides)
    world = args.world or cfg.learner.world
    ranks = ranks_from_env()
    if "WORLD_SIZE" not in os.environ and world > 1:
        return spawn_local(world, [*argv, "--set", f"learner.world={world}"])
    if args.world and args.world != ranks.world:
        raise ValueError(f"--world {args.world}: the environment says WORLD_SIZE={ranks.world}")
    if cfg.learner.groups_per_step < ranks.world:
        raise ValueError(
            f"learner.groups_per_step: {cfg.learner.groups_per_step} groups cannot be shared by "
            f"WORLD_SIZE={ranks.world} ranks (every rank trains on whole groups)"
        )
    init_world(ranks, cfg.learner.dist_timeout_s)
    try:
        code = _rank_main(cfg, args, ranks)
    except BaseException:
        leave_world(clean=False)
        raise
    leave_world(clean=True)
    return code


def _rank_main(cfg: RunConfig, args: argparse.Namespace, ranks: Ranks) -> int:
    """One rank's whole life inside the process group."""
    run_dir = Path(cfg.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model_dir = ensure_model(cfg.model, cfg.task)
    if not ranks.is_leader:
        return _follow(cfg, run_dir, model_dir, ranks, args.resume)
    (run_dir / "learner_config.toml").write_text(to_toml(cfg))
    conn = HubConnection(
        args.hub,
        role="learner",
        client_id="learner",
        config_hash=cfg.config_hash(),
        heartbeat_interval_s=cfg.replay.heartbeat_interval_s,
        max_message_bytes=cfg.replay.max_message_bytes,
        hwm=cfg.replay.hwm,
        auth_dir=cfg.replay.auth_dir,
        acks_batches=True,
    )
    learner = Learner(cfg, run_dir, conn, model_dir, ranks)
    if args.resume:
        learner.resume()
    if cfg.metrics.learner_port:
        learner.live = start_metrics("learner", "rank0", cfg.metrics.learner_port)
    learner.obs = LearnerObserver(learner)
    signal.signal(signal.SIGTERM, lambda *_: learner.stop_event.set())
    signal.signal(signal.SIGINT, lambda *_: learner.stop_event.set())
    welcome = conn.start()
    learner.members = []
    log = MetricsLog(run_dir)
    try:
        print(
            f"learner: connected (hub at version {welcome.policy_version}), starting at version "
            f"{learner.policy_version} with {ranks.world} rank(s)",
            flush=True,
        )
        learner.report_version()
        learner.wait_for_actors(cfg.run.num_actors, cfg.learner.wait_actors_s)
        learner.train(log)
    finally:
        try:
            summary = learner.finish(args.wait_actors_s)
            (run_dir / "learner_summary.json").write_text(json.dumps(summary, indent=1))
        finally:
            if ranks.distributed:
                send_command(Op.STOP)
            _close(log, learner, conn)
    return 0


def _follow(cfg: RunConfig, run_dir: Path, model_dir: Path, ranks: Ranks, resume: bool) -> int:
    """A rank > 0: build the same sharded model, then mirror rank 0 until it says STOP.

    SIGTERM and SIGINT are left to rank 0, which finishes the step, checkpoints (with this
    rank's shards) and then releases the others.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    learner = Learner(cfg, run_dir, None, model_dir, ranks)
    if resume:
        learner.resume()
    learner.follow()
    return 0


def _close(log: MetricsLog, learner: Learner, conn: HubConnection) -> None:
    try:
        log.close()
        if learner.obs is not None:
            learner.obs.close()
        if learner.publisher is not None:
            learner.publisher.close()
    finally:
        conn.close(reason="done")
