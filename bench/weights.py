"""Weight broadcast: bucketed vs one broadcast per tensor vs one flat tensor, and the learner stall.

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
~68 M parameters. Writes bench/results/weights.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgpack
import torch
import torch.multiprocessing as mp
from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore

from asyncrl.config import load_config
from asyncrl.weights.backends import GlooGroup
from asyncrl.weights.bucket_plan import (
    BucketPlan,
    allocate_buckets,
    allocate_staging,
    staged_buckets,
)
from asyncrl.weights.publisher import WeightPublisher
from asyncrl.weights.receiver import WeightReceiver

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_common import environment, spread  # noqa: E402
from weights_models import MANY, SHAPE, model_params, moe_params  # noqa: E402

ACTORS = ("actor-1", "actor-2")
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
    seen = set()
    while len(seen) < len(ACTORS):
        kind, rank, v = results.get(timeout=timeout_s)
        if kind == "got" and v == policy_version:
            seen.add(rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.toml"))
    parser.add_argument("--set", action="append", default=[], help="section.key=value (weights.*)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--step-s", type=float, default=0.6, help="target length of a learner step")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "weights.json"))
    parser.add_argument(
        "--world",
        type=int,
        default=1,
        choices=(1, 2),
        help="2: publication from a 2-rank FSDP2 learner vs 1 rank (bench/weights_world.py)",
    )
    args = parser.parse_args()
    if args.world == 2:
        from weights_world import main as world_main

        rest = [a for a in sys.argv[1:] if a not in ("--world", "2")]
        sys.exit(world_main(rest))
    cfg = load_config(args.config, args.set).weights
    torch.set_num_threads(1)  # the learner's compute is one core; the transfer runs beside it

    plan, params = make_model(model_params(**SHAPE), cfg.bucket_bytes)
    metrics = with_receivers(cfg, plan, lambda *a: measure(args, plan, params, *a))
    many_plan, many = make_model(moe_params(**MANY), cfg.bucket_bytes)
    metrics.update(
        with_receivers(cfg, many_plan, lambda *a: measure_many(args, many_plan, many, *a))
    )
    report(args, cfg, plan, many_plan, metrics)


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
    times: dict[str, list[float]] = {"many_per_tensor": [], "many_bucketed": []}
    for rep in range(args.warmup + args.reps):
        for name in ("per_tensor", "bucketed"):
            command(name)
            t0 = time.perf_counter()
            run_variant(
                name, raw_pg, group, None, per_tensor, staged_buckets(plan, params, staging)
            )
            if rep >= args.warmup:
                times[f"many_{name}"].append(time.perf_counter() - t0)
        print(
            f"many tensors, rep {rep}: "
            + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items() if v)
        )
    return times


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
    flat = torch.ones(plan.total_bytes, dtype=torch.uint8)
    per_tensor = [params[n] for n, _, _ in plan.params()]
    staging = allocate_staging(plan)
    times: dict[str, list[float]] = {k: [] for k in ("flat", "per_tensor", "bucketed", "publish")}
    version = 0
    for rep in range(args.warmup + args.reps):
        for name in ("flat", "per_tensor", "bucketed"):
            command(name)
            t0 = time.perf_counter()
            buckets = staged_buckets(plan, params, staging)
            run_variant(name, raw_pg, group, flat, per_tensor, buckets)
            if rep >= args.warmup:
                times[name].append(time.perf_counter() - t0)
        version += 1
        t0 = time.perf_counter()
        publisher.publish(version, params.items(), ACTORS)
        wait_got(results, version, publisher.timeout_s * 4)
        assert publisher.wait(publisher.timeout_s) and publisher.last_result.ok, (
            publisher.last_result
        )
        if rep >= args.warmup:
            times["publish"].append(time.perf_counter() - t0)
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items() if v))

    step, n = calibrate_step(args.step_s)
    print(f"learner step: {n} matmuls of 1024x1024")
    times.update(step_alone=[], step_with_publish=[], snapshot=[])
    for rep in range(args.warmup + args.reps):
        t0 = time.perf_counter()
        step()
        alone = time.perf_counter() - t0
        version += 1
        t0 = time.perf_counter()
        publisher.publish(version, params.items(), ACTORS)
        step()
        with_pub = time.perf_counter() - t0
        wait_got(results, version, publisher.timeout_s * 4)
        assert publisher.wait(publisher.timeout_s) and publisher.last_result.ok, (
            publisher.last_result
        )
        if rep >= args.warmup:
            times["step_alone"].append(alone)
            times["step_with_publish"].append(with_pub)
            times["snapshot"].append(publisher.last_result.snapshot_s)
        print(f"rep {rep}: step alone {alone:.3f}s, with publication {with_pub:.3f}s")
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
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
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
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
