"""The hub as a real process for the hub's integration tests: `HubProcess` (`python -m asyncrl
replay`, ended by its pid), actor threads that honour credits and push small groups, and a
learner's helpers (sample, advance, stats, wait for a message type)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from asyncrl.config import load_config
from asyncrl.protocol.messages import (
    Batch,
    CreditItem,
    Credits,
    Group,
    Members,
    SampleRequest,
    Stats,
    StatsRequest,
    Trajectory,
    Version,
    WeightsLoaded,
)
from asyncrl.transport.connection import HubConnection

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 60.0  # generous deadlines for waiting, never asserted as speed


class HubProcess:
    """`asyncrl replay` in a subprocess; `endpoint` is read from its endpoint file."""

    def __init__(
        self, tmp_path: Path, overrides: list[str], bind: str = "tcp://127.0.0.1:0"
    ) -> None:
        self.overrides = overrides
        self.config_hash = load_config(None, overrides).config_hash()
        dataset = tmp_path / "prompts.jsonl"
        if not dataset.exists():
            rows = [{"prompt_id": f"p{i:04d}", "prompt": f"sort {i}"} for i in range(500)]
            dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
        endpoint_file = tmp_path / f"endpoint-{time.monotonic_ns()}"
        cmd = [
            sys.executable,
            "-m",
            "asyncrl",
            "replay",
            "--dataset",
            str(dataset),
            "--endpoint-file",
            str(endpoint_file),
            "--bind",
            bind,
            "--log-level",
            "WARNING",
        ]
        for item in overrides:
            cmd += ["--set", item]
        self.log = (tmp_path / "hub.log").open("ab")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + WAIT_S
        while not endpoint_file.exists():
            assert self.proc.poll() is None, (
                f"hub exited early: {(tmp_path / 'hub.log').read_text()}"
            )
            assert time.monotonic() < deadline, "hub did not start"
            time.sleep(0.02)
        self.endpoint = endpoint_file.read_text().strip()

    def connect(
        self,
        role: str,
        client_id: str,
        concurrency: int = 0,
        timeout_s: float = WAIT_S,
        **kw: object,
    ) -> HubConnection:
        conn = HubConnection(
            self.endpoint,
            role=role,
            client_id=client_id,
            config_hash=self.config_hash,
            concurrency=concurrency,
            heartbeat_interval_s=0.2,
            **kw,
        )
        conn.start(timeout_s=timeout_s)
        return conn

    def kill(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def make_group(
    actor_id: str, seq: int, item: CreditItem, policy_version: int, size: int = 2
) -> Group:
    completion = 6
    traj = Trajectory(
        tokens=np.arange(4 + completion, dtype=np.int32),
        prompt_len=4,
        loss_mask=np.ones(completion, np.uint8),
        behavior_logprobs=np.full(completion, -0.5, np.float32),
        reward=1.0,
        min_policy_version=policy_version,
        max_policy_version=policy_version,
        finish_reason="stop",
    )
    return Group.build(
        group_id=f"{actor_id}/{seq}",
        prompt_id=item.prompt_id,
        credit_id=item.credit_id,
        actor_id=actor_id,
        seq=seq,
        trajectories=[traj] * size,
    )


class ActorThread(threading.Thread):
    """Pushes one group per credit, stamped with the version of the weights it last loaded.

    `load(v)` stands in for a weight broadcast: the hub learns the version from WeightsLoaded
    and bounds this actor's credits by the window at that version.
    """

    def __init__(self, conn: HubConnection) -> None:
        super().__init__(daemon=True)
        self.conn, self.stop, self.pushed, self.credits = conn, threading.Event(), [], []
        self.hold = threading.Event()  # set: take credits but do not push
        self.version = 0

    def load(self, policy_version: int) -> None:
        self.version = policy_version
        self.conn.send(
            WeightsLoaded(actor_id=self.conn.hello.client_id, policy_version=policy_version)
        )

    def run(self) -> None:
        seq = 0
        while not self.stop.is_set():
            msg = self.conn.recv(timeout_s=0.05)
            if not isinstance(msg, Credits):
                continue
            self.credits.extend(msg.items)
            while self.hold.is_set() and not self.stop.is_set():
                time.sleep(0.01)
            for item in msg.items:
                self.conn.send(make_group(self.conn.hello.client_id, seq, item, self.version))
                self.pushed.append(f"{self.conn.hello.client_id}/{seq}")
                seq += 1


def sample(learner: HubConnection, request_id: int, policy_version: int, num_groups: int) -> Batch:
    learner.send(
        SampleRequest(request_id=request_id, policy_version=policy_version, num_groups=num_groups)
    )
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        msg = learner.recv(timeout_s=0.1)
        if isinstance(msg, Batch) and msg.request_id == request_id:
            return msg
    raise AssertionError(f"no batch for request {request_id}")


def advance(
    learner: HubConnection, policy_version: int, actors: Sequence[ActorThread] = ()
) -> Members:
    """The learner reports a new version and its weights reach `actors`."""
    learner.send(Version(policy_version=policy_version))
    members = wait_for(learner, Members)
    for actor in actors:
        actor.load(policy_version)
    return members


def stats(conn: HubConnection) -> dict:
    conn.send(StatsRequest())
    return wait_for(conn, Stats).stats


def wait_for(conn: HubConnection, kind: type) -> object:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        msg = conn.recv(timeout_s=0.1)
        if isinstance(msg, kind):
            return msg
    raise AssertionError(f"no {kind.__name__} from the hub")


def raw_actor(hub: HubProcess, client_id: str, batched_acks: bool) -> tuple[object, list]:
    """A bare DEALER that says Hello like an actor (optionally without batched acks)."""
    import zmq

    from asyncrl.protocol.codec import decode, encode
    from asyncrl.protocol.messages import PROTOCOL_VERSION, Hello, Welcome

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(hub.endpoint)
    sock.send_multipart(
        encode(
            Hello(
                role="actor",
                client_id=client_id,
                protocol_version=PROTOCOL_VERSION,
                config_hash=hub.config_hash,
                concurrency=6,
                batched_acks=batched_acks,
            )
        )
    )
    items: list = []
    while len(items) < 6:
        assert sock.poll(int(WAIT_S * 1000)), "no Welcome or Credits"
        msg = decode(sock.recv_multipart())
        assert isinstance(msg, (Welcome, Credits)), msg
        items += msg.items if isinstance(msg, Credits) else []
    return sock, items
