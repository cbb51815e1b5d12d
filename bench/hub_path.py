"""Hub path, stage by stage: the CPU each group costs in the Python code of every hop.

bench/transport.py times the whole path (actor -> hub -> learner over TCP) against raw ZeroMQ;
this benchmark splits the Python side of it into stages and times each one alone, in one
process, without sockets in the way (the hub's sends go to a peer that is not connected):

    actor                 hub (one loop)                                    learner
    encode  --frames-->   handle: decode + validate, dedup, store, ack ...
                          serve: sample a batch, encode it, send    --->    decode (trusted)

- `actor_encode`: `encode(group)`, the actor's side of a push;
- `hub_decode_warm` / `hub_decode_cold`: `decode` of one received group (full validation:
  types, structure, array values), the same message again (cache-warm) or a different one each
  time (cache-cold, as groups arrive);
- `hub_handle`: `Hub.handle` of a group from a registered actor (decode, dedup, credit, store,
  ack owed): what the hub's loop spends per group received;
- `hub_serve`: a `SampleRequest` answered: sampling, encoding the `Batch`, sending it;
- `learner_decode`: `decode(batch, check_values=False)` per group, as `HubConnection` does.

Each figure is thread CPU time per group, the minimum over `--reps` runs (the least disturbed
by other work on the machine). Writes bench/results/hub_path.json.

    python bench/hub_path.py [--reps 9] [--sizes 32768,262144,2097152]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from asyncrl.config import load_config
from asyncrl.protocol.codec import decode, encode
from asyncrl.protocol.group_codec import new_message
from asyncrl.protocol.messages import PROTOCOL_VERSION, Batch, Group, Hello, SampleRequest
from bench.common import RESULTS, command_line, environment, repeat, timed, write_json
from bench.transport import make_group, overrides_for
from replay.server import Hub

BATCH = 64


def received(msg: Any) -> list[zmq.Frame]:
    """The frames of `msg` as a receiver holds them (one zmq.Frame each, own memory)."""
    return [zmq.Frame(bytes(memoryview(f))) for f in encode(msg)]


def per_group(run: Callable[[], object], groups: int, reps: int) -> float:
    """Least thread CPU microseconds per group of `run()` (which handles `groups` groups)."""
    return timed(run, reps=reps, warmup=0, clock=time.thread_time).min / groups * 1e6


def codec_stages(group: Group, count: int, reps: int) -> dict[str, float]:
    frames = received(group)
    cold = [received(group) for _ in range(count)]
    batch = Batch(request_id=1, policy_version=0, groups=(decode(frames),) * BATCH)
    batch_frames = received(batch)
    return {
        "actor_encode": per_group(lambda: [encode(group) for _ in range(count)], count, reps),
        "hub_decode_warm": per_group(lambda: [decode(frames) for _ in range(count)], count, reps),
        "hub_decode_cold": per_group(lambda: [decode(f) for f in cold], count, reps),
        "learner_decode": per_group(
            lambda: decode(batch_frames, 1 << 40, check_values=False), BATCH, reps
        ),
    }


def hub_stages(group: Group, count: int, reps: int, tmp: Path) -> dict[str, float]:
    """`Hub.handle` per group pushed, then per group served, on a hub with no peers."""
    dataset = tmp / "prompts.jsonl"
    dataset.write_text(
        "".join(json.dumps({"prompt_id": f"p{i}", "prompt": "x"}) + "\n" for i in range(1000))
    )
    cfg = load_config(None, overrides_for(group.nbytes, BATCH) + ["replay.capacity_groups=100000"])
    hub = Hub(cfg, dataset, bind="tcp://127.0.0.1:0")
    try:
        hub.handle(
            b"A",
            received(
                Hello(
                    role="actor",
                    client_id="a",
                    protocol_version=PROTOCOL_VERSION,
                    config_hash=hub.config_hash,
                    concurrency=1 << 30,
                    batched_acks=True,
                    session=5,
                )
            ),
        )
        hub.handle(
            b"L",
            received(
                Hello(
                    role="learner",
                    client_id="l",
                    protocol_version=PROTOCOL_VERSION,
                    config_hash=hub.config_hash,
                )
            ),
        )
        count -= count % BATCH
        seq = request_id = 0

        def one(_rep: int) -> tuple[float, float]:
            """CPU microseconds per group of handling the pushes, then of serving them."""
            nonlocal seq, request_id
            pushes = []
            for item in hub.state.issue(b"A", count):
                fields = {
                    **group.__dict__,
                    "credit_id": item.credit_id,
                    "prompt_id": item.prompt_id,
                    "actor_id": "a",
                    "seq": seq,
                }
                pushes.append(received(new_message(Group, fields)))
                seq += 1
            requests = []
            for _ in range(count // BATCH):
                request_id += 1
                requests.append(
                    received(
                        SampleRequest(request_id=request_id, policy_version=0, num_groups=BATCH)
                    )
                )
            start = time.thread_time()
            for frames in pushes:
                hub.handle(b"A", frames)
            hub.clients.acks_due()
            middle = time.thread_time()
            for frames in requests:
                hub.handle(b"L", frames)
                hub.serve_parked()
            end = time.thread_time()
            assert not hub.errors and len(hub.buffer) == 0, (hub.errors, len(hub.buffer))
            return (middle - start) / count * 1e6, (end - middle) / count * 1e6

        handle, serve = zip(*repeat(one, reps=reps, warmup=0), strict=True)
        return {"hub_handle": min(handle), "hub_serve": min(serve)}
    finally:
        hub.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=9, help="runs per stage (the least is kept)")
    p.add_argument("--sizes", default="32768,262144,2097152", help="approximate group bytes")
    p.add_argument("--bytes-per-run", type=int, default=64 << 20, help="group bytes per run")
    p.add_argument("--out", default=str(RESULTS / "hub_path.json"))
    args = p.parse_args()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)  # as the hub sets itself up (replay/server.py)
    env = environment(("zmq", "msgpack", "numpy"))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in map(int, args.sizes.split(",")):
            group = make_group(size)
            count = max(BATCH, min(2048, args.bytes_per_run // group.nbytes))
            stages = codec_stages(group, count, args.reps)
            stages.update(hub_stages(group, count, args.reps, Path(tmp)))
            results.append(
                {"group_bytes": group.nbytes, "groups_per_run": count, "cpu_us_per_group": stages}
            )
            print(
                f"{group.nbytes:>8} B: " + "  ".join(f"{k} {v:.1f}" for k, v in stages.items()),
                flush=True,
            )
    command = command_line(__file__)
    write_json(
        args.out,
        {
            "benchmark": "hub_path",
            "command": command,
            "config": {
                "reps": args.reps,
                "batch_groups": BATCH,
                "bytes_per_run": args.bytes_per_run,
            },
            **env,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
