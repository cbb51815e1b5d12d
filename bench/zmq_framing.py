"""ZeroMQ's own cost per group by framing: what a change of the Group wire layout would buy.

The same group bytes go from a PUSH process to a PULL socket in this process (TCP loopback, no
Python work but the sends and receives), laid out four ways, interleaved repetition by
repetition so machine noise hits every layout alike:

- `frames_4`:   what `encode` writes today: the header, then tokens, loss_mask and
                behavior_logprobs, one frame each;
- `frames_2`:   the header, then the three arrays in one frame;
- `frames_1`:   header and arrays in a single frame;
- `groups_8`:   `frames_4` for 8 groups in one multipart message (several groups per message).

For each, the CPU time per group of the sender and of the receiver (every thread of the
process: ZeroMQ's I/O thread and the kernel's work on its behalf included) and the groups per
second. ZeroMQ's I/O thread writes a message frame by frame through an 8 KB batch buffer,
handing a frame over whole (one `send` call) when it starts with the buffer empty and is larger
than it, so the number of system calls per group, and with them the sender's CPU, follows the
framing; several groups per message change nothing of that. The two-hop raw relay of
bench/transport.py sends what `encode` writes, so a layout change moves it as much as the hub
path. Writes bench/results/zmq_framing.json.

    python bench/zmq_framing.py [--reps 5] [--sizes 32768,262144,2097152]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from typing import Any

import zmq

from asyncrl.protocol.codec import encode
from bench.common import RESULTS, command_line, environment, interleave, spread, write_json
from bench.transport import SIZES, make_group, push_frames

LAYOUTS = ("frames_4", "frames_2", "frames_1", "groups_8")
GROUPS_PER_MESSAGE = 8


def message(layout: str, group_bytes: int) -> tuple[list[bytes], int]:
    """(the frames of one message, groups it carries) for `layout`."""
    frames = [bytes(memoryview(f)) for f in encode(make_group(group_bytes))]
    if layout == "frames_2":
        return [frames[0], b"".join(frames[1:])], 1
    if layout == "frames_1":
        return [b"".join(frames)], 1
    if layout == "groups_8":
        return frames * GROUPS_PER_MESSAGE, GROUPS_PER_MESSAGE
    return frames, 1


def sender_main(
    endpoint: str, layout: str, group_bytes: int, messages: int, ready: Any, go: Any, cpu: Any
) -> None:
    push_frames(endpoint, message(layout, group_bytes)[0], messages, False, ready, go, cpu)


def run(layout: str, group_bytes: int, groups: int) -> dict[str, float]:
    """One repetition: sender and receiver CPU microseconds per group, groups per second."""
    per_message = message(layout, group_bytes)[1]
    messages = groups // per_message
    zctx = zmq.Context()
    pull = zctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 10000)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    ctx = mp.get_context("spawn")
    ready, go, cpu = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(
        target=sender_main,
        args=(f"tcp://127.0.0.1:{port}", layout, group_bytes, messages, ready, go, cpu),
    )
    proc.start()
    try:
        assert ready.wait(120), "sender did not start"
        time.sleep(0.2)  # connected before the clock starts
        own = time.process_time()
        start = time.perf_counter()
        go.set()
        for _ in range(messages):
            pull.recv_multipart(copy=False)
        elapsed = time.perf_counter() - start
        receiver = time.process_time() - own
        sender = cpu.get(timeout=120)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        pull.close(linger=0)
        zctx.term()
    n = messages * per_message
    return {
        "sender_cpu_us_per_group": sender / n * 1e6,
        "receiver_cpu_us_per_group": receiver / n * 1e6,
        "groups_per_s": n / elapsed,
    }


def bench_size(group_bytes: int, reps: int, bytes_per_rep: int) -> dict[str, Any]:
    actual = make_group(group_bytes).nbytes
    groups = max(256, bytes_per_rep // actual)
    groups -= groups % GROUPS_PER_MESSAGE

    def variant(layout: str) -> Callable[[int], dict[str, float]]:
        def one(rep: int) -> dict[str, float]:
            r = run(layout, group_bytes, groups)
            print(
                f"  {actual:>8} B  rep {rep}  {layout:<8}  sender {r['sender_cpu_us_per_group']:7.1f}"
                f"  receiver {r['receiver_cpu_us_per_group']:7.1f} CPU us/group"
                f"  {r['groups_per_s']:8.0f} groups/s",
                flush=True,
            )
            return r

        return one

    # one warm-up repetition, then the layouts in turn, repetition by repetition
    runs = interleave({layout: variant(layout) for layout in LAYOUTS}, reps=reps, warmup=1)
    layouts = {
        layout: {key: spread([r[key] for r in rs]) for key in rs[0]} for layout, rs in runs.items()
    }
    base = runs["frames_4"]

    def over_base(layout: str, key: str) -> float:  # per repetition, side by side
        return statistics.median(r[key] / b[key] for r, b in zip(runs[layout], base, strict=True))

    return {
        "group_bytes": actual,
        "groups_per_rep": groups,
        "layouts": layouts,
        "sender_cpu_over_frames_4": {k: over_base(k, "sender_cpu_us_per_group") for k in LAYOUTS},
        "receiver_cpu_over_frames_4": {
            k: over_base(k, "receiver_cpu_us_per_group") for k in LAYOUTS
        },
        "groups_per_s_over_frames_4": {k: over_base(k, "groups_per_s") for k in LAYOUTS},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5, help="measured repetitions (after one warm-up)")
    p.add_argument("--bytes-per-rep", type=int, default=256 << 20, help="bytes per repetition")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="approximate group bytes")
    p.add_argument("--out", default=str(RESULTS / "zmq_framing.json"))
    args = p.parse_args()
    env = environment(("zmq",))
    results = [bench_size(int(s), args.reps, args.bytes_per_rep) for s in args.sizes.split(",")]
    write_json(
        args.out,
        {
            "benchmark": "zmq_framing",
            "command": command_line(__file__),
            "config": {
                "reps": args.reps,
                "bytes_per_rep": args.bytes_per_rep,
                "groups_per_message": GROUPS_PER_MESSAGE,
                "transport": "tcp loopback",
            },
            **env,
            "results": results,
        },
    )
    for r in results:
        s, g = r["sender_cpu_over_frames_4"], r["groups_per_s_over_frames_4"]
        print(
            f"{r['group_bytes']:>8} B: sender CPU vs frames_4: "
            + " ".join(f"{k} {s[k]:.2f}" for k in LAYOUTS[1:])
            + " | groups/s vs frames_4: "
            + " ".join(f"{k} {g[k]:.2f}" for k in LAYOUTS[1:])
        )


if __name__ == "__main__":
    main()
