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
               a batch into one frame (asyncrl/frame_packing.py) buys (`packed_over_unpacked_*`).
- `raw`:       a PUSH process sends the same frames (encoded header + three array buffers) to a
               PULL socket in this process: one hop, no validation. `ratio` = hub / raw.
- `raw_relay`: the same through a `zmq.proxy` forwarder process: two hops at C speed, the
               ceiling for any two-hop hub (reported as `ratio_vs_relay`).

Every process that receives is set up as the hub sets itself up: `keep_freed_buffers()` (here,
for learner and raw receiver alike, and in the relay), so received buffers are recycled rather
than page-faulted in afresh (asyncrl/transport.py); `gc.freeze()` after start-up here and in
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
Writes bench/results/transport.json.

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
from pathlib import Path
from typing import Any

import zmq

from asyncrl.config import load_config
from asyncrl.protocol.messages import Batch, SampleRequest, Stats, StatsRequest
from asyncrl.transport.connection import HubConnection
from asyncrl.transport.sockets import keep_freed_buffers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_common import (  # noqa: E402
    cpu_ticks,
    disk_fsync_mbps,
    environment,
    proc_cpu_s,
    spread,
    steal_pct,
)
from transport_peers import (  # noqa: E402
    PROMPT_TOKENS,
    SAMPLES,
    SIZES,
    actor_main,
    make_group,
    overrides_for,
    raw_push_main,
    relay_main,
)
from transport_report import durable_vs_volatile, packing_ab, targets  # noqa: E402

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


# --- setup, report --------------------------------------------------------------------------


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
    proc = subprocess.Popen(cmd, cwd=ROOT)
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
    times: dict[str, list[float]] = {
        name: [] for name in VARIANTS + EXTRA_VARIANTS if name in args.variants.split(",")
    }
    cpus: dict[str, list[float]] = {name: [] for name in times}
    loads: list[float] = []  # 1-minute load average after each measured repetition
    steals: list[float] = []  # % of the machine's CPU time the host took back, per repetition
    # the raw variants' CPU us per group by process, per repetition (the hubs keep theirs)
    raw_parts: dict[str, list[dict[str, float]]] = {n: [] for n in times if n not in hubs}
    try:
        for rep in range(args.reps + 1):  # rep 0 warms up
            for name in times:
                ticks = cpu_ticks()
                if name in hubs:
                    hub = hubs[name]
                    elapsed, cpu_s = run_hub(hub, hub["learner"], actual, count, batch, f"{rep}")
                else:
                    elapsed, cpu_s = run_raw(actual, count, name == "raw_relay", raw_parts[name])
                steal = steal_pct(ticks, cpu_ticks())
                if rep:
                    times[name].append(elapsed)
                    cpus[name].append(cpu_s / count * 1e6)
                    loads.append(os.getloadavg()[0])
                    steals.append(steal)
                parts = (hubs[name]["cpu_parts"] if name in hubs else raw_parts[name])[-1]
                print(
                    f"  {actual:>8} B  rep {rep}  {name:<9} {count / elapsed:>9.0f} groups/s  "
                    f"{count * actual / elapsed / 1e9:6.2f} GB/s  {cpu_s / count * 1e6:7.1f} CPU us/group "
                    f"load {os.getloadavg()[0]:4.2f} steal {steal:4.1f}% "
                    + " ".join(f"{k}={v:.0f}" for k, v in parts.items()),
                    flush=True,
                )
        logs = durability(hubs["hub_durable"]["learner"]) if "hub_durable" in hubs else {}
    finally:
        for hub in hubs.values():
            hub["learner"].close()
            hub["proc"].terminate()
            hub["proc"].wait()
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
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "transport.json"))
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
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
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
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for r in results:
        if r.get("partial"):
            continue
        print(
            f"{r['group_bytes']:>8} B: hub {r['hub_groups_per_s']:8.0f} groups/s {r['hub_gbps']:6.2f} GB/s | "
            f"raw {r['raw_gbps']:6.2f} GB/s | relay {r['raw_relay_gbps']:6.2f} GB/s | ratio {r['ratio']:.2f} | vs relay {r['ratio_vs_relay']:.2f} | durable/volatile {r['durable_over_volatile']:.2f}"
        )


if __name__ == "__main__":
    main()
