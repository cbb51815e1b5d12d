"""`asyncrl actor`: the actor process. Parses its arguments, loads the config, the engine
(`actor.engine`: torch or vLLM) and the weight receiver, connects to the hub, runs the `Actor`
of actors/actor.py until SIGTERM, and writes its final state (`--status-file`) on the way out.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from actors.actor import ACTOR_COUNTERS, Actor
from actors.engines.base import Engine
from actors.evaluation import ActorEvaluator
from asyncrl.config import RunConfig, load_config
from asyncrl.files import replace_text
from asyncrl.metrics import start as start_metrics
from asyncrl.transport.connection import HubConnection
from asyncrl.weights.digest import digest_named_tensors


def build_engine(cfg: RunConfig, model_dir: Path, seed: int) -> Engine:
    """The engine named by `actor.engine`, loading `model_dir`."""
    if cfg.actor.engine == "torch":
        from actors.engines.torch_engine import TorchEngine

        return TorchEngine(model_dir, dtype=cfg.model.dtype, seed=seed)
    from actors.engines.vllm_engine import VllmEngine

    return VllmEngine(
        model_dir, dtype=cfg.model.dtype, seed=seed, kv_cache_gib=cfg.actor.vllm_kv_cache_gib
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl actor", description="Run one rollout actor.")
    p.add_argument("--config", required=True, help="run config TOML")
    p.add_argument("--hub", required=True, help="hub endpoint, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--engine", choices=["torch", "vllm"], help="overrides actor.engine")
    p.add_argument("--actor-id", default=f"actor-{os.getpid()}", help="unique name of this actor")
    p.add_argument("--index", type=int, default=0, help="actor index (seed offset)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    p.add_argument(
        "--status-file", default="", help="JSON written at exit: stats, version, weights digest"
    )
    p.add_argument(
        "--max-groups", type=int, default=0, help="stop after generating this many groups"
    )
    return p.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    """`asyncrl actor`: connect to the hub and generate until SIGTERM."""
    args = parse_args(argv)
    stop = threading.Event()  # set by SIGTERM/SIGINT, even while the engine is still starting
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 pid`: stacks to stderr
    overrides = list(args.set) + ([f"actor.engine={args.engine}"] if args.engine else [])
    cfg = load_config(args.config, overrides)
    from transformers import AutoTokenizer

    from actors.envs.registry import env_factory
    from asyncrl.models.tiny import ensure_model
    from asyncrl.weights.broadcast import WeightReceiver
    from asyncrl.weights.bucket_plan import BucketPlan, params_from_safetensors

    make_env = env_factory(cfg.task)  # an unknown task fails before the engine loads
    model_dir = ensure_model(cfg.model, cfg.task)
    engine = build_engine(cfg, model_dir, seed=cfg.run.seed + 1000 * (args.index + 1))
    plan = BucketPlan.from_params(params_from_safetensors(model_dir), cfg.weights.bucket_bytes)
    receiver = WeightReceiver(
        plan, args.actor_id, timeout_s=cfg.weights.timeout_s, backend=cfg.weights.backend
    )
    conn = HubConnection(
        args.hub,
        role="actor",
        client_id=args.actor_id,
        config_hash=cfg.config_hash(),
        concurrency=cfg.actor.num_window_credits,
        heartbeat_interval_s=cfg.replay.heartbeat_interval_s,
        max_message_bytes=cfg.replay.max_message_bytes,
        hwm=cfg.replay.hwm,
        auth_dir=cfg.replay.auth_dir,
    )
    actor = Actor(
        cfg,
        actor_id=args.actor_id,
        conn=conn,
        engine=engine,
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        make_env=lambda: make_env(cfg.task),
        receiver=receiver,
    )
    actor.stop_event = stop
    actor.evaluator = ActorEvaluator(actor, lambda: make_env(cfg.task))
    if cfg.metrics.actor_port:
        port = cfg.metrics.actor_port + args.index
        actor.live = start_metrics("actor", args.actor_id, port, ACTOR_COUNTERS)
    conn.start()
    try:
        actor.run(max_groups=args.max_groups)
    finally:
        conn.close(reason="shutdown")  # Bye right after the CreditReturn: nothing granted between
        receiver.close()
        if args.status_file:
            write_status(Path(args.status_file), actor)
        actor.episodes.close()
        actor.rewards.close()
        engine.close()
    return 0


def write_status(path: Path, actor: Actor) -> None:
    """The actor's final state; the digest is of the weights the engine really holds."""
    actor.stats["wall_s"] = time.perf_counter() - actor.started
    status = {
        "actor_id": actor.actor_id,
        "policy_version": actor.engine.policy_version,
        "weights_digest": digest_named_tensors(actor.engine.named_weights()),
        "stats": actor.status_stats(),
        "round_generate_s": [round(s, 6) for s in actor.episodes.round_generate_s],
    }
    replace_text(path, json.dumps(status, indent=1))
