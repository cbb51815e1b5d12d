"""Weight broadcast: bucketed vs one broadcast per tensor vs one flat tensor, the learner stall,
and publication from a 2-rank FSDP2 learner.

One sender (this process) and two receiver processes on loopback, gloo, all in one run and
interleaved rep by rep so that machine noise hits every variant alike:

- `per_tensor`: the naive loop, one synchronous `broadcast` per parameter (207 of them);
- `bucketed`:   `GlooGroup.broadcast` of the bucket plan, packing bucket k+1 into a staging
                buffer while bucket k is on the wire (what a publication does after its snapshot);
- `flat`:       one broadcast of a single tensor as large as the whole model: the ceiling;
- `publish`:    end to end through `WeightPublisher` -> announcement -> `WeightReceiver`
                (snapshot, announce, broadcast, hand-over), until both receivers hold it;
- stall:        a matmul training step of ~0.6 s timed alone and with a publication started at
                its beginning (the step thread pays the snapshot copy; the rest overlaps);
- many tensors: per-tensor vs bucketed again, on a model shaped like a large MoE (2,023
                tensors, mostly 32 KB expert matrices), where a per-tensor loop pays one
                collective's latency per tensor (`speedup_many_tensors`).

Every variant ends with a barrier, so a time covers the receivers too. The model has the
shapes of a Qwen2-style decoder (q/k/v biases, untied head): 17 layers, 207 fp32 tensors,
~68 M parameters (`SHAPE`). Writes bench/results/weights.json.

`--world 2` instead times publication from a 2-rank FSDP2 learner against a single-rank one,
the same model built as a real transformers model so FSDP2 can shard it per block. Interleaved
rep by rep, both publications go to the same two receiver processes and are timed until both
hold them:

- `world1`: the single-rank path: snapshot all buckets, broadcast on the publisher thread;
- `world2`: this process is rank 0 of a 2-rank gloo world (rank 1 is a subprocess following
            its commands, as under `asyncrl learner --world 2`); every bucket's parameters are
            all-gathered from the shards, packed, broadcast and released (learner/publish.py).

It writes the `world2` section of bench/results/weights.json (other sections are kept).

    python bench/weights.py [--reps 5] [--warmup 1] [--world 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgpack
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore

from asyncrl.config import load_config
from asyncrl.transport.sockets import free_port
from asyncrl.weights.backends import GlooGroup
from asyncrl.weights.broadcast import WeightPublisher, WeightReceiver
from asyncrl.weights.bucket_plan import (
    BucketPlan,
    allocate_buckets,
    allocate_staging,
    params_from_module,
    staged_buckets,
)
from bench.common import (
    REPO,
    RESULTS,
    command_line,
    environment,
    interleave,
    repeat,
    spread,
    write_json,
)
from learner.parallel import Op, Ranks, recv_command, send_command, shard_model
from learner.publish import ShardedSource, gather_all

ACTORS = ("actor-1", "actor-2")

# -- the models --------------------------------------------------------------------------------

# a Qwen2-style decoder: 207 fp32 tensors, ~68 M parameters
SHAPE = {"num_layers": 17, "hidden": 512, "kv_dim": 128, "intermediate": 1536, "vocab": 16384}
MANY = {
    "num_layers": 10,
    "hidden": 128,
    "num_experts": 64,
    "expert_intermediate": 64,
    "vocab": 4096,
}
"""A large MoE's shape in miniature: 2,023 tensors, most of them small expert matrices."""


