"""The peers of bench/transport.py, each run in a process of its own: the group every variant
moves, the hub's settings for it, an actor pushing groups with credits, a raw PUSH sender and
a `zmq.proxy` relay. bench/hub_path.py and bench/zmq_framing.py move the same group."""

from __future__ import annotations

import gc
import time
from typing import Any

import numpy as np
import zmq

from asyncrl.protocol.codec import encode
from asyncrl.protocol.group_codec import new_message
from asyncrl.protocol.messages import Credits, Group, Trajectory
from asyncrl.transport.connection import HubConnection
from asyncrl.transport.sockets import keep_freed_buffers

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
    keep_freed_buffers()  # as the hub: it too holds received messages until they are sent on
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(front)
    push.connect(back)
    zmq.proxy(pull, push)
