"""Soak: actors push as fast as the hub lets them against a slow learner; hub memory stays
bounded and nothing is dropped silently.

```
  actor threads ×A  (HubConnection, one group per credit, 256 KB groups, no generation time)
        │  Group ─────> hub process (volatile or durable; capacity_groups, η large, so only
        │  <── Ack        capacity and credits hold the actors back)
  learner thread ──SampleRequest──> Batch ──sleep(--learner-step-s)──> BatchAck, Version
  this process samples the hub's RSS (/proc/<pid>/status) every second
```

Reports RSS over time (first and second half max: bounded = the second half is not above the
first by more than one batch of groups), and the delivery count: every group pushed was
acknowledged, and each is consumed, dropped as stale (counted), or still held by the hub.

    python bench/soak.py [--duration-s 120] [--actors 4] [--durability volatile]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from asyncrl.config import load_config
from asyncrl.protocol.messages import (
    Batch,
    BatchAck,
    Credits,
    SampleRequest,
    Stats,
    StatsRequest,
    Version,
)
from asyncrl.transport.connection import HubConnection
from bench.common import REPO, RESULTS, command_line, environment, spread, write_json
from bench.transport import make_group


def start_hub(tmp: Path, overrides: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    dataset = tmp / "prompts.jsonl"
    dataset.write_text(
        "".join(json.dumps({"prompt_id": f"p{i}", "prompt": "x"}) + "\n" for i in range(1000))
    )
    endpoint_file = tmp / "endpoint"
    cmd = [
        sys.executable,
        "-m",
        "asyncrl",
        "replay",
        "--dataset",
        str(dataset),
        "--endpoint-file",
        str(endpoint_file),
        "--log-level",
        "WARNING",
    ]
    for item in overrides:
        cmd += ["--set", item]
    proc = subprocess.Popen(cmd, cwd=REPO)
    while not endpoint_file.exists():
        assert proc.poll() is None, "hub exited"
        time.sleep(0.05)
    return proc, endpoint_file.read_text().strip()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def actor(conn: HubConnection, group_bytes: int, stop: threading.Event, pushed: list) -> None:
    base = make_group(group_bytes)
    seq = 0
    while not stop.is_set():
        msg = conn.recv(timeout_s=0.1)
        if not isinstance(msg, Credits):
            continue
        for item in msg.items:
            seq = conn.next_seq(seq)
            conn.send(
                dataclasses.replace(
                    base,
                    actor_id=conn.hello.client_id,
                    seq=seq,
                    credit_id=item.credit_id,
                    prompt_id=item.prompt_id,
                )
            )
            pushed.append(seq)
            seq += 1


def learner(
    conn: HubConnection, batch: int, step_s: float, stop: threading.Event, consumed: list
) -> None:
    version, request_id = 0, 0
    while not stop.is_set():
        request_id += 1
        conn.send(SampleRequest(request_id=request_id, policy_version=version, num_groups=batch))
        while not stop.is_set():
            msg = conn.recv(timeout_s=0.1)
            if isinstance(msg, Batch) and msg.request_id == request_id:
                consumed.extend((g.actor_id, g.seq) for g in msg.groups)
                time.sleep(step_s)  # the slow learner
                conn.send(BatchAck(request_id=request_id))
                version += 1
                conn.send(Version(policy_version=version))
                break


def hub_stats(conn: HubConnection) -> dict[str, Any]:
    conn.send(StatsRequest())
    while True:
        msg = conn.recv(timeout_s=30)
        if isinstance(msg, Stats):
            return msg.stats
        assert msg is not None, "no Stats"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=120.0)
    p.add_argument("--actors", type=int, default=4)
    p.add_argument("--group-bytes", type=int, default=256 * 1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--learner-step-s", type=float, default=0.5)
    p.add_argument("--capacity", type=int, default=256)
    p.add_argument("--durability", choices=("volatile", "durable"), default="volatile")
    p.add_argument("--out", default=str(RESULTS / "soak.json"))
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-soak-"))
    overrides = [
        f"learner.groups_per_step={args.batch}",
        "replay.max_staleness=1000000",
        f"replay.capacity_groups={args.capacity}",
        "replay.heartbeat_interval_s=0.5",
        f'replay.durability="{args.durability}"',
        f'replay.state_dir="{tmp / "state"}"',
    ]
    cfg_hash = load_config(None, overrides).config_hash()
    hub, endpoint = start_hub(tmp, overrides)
    stop = threading.Event()
    pushed: list[list[int]] = [[] for _ in range(args.actors)]
    consumed: list[tuple[str, int]] = []
    conns = [
        HubConnection(
            endpoint,
            role="actor",
            client_id=f"soak-{i}",
            config_hash=cfg_hash,
            concurrency=16,
            heartbeat_interval_s=0.5,
        )
        for i in range(args.actors)
    ]
    lconn = HubConnection(
        endpoint,
        role="learner",
        client_id="learner",
        config_hash=cfg_hash,
        heartbeat_interval_s=0.5,
        acks_batches=True,
    )
    threads = [
        threading.Thread(target=actor, args=(c, args.group_bytes, stop, pushed[i]))
        for i, c in enumerate(conns)
    ]
    threads.append(
        threading.Thread(
            target=learner, args=(lconn, args.batch, args.learner_step_s, stop, consumed)
        )
    )
    for conn in [*conns, lconn]:
        conn.start()
    for t in threads:
        t.start()
    rss: list[list[float]] = []
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < args.duration_s:
        rss.append([round(elapsed, 1), round(rss_mib(hub.pid), 1)])
        time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join()
    deadline = time.monotonic() + 60
    while any(c.unacked() for c in conns) and time.monotonic() < deadline:
        time.sleep(0.1)
    unacked = sum(c.unacked() for c in conns)
    observer = HubConnection(endpoint, role="client", client_id="observer", config_hash=cfg_hash)
    observer.start()
    s = hub_stats(observer)
    for conn in [*conns, lconn, observer]:
        conn.close()
    hub.terminate()
    hub.wait()
    half = len(rss) // 2
    first, second = max(r for _, r in rss[:half]), max(r for _, r in rss[half:])
    total_pushed = sum(map(len, pushed))
    held = s["stored"] + s["groups_lent"]
    result = {
        "benchmark": "soak",
        "command": command_line(__file__, argv),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        **environment(),
        "pushed": total_pushed,
        "unacked_at_end": unacked,
        "consumed": len(consumed),
        "consumed_distinct": len(set(consumed)),
        "hub_held_at_end": held,
        "dropped_stale": s["groups_dropped_stale"],
        "capacity_refusals": s["errors"].get("capacity", 0),
        "resends_deduplicated": s["groups_duplicate"],
        "unaccounted": total_pushed - len(set(consumed)) - held - s["groups_dropped_stale"],
        "hub_rss_mib": spread([r for _, r in rss]),
        "hub_rss_first_half_max_mib": first,
        "hub_rss_second_half_max_mib": second,
        "bounded": second <= first + args.batch * args.group_bytes / 2**20 + 16,
        "rss_curve": {"columns": ["time_s", "rss_mib"], "rows": rss},
    }
    write_json(args.out, result)
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "pushed",
                    "consumed",
                    "hub_held_at_end",
                    "unaccounted",
                    "hub_rss_first_half_max_mib",
                    "hub_rss_second_half_max_mib",
                    "bounded",
                )
            }
        )
    )
    return 0 if result["unaccounted"] == 0 and result["bounded"] and not unacked else 1


if __name__ == "__main__":
    sys.exit(main())