def model_params(num_layers: int, hidden: int, kv_dim: int, intermediate: int, vocab: int) -> dict:
    """Parameter shapes of a Qwen2-style decoder, HF names."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for proj, rows in (("q", hidden), ("k", kv_dim), ("v", kv_dim)):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (rows, hidden)
            shapes[f"{p}self_attn.{proj}_proj.bias"] = (rows,)
        shapes[f"{p}self_attn.o_proj.weight"] = (hidden, hidden)
        shapes[f"{p}mlp.gate_proj.weight"] = (intermediate, hidden)
        shapes[f"{p}mlp.up_proj.weight"] = (intermediate, hidden)
        shapes[f"{p}mlp.down_proj.weight"] = (hidden, intermediate)
        shapes[f"{p}input_layernorm.weight"] = (hidden,)
        shapes[f"{p}post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def moe_params(
    num_layers: int, hidden: int, num_experts: int, expert_intermediate: int, vocab: int
) -> dict:
    """Parameter shapes of a Qwen-MoE-style decoder (per-expert matrices), HF names."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for proj in ("q", "k", "v", "o"):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (hidden, hidden)
        for proj in ("q", "k", "v"):
            shapes[f"{p}self_attn.{proj}_proj.bias"] = (hidden,)
        shapes[f"{p}mlp.gate.weight"] = (num_experts, hidden)
        for e in range(num_experts):
            for proj in ("gate", "up"):
                shapes[f"{p}mlp.experts.{e}.{proj}_proj.weight"] = (expert_intermediate, hidden)
            shapes[f"{p}mlp.experts.{e}.down_proj.weight"] = (hidden, expert_intermediate)
        shapes[f"{p}input_layernorm.weight"] = (hidden,)
        shapes[f"{p}post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


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


# -- receivers ---------------------------------------------------------------------------------


def receiver_main(
    rank: int, wire: dict, store_port: int, timeout_s: float, cmds: Any, results: Any
) -> None:
    """Follow the sender's commands: the same collectives in the same order."""
    torch.set_num_threads(1)
    plan = BucketPlan.from_wire(wire)
    store = TCPStore("127.0.0.1", store_port, None, False, timedelta(seconds=timeout_s))
    raw_pg, group = _groups(store, rank, timeout_s)
    per_tensor = [torch.empty(shape) for _, shape, _ in plan.params()]
    flat = torch.empty(plan.total_bytes, dtype=torch.uint8)
    buckets = allocate_buckets(plan)
    receiver = WeightReceiver(plan, ACTORS[rank - 1], timeout_s=timeout_s)

    def report() -> None:
        while receiver.wait_ready(None):
            got = receiver.poll()
            if got is not None:
                results.put(("got", rank, got[0]))

    threading.Thread(target=report, daemon=True).start()
    results.put(("ready", rank, 0))
    while (cmd := cmds.get())[0] != "stop":
        if cmd[0] == "announce":
            receiver.on_announce(msgpack.unpackb(cmd[1]))
            continue
        run_variant(cmd[0], raw_pg, group, flat, per_tensor, buckets)
    receiver.close()


def _groups(store: TCPStore, rank: int, timeout_s: float) -> tuple[ProcessGroupGloo, GlooGroup]:
    """A plain gloo group for the baselines and a `GlooGroup` for the bucketed variant."""
    raw_pg = ProcessGroupGloo(
        PrefixStore("bench/raw", store), rank, 3, timedelta(seconds=timeout_s)
    )
    return raw_pg, GlooGroup(store, epoch=0, rank=rank, world_size=3, timeout_s=timeout_s)


def run_variant(
    name: str, raw_pg: Any, group: GlooGroup, flat: Any, per_tensor: list, buckets: Any
) -> None:
    """One transfer of the whole model; the same call on every rank."""
    opts = BroadcastOptions()
    opts.rootRank = 0
    if name == "flat":
        raw_pg.broadcast([flat], opts).wait()
    elif name == "per_tensor":
        for t in per_tensor:
            raw_pg.broadcast([t], opts).wait()
    elif name == "bucketed":
        group.broadcast(buckets)
    else:
        raise AssertionError(name)
    raw_pg.barrier().wait()


# -- sender ------------------------------------------------------------------------------------


def calibrate_step(target_s: float) -> tuple[Any, int]:
    """A matmul 'training step' of about target_s on one thread."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    t0 = time.perf_counter()
    for _ in range(3):
        torch.mm(a, b)
    per = (time.perf_counter() - t0) / 3
    n = max(1, round(target_s / per))

    def step() -> None:
        c = a
        for _ in range(n):
            c = torch.tanh(torch.mm(c, b) * 0.03)

    return step, n


def wait_got(results: Any, policy_version: int, timeout_s: float) -> None:
    """Until every receiver has reported holding `policy_version`."""
    seen = set()
    while len(seen) < len(ACTORS):
        kind, rank, v = results.get(timeout=timeout_s)
        if kind == "got" and v == policy_version:
            seen.add(rank)


def make_model(shapes: dict, bucket_bytes: int) -> tuple[BucketPlan, dict]:
    torch.manual_seed(0)
    params = {n: torch.randn(s) for n, s in shapes.items()}
    plan = BucketPlan.from_params([(n, s, "float32") for n, s in shapes.items()], bucket_bytes)
    print(
        f"model: {plan.num_tensors} tensors, {plan.total_bytes / 4e6:.1f} M params, "
        f"{plan.total_bytes / 1e6:.0f} MB, {len(plan.buckets)} buckets of <= {bucket_bytes >> 20} MiB"
    )
    return plan, params


def with_receivers(cfg: Any, plan: BucketPlan, work: Any) -> dict[str, list[float]]:
    """Start two receiver processes for `plan`, run `work(raw_pg, group, publisher, results,
    command)`, stop them (by pid when they do not stop)."""
    store = TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=cfg.timeout_s), wait_for_workers=False
    )
    ctx = mp.get_context("spawn")
    cmds = [ctx.Queue() for _ in ACTORS]
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=receiver_main,
            args=(r, plan.to_wire(), store.port, cfg.timeout_s, cmds[r - 1], results),
        )
        for r in (1, 2)
    ]
    for p in procs:
        p.start()
    raw_pg, group = _groups(store, 0, cfg.timeout_s)
    for _ in procs:
        assert results.get(timeout=10 * cfg.timeout_s)[0] == "ready"

    def command(*cmd: Any) -> None:
        for q in cmds:
            q.put(cmd)

    publisher = WeightPublisher(
        plan, timeout_s=cfg.timeout_s, announce=lambda ann: command("announce", msgpack.packb(ann))
    )
    try:
        return work(raw_pg, group, publisher, results, command)
    finally:
        command("stop")
        publisher.close()
        for p in procs:
            p.join(timeout=cfg.timeout_s)
            if p.is_alive():
                p.kill()
                p.join()


def measure_many(
    args: Any,
    plan: BucketPlan,
    params: dict,
    raw_pg: Any,
    group: GlooGroup,
    publisher: WeightPublisher,
    results: Any,
    command: Any,
) -> dict[str, list[float]]:
    """Per-tensor vs bucketed on the many-small-tensors model, interleaved rep by rep."""
    per_tensor = [params[n] for n, _, _ in plan.params()]
    staging = allocate_staging(plan)

    def transfer(name: str) -> Callable[[int], float]:
        def one(_rep: int) -> float:
            command(name)
            t0 = time.perf_counter()
            buckets = staged_buckets(plan, params, staging)
            run_variant(name, raw_pg, group, None, per_tensor, buckets)
            return time.perf_counter() - t0

        return one

    def report(rep: int, got: dict[str, float]) -> None:
        print(f"many tensors, rep {rep}: " + ", ".join(f"{k} {v:.3f}s" for k, v in got.items()))

    variants = {f"many_{name}": transfer(name) for name in ("per_tensor", "bucketed")}
    return interleave(variants, reps=args.reps, warmup=args.warmup, report=report)


def measure(
    args: Any,
    plan: BucketPlan,
    params: dict,
    raw_pg: Any,
    group: GlooGroup,
    publisher: WeightPublisher,
    results: Any,
    command: Any,
) -> dict[str, list[float]]:
    """The three transfers and a publication, interleaved rep by rep; then the learner stall:
    a step alone and a step with a publication started at its beginning."""
    flat = torch.ones(plan.total_bytes, dtype=torch.uint8)
    per_tensor = [params[n] for n, _, _ in plan.params()]
    staging = allocate_staging(plan)
    version = 0

    def transfer(name: str) -> Callable[[int], float]:
        def one(_rep: int) -> float:
            command(name)
            t0 = time.perf_counter()
            buckets = staged_buckets(plan, params, staging)
            run_variant(name, raw_pg, group, flat, per_tensor, buckets)
            return time.perf_counter() - t0

        return one

    def publish(_rep: int) -> float:
        nonlocal version
        version += 1
        t0 = time.perf_counter()
        publisher.publish(version, params.items(), ACTORS)
        published()
        return time.perf_counter() - t0

    def published() -> None:
        wait_got(results, version, publisher.timeout_s * 4)
        assert publisher.wait(publisher.timeout_s) and publisher.last_result.ok, (
            publisher.last_result
        )

    def report(rep: int, got: dict[str, float]) -> None:
        print(f"rep {rep}: " + ", ".join(f"{k} {v:.3f}s" for k, v in got.items()))

    variants = {name: transfer(name) for name in ("flat", "per_tensor", "bucketed")}
    times = interleave(
        {**variants, "publish": publish}, reps=args.reps, warmup=args.warmup, report=report
    )

    step, n = calibrate_step(args.step_s)
    print(f"learner step: {n} matmuls of 1024x1024")

    def stall(rep: int) -> dict[str, float]:
        nonlocal version
        t0 = time.perf_counter()
        step()
        alone = time.perf_counter() - t0
        version += 1
        t0 = time.perf_counter()
        publisher.publish(version, params.items(), ACTORS)
        step()
        with_pub = time.perf_counter() - t0
        published()
        print(f"rep {rep}: step alone {alone:.3f}s, with publication {with_pub:.3f}s")
        snapshot = publisher.last_result.snapshot_s
        return {"step_alone": alone, "step_with_publish": with_pub, "snapshot": snapshot}

    rows = repeat(stall, reps=args.reps, warmup=args.warmup)
    times.update({key: [row[key] for row in rows] for key in rows[0]})
    return times


def report(
    args: Any, cfg: Any, plan: BucketPlan, many: BucketPlan, times: dict[str, list[float]]
) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = plan.total_bytes / 1e9
    step_extra = med["step_with_publish"] - med["step_alone"]
    summary = {
        "bucketed_s": med["bucketed"],
        "per_tensor_s": med["per_tensor"],
        "flat_s": med["flat"],
        "publish_s": med["publish"],
        "speedup": med["per_tensor"] / med["bucketed"],
        "ceiling_gbps": gbps / med["flat"],
        "bucketed_gbps": gbps / med["bucketed"],
        "bucketed_vs_ceiling": med["flat"] / med["bucketed"],
        "publish_gbps": gbps / med["publish"],
        "stall_fraction": step_extra / med["step_alone"],
        "snapshot_fraction": med["snapshot"] / med["step_alone"],
        "speedup_many_tensors": med["many_per_tensor"] / med["many_bucketed"],
        "num_tensors_many": many.num_tensors,
        "many_bucketed_gbps": many.total_bytes / 1e9 / med["many_bucketed"],
    }
    for key, value in summary.items():
        print(f"{key:>20}: {value:.3f}")
    result = {
        "benchmark": "weights",
        "command": command_line(__file__),
        "config": {
            "weights": dataclasses.asdict(cfg),
            "model": SHAPE,
            "model_many_tensors": {**MANY, "total_bytes": many.total_bytes},
            "num_tensors": plan.num_tensors,
            "total_bytes": plan.total_bytes,
            "num_buckets": len(plan.buckets),
            "receivers": len(ACTORS),
            "reps": args.reps,
            "warmup": args.warmup,
            "step_target_s": args.step_s,
        },
        **environment(("torch", "msgpack")),
        "torch_threads": torch.get_num_threads(),
        **summary,
        "targets": {
            "speedup_many_tensors": ">= 5",
            "bucketed_vs_ceiling": ">= 0.9",
            "stall_fraction": "<= 0.10",
        },
        "metrics": {f"{k}_s": spread(v) for k, v in times.items()},
        "note": "sender and both receivers share this machine's CPUs with other work (loopback TCP)",
    }
    write_json(args.out, result)
    print(f"wrote {args.out}")


# -- world 2: publication from a 2-rank FSDP2 learner -----------------------------------------


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


def measure_world(args: Any, cfg: Any) -> dict[str, list[float]]:
    """World 1 and world 2 publications, interleaved, to the same two receivers."""
    port = free_port()
    env = dict(os.environ, BUCKET_BYTES=str(cfg.bucket_bytes), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "bench.weights", "--follower", str(port)]
    rank1 = subprocess.Popen(cmd, cwd=REPO, env=env)
    try:
        dist.init_process_group("gloo", rank=0, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
        full = build_model()
        plan = BucketPlan.from_params(params_from_module(full), cfg.bucket_bytes)
        sharded = build_model()
        shard_model(sharded, Ranks(rank=0, world=2, local_rank=0, backend="gloo"))
        source = ShardedSource(plan, sharded, torch.device("cpu"))
        times = with_receivers(cfg, plan, lambda *a: world_reps(args, full, source, *a))
        send_command(Op.STOP)
        return times
    finally:
        try:
            rank1.wait(timeout=120)
        except subprocess.TimeoutExpired:
            rank1.kill()  # by pid
            rank1.wait()


def world_reps(
    args: Any,
    full: torch.nn.Module,
    source: ShardedSource,
    raw_pg: Any,
    group: Any,
    publisher: WeightPublisher,
    results: Any,
    command: Any,
) -> dict[str, list[float]]:
    del raw_pg, group, command  # the receivers follow announcements only
    version = 0

    def world1(_rep: int) -> float:
        nonlocal version
        version += 1
        t0 = time.perf_counter()
        publisher.publish(version, full.named_parameters(), ACTORS)
        wait_got(results, version, publisher.timeout_s * 4)
        assert publisher.wait(publisher.timeout_s) and publisher.last_result.ok
        return time.perf_counter() - t0

    def world2(_rep: int) -> float:
        nonlocal version
        version += 1
        t0 = time.perf_counter()
        send_command(Op.PUBLISH)
        result = publisher.publish_blocking(version, source.buckets(), ACTORS)
        wait_got(results, version, publisher.timeout_s * 4)
        elapsed = time.perf_counter() - t0
        assert result.ok, result
        return elapsed

    def report(rep: int, got: dict[str, float]) -> None:
        one, two = got["world1_publish"], got["world2_publish"]
        print(f"rep {rep}: world 1 {one:.3f}s, world 2 (from shards) {two:.3f}s", flush=True)

    variants = {"world1_publish": world1, "world2_publish": world2}
    return interleave(variants, reps=args.reps, warmup=args.warmup, report=report)


def write_world(args: Any, times: dict[str, list[float]]) -> None:
    """The `world2` section of the result file (its other sections are kept)."""
    med = {k: statistics.median(v) for k, v in times.items()}
    section = {
        "command": command_line(__file__),
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
    write_json(out, data)
    print(f"wrote the world2 section of {out}")


# -- main --------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny_cpu.toml"))
    parser.add_argument("--set", action="append", default=[], help="section.key=value (weights.*)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--step-s", type=float, default=0.6, help="target length of a learner step")
    parser.add_argument("--out", default=str(RESULTS / "weights.json"))
    parser.add_argument(
        "--world",
        type=int,
        default=1,
        choices=(1, 2),
        help="2: publication from a 2-rank FSDP2 learner vs 1 rank (the world2 section)",
    )
    parser.add_argument("--follower", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.follower:
        return follower(args.follower)
    torch.set_num_threads(1)  # the learner's compute is one core; the transfer runs beside it
    cfg = load_config(args.config, args.set).weights
    if args.world == 2:
        write_world(args, measure_world(args, cfg))
        return 0
    plan, params = make_model(model_params(**SHAPE), cfg.bucket_bytes)
    metrics = with_receivers(cfg, plan, lambda *a: measure(args, plan, params, *a))
    many_plan, many = make_model(moe_params(**MANY), cfg.bucket_bytes)
    metrics.update(
        with_receivers(cfg, many_plan, lambda *a: measure_many(args, many_plan, many, *a))
    )
    report(args, cfg, plan, many_plan, metrics)
    return 0


if __name__ == "__main__":
    sys.exit(main())
