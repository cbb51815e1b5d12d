"""Transport: groups through the real hub vs raw pyzmq PUSH/PULL moving the same bytes.

For groups of about 32 KB, 256 KB and 2 MB, interleaved repetition by repetition so machine
noise hits every variant alike:

- `hub`:       an actor process pushes groups with credits (`HubConnection`) into a real hub
               process (`python -m asyncrl replay`); this process samples them as the learner
               (`SampleRequest` -> `Batch`, `learner_in_flight` requests in flight: as many batches
               as make the 64 MB the actor keeps in flight, at least 4) and decodes every batch.
               Two hops, acks and credits included; the hub validates every group in full,
               the learner checks structure and sizes (the hub scanned the values already).
- `hub_durable`: the same with `replay.durability = "durable"` (write-ahead log in a temporary
               directory, fsync per group commit): `durable_over_volatile` = hub_durable / hub.
- `hub_unpacked` (only when named in `--variants`): the hub with `replay.pack_frames_below=0`,
               every batch as four frames per group; run beside `hub` it measures what packing
               a batch into one frame (asyncrl/protocol/codec.py) buys (`packed_over_unpacked_*`).
- `raw`:       a PUSH process sends the same frames (encoded header + three array buffers) to a
               PULL socket in this process: one hop, no validation. `ratio` = hub / raw.
- `raw_relay`: the same through a `zmq.proxy` forwarder process: two hops at C speed, the
               ceiling for any two-hop hub (reported as `ratio_vs_relay`).

Every process that receives is set up as the hub sets itself up: `keep_freed_buffers()` (here,
for learner and raw receiver alike, and in the relay), so received buffers are recycled rather
than page-faulted in afresh (asyncrl/transport/sockets.py); `gc.freeze()` after start-up here and in
the actor.

Each variant moves `--bytes-per-rep` bytes per repetition after one warm-up repetition; the
clock runs in this process from "go" to the last group received. Besides wall-clock rates, each
variant reports the CPU time all its processes spent per group (user + system, ZeroMQ I/O
threads and kernel included): on a shared machine that is the steadier number. It is split by
process: actor, hub (hub_loop: its main thread), learner; sender, relay, receiver.
`cpu_busy_share` is that CPU time over the wall time of all the machine's CPUs: near 1, a
variant is bound by CPU time, not by one hop, and `relay_cpu_over_hub_cpu` is then the
`ratio_vs_relay` that CPU time alone predicts (median of the per-repetition ratios;
`relay_cpu_over_hub_cpu_stats` gives their spread). The
load average is recorded with every repetition, and so is the share of CPU time the host took
from this virtual machine (steal).
Writes bench/results/transport.json. The group every variant moves (`make_group`) and the
hub's settings for it (`overrides_for`) are bench/hub_path.py's, bench/zmq_framing.py's and
bench/soak.py's too.

    python bench/transport.py [--reps 5] [--bytes-per-rep 268435456] [--sizes 32768,...]
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from asyncrl.config import load_config
from asyncrl.protocol.codec import encode
from asyncrl.protocol.group_codec import new_message
from asyncrl.protocol.messages import (
    Batch,
    Credits,
    Group,
    SampleRequest,
    Stats,
    StatsRequest,
    Trajectory,
)
from asyncrl.transport.connection import HubConnection
from asyncrl.transport.sockets import keep_freed_buffers
from bench.common import (
    REPO,
    RESULTS,
    command_line,
    cpu_ticks,
    disk_fsync_mbps,
    environment,
    interleave,
    proc_cpu_s,
    spread,
    steal_pct,
    write_json,
)

# --- the group every variant moves, and the peers (each in a process of its own) ----------

SIZES = (32 * 1024, 256 * 1024, 2 * 1024 * 1024)
SAMPLES, PROMPT_TOKENS = 8, 64


def make_group(target_bytes: int) -> Group:
    """A group of SAMPLES trajectories whose arrays total about `target_bytes`."""
    length = max(PROMPT_TOKENS + 1, (target_bytes // SAMPLES + 5 * PROMPT_TOKENS) // 9)
    rng = np.random.default_rng(0)
    trajs = [
        Trajectory(
            tokens=rng.integers(0, 32000, length, dtype=np.int32),
            prompt_len=PROMPT_TOKENS,
            loss_mask=np.ones(length - PROMPT_TOKENS, np.uint8),
            behavior_logprobs=-rng.random(length - PROMPT_TOKENS, dtype=np.float32),
            reward=1.0,
            min_policy_version=0,
            max_policy_version=0,
            finish_reason="length",
        )
        for _ in range(SAMPLES)
    ]
    return Group.build(
        group_id="g", prompt_id="p", credit_id=0, actor_id="bench", seq=0, trajectories=trajs
    )


def overrides_for(group_bytes: int, batch: int) -> list[str]:
    """The hub's settings for groups of `group_bytes` served `batch` at a time: room for
    512 MB of them (at least four batches), η out of reach."""
    capacity = max(4 * batch, min(4096, (512 << 20) // group_bytes))
    return [
        f"learner.groups_per_step={batch}",
        "replay.max_staleness=1000000000",
        f"replay.capacity_groups={capacity}",
        f"replay.max_message_bytes={max(256 << 20, 4 * batch * group_bytes)}",
    ]


def actor_main(
    endpoint: str,
    config_hash: str,
    group_bytes: int,
    concurrency: int,
    count: int,
    client_id: str,
    ready: Any,
    go: Any,
    cpu: Any,
) -> None:
    """Push `count` groups, one per credit, as fast as credits come."""
    # each group is the template under its credit and seq; built without the dataclass
    # __init__ (dataclasses.replace): what an actor spends making groups is not measured here
    fields = {**make_group(group_bytes).__dict__, "actor_id": client_id}
    conn = HubConnection(
        endpoint,
        role="actor",
        client_id=client_id,
        config_hash=config_hash,
        concurrency=concurrency,
    )
    conn.start()
    gc.freeze()  # as the hub does: long-lived objects out of the collector's way
    ready.set()
    go.wait()
    cpu_start = time.process_time()
    seq = 0
    while seq < count:
        msg = conn.recv(timeout_s=10)
        assert msg is not None, "no credits for 10 s"
        if isinstance(msg, Credits):
            for item in msg.items[: count - seq]:
                conn.send(
                    new_message(
                        Group,
                        {
                            **fields,
                            "credit_id": item.credit_id,
                            "prompt_id": item.prompt_id,
                            "seq": seq,
                        },
                    )
                )
                seq += 1
    while conn.unacked():
        time.sleep(0.001)
    cpu.put(time.process_time() - cpu_start)
    conn.close()


def raw_push_main(
    endpoint: str, group_bytes: int, count: int, bind: bool, ready: Any, go: Any, cpu: Any
) -> None:
    """Send the frames of `count` groups (same header bytes and arrays the hub path moves)."""
    frames = [
        bytes(memoryview(f)) if i == 0 else f for i, f in enumerate(encode(make_group(group_bytes)))
    ]
    push_frames(endpoint, frames, count, bind, ready, go, cpu)


def push_frames(
    endpoint: str, frames: list[Any], count: int, bind: bool, ready: Any, go: Any, cpu: Any
) -> None:
    """Send `frames` as one message `count` times through a PUSH socket, once `go` is set; put
    the CPU seconds this process spent on `cpu` (ZeroMQ's I/O thread included)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 10000)
    sock.bind(endpoint) if bind else sock.connect(endpoint)
    ready.set()
    go.wait()
    cpu_start = time.process_time()
    for _ in range(count):
        sock.send_multipart(frames, copy=False)
    sock.close(linger=-1)
    ctx.term()  # returns once ZeroMQ's I/O thread has sent everything: its CPU time counts too
    cpu.put(time.process_time() - cpu_start)


def relay_main(front: str, back: str) -> None:
    """Forward `front` to `back` through `zmq.proxy`: two hops at C speed."""
    keep_freed_buffers()  # as the hub: it too holds received messages until they are sent on
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(front)
    push.connect(back)
    zmq.proxy(pull, push)


VARIANTS = ("hub", "hub_durable", "raw", "raw_relay")
EXTRA_VARIANTS = ("hub_unpacked",)  # only when asked for: `--variants hub,hub_unpacked`
ACTOR_IN_FLIGHT_BYTES = 64 << 20  # groups the actor keeps in flight
LEARNER_IN_FLIGHT_BYTES = 64 << 20  # batches the learner keeps requested (hides commit latency)


def learner_in_flight(group_bytes: int, batch: int, fixed: int = 0) -> int:
    """Sample requests the learner keeps outstanding (`fixed`, or as many batches as make
    LEARNER_IN_FLIGHT_BYTES, what the actor keeps in flight, and at least 4): 32 at 32 KB, 16
    at 256 KB, 8 at 2 MB. A durable hub sends a batch only once the log before it is on disk,
    so the learner must keep enough requested to cover that wait. Against a fixed 4, in three
    alternating runs each (bench/results/transport_in_flight.json): durable / volatile at
    256 KB 0.75 against 0.73 (medians; the three runs at 64 MB spread 0.68-0.88, wider
    than that), volatile at 32 KB 16,700 against 15,900 groups/s, durable at 32 KB 11,200 against
    9,900."""
    return fixed or max(4, LEARNER_IN_FLIGHT_BYTES // (batch * group_bytes))


# --- one repetition of each variant: (wall seconds, CPU seconds of every process involved) --


def run_hub(
    hub: dict[str, Any], learner: HubConnection, group_bytes: int, count: int, batch: int, rep: str
) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    ready, go, cpu = ctx.Event(), ctx.Event(), ctx.Queue()
    concurrency = max(2 * batch, min(512, ACTOR_IN_FLIGHT_BYTES // group_bytes))
    depth = hub["learner_in_flight"]
    proc = ctx.Process(
        target=actor_main,
        args=(
            hub["endpoint"],
            hub["hash"],
            group_bytes,
            concurrency,
            count,
            f"actor-{rep}",
            ready,
            go,
            cpu,
        ),
    )
    proc.start()
    assert ready.wait(120), "actor did not start"
    time.sleep(0.2)  # its first credits arrive before the clock starts
    hub_cpu, own_cpu = proc_cpu_s(hub["pid"]), time.process_time()
    loop_cpu = proc_cpu_s(hub["pid"], str(hub["pid"]))  # the hub's main thread: its Python loop
    start = time.perf_counter()
    go.set()
    received, request_id, in_flight = 0, hub["request_id"], 0
    while received < count:
        while in_flight < depth and received + in_flight * batch < count:
            request_id += 1
            learner.send(SampleRequest(request_id=request_id, policy_version=0, num_groups=batch))
            in_flight += 1
        msg = learner.recv(timeout_s=60)
        assert msg is not None, "no batch for 60 s"
        if isinstance(msg, Batch):
            received += len(msg.groups)
            in_flight -= 1
    elapsed = time.perf_counter() - start
    parts = {
        "hub": proc_cpu_s(hub["pid"]) - hub_cpu,
        "learner": time.process_time() - own_cpu,
        "actor": cpu.get(timeout=120),
    }
    loop = proc_cpu_s(hub["pid"], str(hub["pid"])) - loop_cpu
    cpu_s = sum(parts.values())
    parts["hub_loop"] = loop  # part of "hub": the rest is ZeroMQ's I/O thread (and fsyncs)
    hub.setdefault("cpu_parts", []).append({k: v / count * 1e6 for k, v in parts.items()})
    hub["request_id"] = request_id
    proc.join()
    return elapsed, cpu_s


def run_raw(
    group_bytes: int, count: int, relay: bool, cpu_parts: list[dict[str, float]]
) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    zctx = zmq.Context()
    pull = zctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 10000)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    target, helper = f"tcp://127.0.0.1:{port}", None
    if relay:
        probe = zctx.socket(zmq.PULL)  # only to pick a free port for the relay's front
        front = f"tcp://127.0.0.1:{probe.bind_to_random_port('tcp://127.0.0.1')}"
        probe.close(linger=0)
        helper = ctx.Process(target=relay_main, args=(front, target), daemon=True)
        helper.start()
        target = front
    ready, go, cpu = ctx.Event(), ctx.Event(), ctx.Queue()
    sender = ctx.Process(
        target=raw_push_main, args=(target, group_bytes, count, relay, ready, go, cpu)
    )
    sender.start()
    assert ready.wait(120), "sender did not start"
    time.sleep(0.2)
    relay_cpu = proc_cpu_s(helper.pid) if helper else 0.0
    own_cpu = time.process_time()
    start = time.perf_counter()
    go.set()
    for _ in range(count):
        pull.recv_multipart(copy=False)
    elapsed = time.perf_counter() - start
    parts = {"sender": cpu.get(timeout=120), "receiver": time.process_time() - own_cpu}
    if helper is not None:
        parts["relay"] = proc_cpu_s(helper.pid) - relay_cpu
        helper.kill()
        helper.join()
    sender.join()
    pull.close(linger=0)
    zctx.term()
    cpu_parts.append({k: v / count * 1e6 for k, v in parts.items()})
    return elapsed, sum(parts.values())


# --- the hubs ------------------------------------------------------------------------------


DURABLE = ['replay.durability="durable"', 'replay.state_dir="STATE"', 'replay.fsync="commit"']
UNPACKED = ["replay.pack_frames_below=0"]  # batches as four frames per group, never one


def durability(learner: HubConnection) -> dict[str, Any]:
    """A durable hub's log figures: how many of its bytes went to disk from the frames' own
    memory (placed) and how many through the staging buffer (replay/direct_io.py)."""
    learner.send(StatsRequest())
    while (msg := learner.recv(timeout_s=30)) is not None:
        if isinstance(msg, Stats):
            log = msg.stats["durability"]
            placed, copied = log.get("log_bytes_placed", 0), log.get("log_bytes_copied", 0)
            return {"hub_durable_log": {**log, "placed_share": placed / max(1, placed + copied)}}
    raise AssertionError("no Stats from the durable hub for 30 s")


def start_hub(tmp: Path, overrides: list[str], profile: str = "") -> tuple[subprocess.Popen, str]:
    dataset = tmp / "prompts.jsonl"
    dataset.write_text(
        "".join(json.dumps({"prompt_id": f"p{i}", "prompt": "x"}) + "\n" for i in range(1000))
    )
    endpoint_file = tmp / "endpoint"
    endpoint_file.unlink(missing_ok=True)
    prof = ["-m", "cProfile", "-o", profile] if profile else []
    cmd = [
        sys.executable,
        *prof,
        "-m",
        "asyncrl",
        "replay",
        "--dataset",
        str(dataset),
        "--endpoint-file",
        str(endpoint_file),
        "--log-level",
        "WARNING",
    ] + [a for o in overrides for a in ("--set", o)]
    proc = subprocess.Popen(cmd, cwd=REPO)
    while not endpoint_file.exists():
        assert proc.poll() is None, "hub exited"
        time.sleep(0.05)
    return proc, endpoint_file.read_text().strip()


def bench_size(group_bytes: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    group = make_group(group_bytes)
    actual = group.nbytes
    count = max(args.min_groups, args.bytes_per_rep // actual)
    batch = 64 if actual < 100_000 else 16 if actual < 1_000_000 else 4
    count -= count % batch
    overrides = overrides_for(actual, batch) + args.hub_set
    depth = learner_in_flight(actual, batch, args.learner_in_flight)
    hubs = {}
    for name, extra in (("hub", []), ("hub_durable", DURABLE), ("hub_unpacked", UNPACKED)):
        if name not in args.variants.split(","):
            continue
        state_dir = tmp / f"state-{actual}"
        extra = [x.replace("STATE", str(state_dir)) for x in extra]
        profile = f"{args.profile_hub}.{name}.{actual}" if args.profile_hub else ""
        proc, endpoint = start_hub(tmp, overrides + extra, profile)
        hub = {
            "endpoint": endpoint,
            "hash": load_config(None, overrides).config_hash(),
            "request_id": 0,
            "pid": proc.pid,
            "proc": proc,
            "learner_in_flight": depth,
        }
        hub["learner"] = HubConnection(
            endpoint, role="learner", client_id="learner", config_hash=hub["hash"]
        )
        hub["learner"].start()
        hubs[name] = hub
    names = [name for name in VARIANTS + EXTRA_VARIANTS if name in args.variants.split(",")]
    # the raw variants' CPU us per group by process, per repetition (the hubs keep theirs)
    raw_parts: dict[str, list[dict[str, float]]] = {n: [] for n in names if n not in hubs}

    def variant(name: str) -> Callable[[int], dict[str, float]]:
        def one(rep: int) -> dict[str, float]:
            ticks = cpu_ticks()
            if name in hubs:
                hub = hubs[name]
                elapsed, cpu_s = run_hub(hub, hub["learner"], actual, count, batch, f"{rep}")
            else:
                elapsed, cpu_s = run_raw(actual, count, name == "raw_relay", raw_parts[name])
            steal = steal_pct(ticks, cpu_ticks())
            load = os.getloadavg()[0]
            parts = (hubs[name]["cpu_parts"] if name in hubs else raw_parts[name])[-1]
            print(
                f"  {actual:>8} B  rep {rep}  {name:<9} {count / elapsed:>9.0f} groups/s  "
                f"{count * actual / elapsed / 1e9:6.2f} GB/s  {cpu_s / count * 1e6:7.1f} CPU us/group "
                f"load {load:4.2f} steal {steal:4.1f}% "
                + " ".join(f"{k}={v:.0f}" for k, v in parts.items()),
                flush=True,
            )
            return {"elapsed": elapsed, "cpu_us": cpu_s / count * 1e6, "steal": steal, "load": load}

        return one

    try:  # one warm-up repetition of every variant, then --reps
        reps = interleave({name: variant(name) for name in names}, reps=args.reps, warmup=1)
        logs = durability(hubs["hub_durable"]["learner"]) if "hub_durable" in hubs else {}
    finally:
        for hub in hubs.values():
            hub["learner"].close()
            hub["proc"].terminate()
            hub["proc"].wait()
    times = {name: [r["elapsed"] for r in rs] for name, rs in reps.items()}
    cpus = {name: [r["cpu_us"] for r in rs] for name, rs in reps.items()}
    loads = [r["load"] for rs in reps.values() for r in rs]  # 1-minute, after each repetition
    steals = [r["steal"] for rs in reps.values() for r in rs]  # % the host took, per repetition
    packing = packing_ab(times, cpus, hubs, count) if {"hub", "hub_unpacked"} <= set(times) else {}
    if set(times) - set(EXTRA_VARIANTS) != set(VARIANTS) or not args.reps:
        durable_ab = (
            durable_vs_volatile(times, count) if {"hub", "hub_durable"} <= set(times) else {}
        )
        return {
            "group_bytes": actual,
            "partial": True,
            "learner_in_flight": depth,
            **packing,
            **durable_ab,
            **logs,
        }  # not a full result
    gps = {k: [count / t for t in v] for k, v in times.items()}
    gbps = {k: [count * actual / t / 1e9 for t in v] for k, v in times.items()}
    ratios = [h / r for h, r in zip(gbps["hub"], gbps["raw"], strict=True)]
    relay_ratios = [h / r for h, r in zip(gbps["hub"], gbps["raw_relay"], strict=True)]
    disk = disk_fsync_mbps(tmp)
    cpu_ratios = [r / h for h, r in zip(cpus["hub"], cpus["raw_relay"], strict=True)]
    return {
        "group_bytes": actual,
        "groups_per_rep": count,
        "batch_groups": batch,
        "learner_in_flight": depth,
        "hub_groups_per_s": statistics.median(gps["hub"]),
        "hub_gbps": statistics.median(gbps["hub"]),
        "raw_gbps": statistics.median(gbps["raw"]),
        "raw_relay_gbps": statistics.median(gbps["raw_relay"]),
        "ratio": statistics.median(ratios),
        "ratio_vs_relay": statistics.median(relay_ratios),
        **durable_vs_volatile(times, count),
        **logs,
        "disk_fsync_mbps": disk,
        "durable_ceiling_over_volatile": disk / 1e3 / statistics.median(gbps["hub"]),
        "hub_groups_per_s_stats": spread(gps["hub"]),
        "hub_gbps_stats": spread(gbps["hub"]),
        "raw_gbps_stats": spread(gbps["raw"]),
        "raw_relay_gbps_stats": spread(gbps["raw_relay"]),
        "ratio_stats": spread(ratios),
        "ratio_vs_relay_stats": spread(relay_ratios),
        "loadavg_1min": spread(loads),
        "steal_pct": spread(steals),
        "hub_overrides": overrides,
        "cpu_us_per_group": {name: spread(v) for name, v in cpus.items()},
        "cpu_busy_share": {
            name: spread(
                [
                    c * count / 1e6 / t / (os.cpu_count() or 1)
                    for c, t in zip(cpus[name], times[name], strict=True)
                ]
            )
            for name in cpus
        },
        **{
            f"{name}_cpu_us_per_group_by_process": {
                k: spread([p[k] for p in hubs[name]["cpu_parts"][1:]])
                for k in ("actor", "hub", "hub_loop", "learner")
            }
            for name in ("hub", "hub_durable")
        },
        **{
            f"{name}_cpu_us_per_group_by_process": {
                k: spread([p[k] for p in raw_parts[name][1:]]) for k in raw_parts[name][0]
            }
            for name in ("raw", "raw_relay")
        },
        # the ratio CPU time alone predicts (both variants near cpu_busy_share 1): relay / hub
        "relay_cpu_over_hub_cpu": statistics.median(cpu_ratios),
        "relay_cpu_over_hub_cpu_stats": spread(cpu_ratios),
    }


# --- what is reported beside the per-size figures ------------------------------------------


def durable_vs_volatile(times: dict[str, list[float]], count: int) -> dict[str, Any]:
    """`hub_durable` against `hub`, repetition by repetition (a run of just those two)."""
    if not times["hub"]:
        return {}
    ratio = [h / d for h, d in zip(times["hub"], times["hub_durable"], strict=True)]
    return {
        "durable_over_volatile": statistics.median(ratio),
        "durable_over_volatile_stats": spread(ratio),
        "hub_groups_per_s": statistics.median(count / t for t in times["hub"]),
        "hub_durable_groups_per_s": statistics.median(count / t for t in times["hub_durable"]),
    }


def packing_ab(
    times: dict[str, list[float]], cpus: dict[str, list[float]], hubs: dict[str, Any], count: int
) -> dict[str, Any]:
    """`hub` (batches packed as `replay.pack_frames_below` says) against `hub_unpacked` (never),
    repetition by repetition: throughput and CPU time per group, by process."""
    if not times["hub"]:
        return {}
    speed = [u / p for p, u in zip(times["hub"], times["hub_unpacked"], strict=True)]
    cpu = [p / u for p, u in zip(cpus["hub"], cpus["hub_unpacked"], strict=True)]
    return {
        "packed_over_unpacked_groups_per_s": spread(speed),
        "packed_over_unpacked_cpu": spread(cpu),
        "packed_groups_per_s": statistics.median(count / t for t in times["hub"]),
        "unpacked_groups_per_s": statistics.median(count / t for t in times["hub_unpacked"]),
        **{
            f"{name}_cpu_us_per_group_by_process": {
                k: spread([p[k] for p in hubs[name]["cpu_parts"][1:]])
                for k in ("actor", "hub", "hub_loop", "learner")
            }
            for name in ("hub", "hub_unpacked")
        },
    }


TARGETS = {"ratio_vs_relay": 0.8, "hub_groups_per_s_32k": 10_000, "durable_over_volatile_256k": 0.7}


def targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The goals of this benchmark (medians against them): hub >= 0.8x the two-hop relay at
    every size, >= 10,000 groups/s at 32 KB, durable >= 0.7x volatile at 256 KB."""
    done = [r for r in results if not r.get("partial")]
    near = (
        {
            size: min(done, key=lambda r: abs(r["group_bytes"] - size))
            for size in (32 << 10, 256 << 10)
        }
        if done
        else {}
    )
    met: dict[str, bool] = {
        f"ratio_vs_relay_{r['group_bytes']}": r["ratio_vs_relay"] >= TARGETS["ratio_vs_relay"]
        for r in done
    }
    if near:
        met["hub_groups_per_s_32k"] = (
            near[32 << 10]["hub_groups_per_s"] >= TARGETS["hub_groups_per_s_32k"]
        )
        met["durable_over_volatile_256k"] = (
            near[256 << 10]["durable_over_volatile"] >= TARGETS["durable_over_volatile_256k"]
        )
    return {"goals": TARGETS, "met": met}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5, help="measured repetitions (after one warm-up)")
    p.add_argument(
        "--bytes-per-rep", type=int, default=256 << 20, help="bytes moved per repetition"
    )
    p.add_argument(
        "--min-groups", type=int, default=256, help="at least this many groups per repetition"
    )
    p.add_argument(
        "--sizes", default=",".join(map(str, SIZES)), help="approximate group sizes in bytes"
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"subset to run (profiling), or more: {', '.join(EXTRA_VARIANTS)}",
    )
    p.add_argument(
        "--learner-in-flight",
        type=int,
        default=0,
        help="sample requests the learner keeps out (0: 64 MB worth, at least 4)",
    )
    p.add_argument(
        "--hub-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting for every hub variant (e.g. replay.io_threads=1)",
    )
    p.add_argument("--profile-hub", default="", help="cProfile the hubs into PATH.<variant>.<size>")
    p.add_argument("--out", default=str(RESULTS / "transport.json"))
    args = p.parse_args()
    keep_freed_buffers()  # as the hub does: this process is the learner and the raw receiver
    gc.freeze()
    env = environment(
        ("zmq", "msgpack", "numpy")
    )  # before the run: its load average is the one at the start
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-transport-") as tmp:  # TMPDIR or /tmp
        results = [bench_size(int(s), args, Path(tmp)) for s in args.sizes.split(",")]
    out = {
        "benchmark": "transport",
        "command": command_line(__file__),
        "config": {
            "reps": args.reps,
            "bytes_per_rep": args.bytes_per_rep,
            "samples_per_group": SAMPLES,
            "prompt_tokens": PROMPT_TOKENS,
            "transport": "tcp loopback",
        },
        **env,
        "results": results,
    }
    out["targets"] = targets(results)
    write_json(args.out, out)
    for r in results:
        if r.get("partial"):
            continue
        print(
            f"{r['group_bytes']:>8} B: hub {r['hub_groups_per_s']:8.0f} groups/s {r['hub_gbps']:6.2f} GB/s | "
            f"raw {r['raw_gbps']:6.2f} GB/s | relay {r['raw_relay_gbps']:6.2f} GB/s | ratio {r['ratio']:.2f} | vs relay {r['ratio_vs_relay']:.2f} | durable/volatile {r['durable_over_volatile']:.2f}"
        )


if __name__ == "__main__":
    main()
