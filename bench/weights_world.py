"""Weight publication from a 2-rank FSDP2 learner vs a single-rank learner, same model, one run.

`python bench/weights.py --world 2` runs this (or `python bench/weights_world.py`). The model is
the 207-tensor Qwen2-style decoder of bench/weights.py, built as a real transformers model so
FSDP2 can shard it per block. Interleaved rep by rep, both publications go to the same two
receiver processes (WeightReceiver, gloo over loopback) and are timed until both hold them:

- `world1`: the single-rank path: snapshot all buckets, broadcast on the publisher thread;
- `world2`: this process is rank 0 of a 2-rank gloo world (rank 1 is a subprocess following
            its commands, as under `asyncrl learner --world 2`); every bucket's parameters are
            all-gathered from the shards, packed, broadcast and released (learner/publish.py).

Writes the `world2` section of bench/results/weights.json (other sections are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_common import environment, spread  # noqa: E402
from weights import ACTORS, wait_got, with_receivers  # noqa: E402
from weights_models import SHAPE  # noqa: E402

from asyncrl.config import load_config  # noqa: E402
from asyncrl.transport.sockets import free_port  # noqa: E402
from asyncrl.weights.bucket_plan import BucketPlan, params_from_module  # noqa: E402
from learner.parallel import (  # noqa: E402
    Op,
    Ranks,  # noqa: E402
    recv_command,
    send_command,
    shard_model,
)
from learner.publish import ShardedSource, gather_all  # noqa: E402


def build_model() -> torch.nn.Module:
    """The bench's Qwen2-style decoder (SHAPE) as a transformers model, seeded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, kv = SHAPE["hidden"], SHAPE["kv_dim"]
    heads = hidden // 64
    config = Qwen2Config(
        hidden_size=hidden,
        num_hidden_layers=SHAPE["num_layers"],
        num_attention_heads=heads,
        num_key_value_heads=heads * kv // hidden,
        intermediate_size=SHAPE["intermediate"],
        vocab_size=SHAPE["vocab"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def follower(port: int) -> int:
    """Rank 1: shard the same model, join every publication's gathers until STOP."""
    dist.init_process_group("gloo", rank=1, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    model = build_model()
    plan = BucketPlan.from_params(params_from_module(model), int(os.environ["BUCKET_BYTES"]))
    shard_model(model, Ranks(rank=1, world=2, local_rank=1, backend="gloo"))
    while (op := recv_command()[0]) is not Op.STOP:
        assert op is Op.PUBLISH, op
        gather_all(plan, model)
    dist.destroy_process_group()
    return 0


def measure(args: Any, cfg: Any) -> dict[str, list[float]]:
    port = free_port()
    env = dict(os.environ, BUCKET_BYTES=str(cfg.bucket_bytes), OMP_NUM_THREADS="1")
    rank1 = subprocess.Popen([sys.executable, __file__, "--follower", str(port)], env=env)
    try:
        dist.init_process_group("gloo", rank=0, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
        full = build_model()
        plan = BucketPlan.from_params(params_from_module(full), cfg.bucket_bytes)
        sharded = build_model()
        shard_model(sharded, Ranks(rank=0, world=2, local_rank=0, backend="gloo"))
        source = ShardedSource(plan, sharded, torch.device("cpu"))
        times = with_receivers(cfg, plan, lambda *a: _reps(args, full, source, *a))
        send_command(Op.STOP)
        return times
    finally:
        try:
            rank1.wait(timeout=120)
        except subprocess.TimeoutExpired:
            rank1.kill()  # by pid
            rank1.wait()


def _reps(
    args: Any,
    full: torch.nn.Module,
    source: ShardedSource,
    raw_pg: Any,
    group: Any,
    publisher: Any,
    results: Any,
    command: Any,
) -> dict[str, list[float]]:
    del raw_pg, group, command  # the receivers follow announcements only
    times: dict[str, list[float]] = {"world1_publish": [], "world2_publish": []}
    version = 0
    for rep in range(args.warmup + args.reps):
        version += 1
        t0 = time.perf_counter()
        publisher.publish(version, full.named_parameters(), ACTORS)
        wait_got(results, version, publisher.timeout_s * 4)
        assert publisher.wait(publisher.timeout_s) and publisher.last_result.ok
        one = time.perf_counter() - t0
        version += 1
        t0 = time.perf_counter()
        send_command(Op.PUBLISH)
        result = publisher.publish_blocking(version, source.buckets(), ACTORS)
        wait_got(results, version, publisher.timeout_s * 4)
        two = time.perf_counter() - t0
        assert result.ok, result
        if rep >= args.warmup:
            times["world1_publish"].append(one)
            times["world2_publish"].append(two)
        print(f"rep {rep}: world 1 {one:.3f}s, world 2 (from shards) {two:.3f}s", flush=True)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.toml"))
    parser.add_argument("--set", action="append", default=[], help="section.key=value (weights.*)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "weights.json"))
    parser.add_argument("--follower", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.follower:
        return follower(args.follower)
    torch.set_num_threads(1)
    cfg = load_config(args.config, args.set).weights
    times = measure(args, cfg)
    med = {k: statistics.median(v) for k, v in times.items()}
    section = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        **environment(("torch", "msgpack")),
        "world2_over_world1_publish_s": med["world2_publish"] / med["world1_publish"],
        "metrics": {f"{k}_s": spread(v) for k, v in times.items()},
        "note": "world 2 gathers each bucket from the shards while it broadcasts (never the whole "
        "model on one rank); world 1 snapshots all buckets first. Both ranks, both receivers and "
        "the sender share this machine's 2 cores.",
    }
    print(json.dumps({k: v for k, v in section.items() if k != "versions"}, indent=1))
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.is_file() else {}
    data["world2"] = section
    out.write_text(json.dumps(data, indent=1))
    print(f"wrote the world2 section of {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
