"""The hub as a real process (`python -m asyncrl replay`) with real client sockets on loopback.

Actors here are threads with their own `HubConnection` that honour credits and push small
groups; the learner is a `HubConnection` that samples and reports versions. Every process a
test starts is ended by its pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hub_cases import (
    REPO,
    WAIT_S,
    ActorThread,
    HubProcess,
    advance,
    make_group,
    raw_actor,
    sample,
    stats,
)

from asyncrl.protocol.messages import CreditItem, Credits


def test_groups_from_several_actors_are_consumed_exactly_once(tmp_path: Path, hubs: list) -> None:
    hub = HubProcess(tmp_path, ["learner.groups_per_step=20", "replay.max_staleness=2"])
    hubs.append(hub)
    actors = [ActorThread(hub.connect("actor", f"actor-{i}", concurrency=8)) for i in range(4)]
    learner = hub.connect("learner", "learner")
    for actor in actors:
        actor.start()
    consumed: list[str] = []
    version = 0
    while len(consumed) < 1000:
        batch = sample(learner, version, version, 20)
        assert len(batch.groups) == 20
        assert all(version - g.min_policy_version <= 2 for g in batch.groups)
        consumed += [g.group_id for g in batch.groups]
        version += 1
        advance(learner, version, actors)
    for actor in actors:
        actor.stop.set()
        actor.join()
    assert len(consumed) == len(set(consumed)) == 1000
    pushed = {gid for actor in actors for gid in actor.pushed}
    assert set(consumed) <= pushed
    for actor in actors:  # every pushed group was acked: stored once, consumed or dropped
        deadline = time.monotonic() + WAIT_S
        while actor.conn.unacked() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert actor.conn.unacked() == 0
    s = stats(learner)
    assert s["groups_duplicate"] == 0 and s["groups_consumed"] == 1000
    # every group received is consumed, dropped as stale (on arrival or later), or still stored
    assert s["groups_received"] == s["groups_consumed"] + s["groups_dropped_stale"] + s["stored"]
    assert s["prompts_reissued"] == s["groups_dropped_stale"]  # each dropped prompt goes again
    assert s["groups_received"] == len(pushed)
    for conn in [a.conn for a in actors] + [learner]:
        conn.close()


def test_eta_zero_is_synchronous(tmp_path: Path, hubs: list) -> None:
    hub = HubProcess(tmp_path, ["learner.groups_per_step=4", "replay.max_staleness=0"])
    hubs.append(hub)
    actors = [ActorThread(hub.connect("actor", f"actor-{i}", concurrency=8)) for i in range(2)]
    learner = hub.connect("learner", "learner")
    for actor in actors:
        actor.start()
    for version in range(5):
        batch = sample(learner, version, version, 4)
        assert [g.min_policy_version for g in batch.groups] == [version] * 4
        s = stats(learner)  # one step's groups at a time: nothing more issued until Version
        assert s["credits_issued"] == 4 * (version + 1)
        assert s["credits_outstanding"] == 0 and s["stored"] == 0
        advance(learner, version + 1, actors)
    assert stats(learner)["groups_dropped_stale"] == 0
    forged = CreditItem(credit_id=12345, prompt_id="p0000", prompt="", seed=0)
    with pytest.raises(ValueError, match="credit_id"):  # clients never send without a credit
        actors[0].conn.send(make_group("actor-0", 999, forged, 5))
    for actor in actors:
        actor.stop.set()
        actor.join()
        actor.conn.close()
    learner.close()


def test_the_hub_runs_the_io_threads_it_is_given(tmp_path: Path, hubs: list) -> None:
    hub = HubProcess(tmp_path, ["learner.groups_per_step=4", "replay.io_threads=3"])
    hubs.append(hub)
    actors = [ActorThread(hub.connect("actor", f"actor-{i}", concurrency=8)) for i in range(2)]
    learner = hub.connect("learner", "learner")
    for actor in actors:
        actor.start()
    consumed = [g.group_id for v in range(3) for g in sample(learner, v, v, 4).groups]
    assert len(set(consumed)) == 12  # connections spread over the threads: nothing lost
    tasks = Path(f"/proc/{hub.proc.pid}/task").iterdir()
    io = [t for t in tasks if (t / "comm").read_text().startswith("ZMQbg/IO/")]
    assert len(io) == 3
    for actor in actors:
        actor.stop.set()
        actor.join()
        actor.conn.close()
    learner.close()


DEAD_ACTOR = """
import sys, time
from asyncrl.protocol.messages import Credits
from asyncrl.transport.connection import HubConnection
conn = HubConnection(sys.argv[1], role="actor", client_id="doomed", config_hash=sys.argv[2],
                     concurrency=4, heartbeat_interval_s=0.2)
conn.start()
items = []
while len(items) < 4:
    msg = conn.recv(timeout_s=30)
    if isinstance(msg, Credits):
        items += msg.items
print(" ".join(item.prompt_id for item in items), flush=True)
time.sleep(3600)
"""


def test_dead_actor_credits_are_reissued(tmp_path: Path, hubs: list) -> None:
    overrides = [
        "learner.groups_per_step=4",
        "replay.max_staleness=0",
        "replay.heartbeat_interval_s=0.2",
        "replay.heartbeat_timeout_s=3.0",
    ]
    hub = HubProcess(tmp_path, overrides)
    hubs.append(hub)
    doomed = subprocess.Popen(
        [sys.executable, "-c", DEAD_ACTOR, hub.endpoint, hub.config_hash],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        taken = doomed.stdout.readline().split()
        assert len(taken) == 4  # the whole η = 0 window
        survivor = ActorThread(hub.connect("actor", "survivor", concurrency=4))
        survivor.start()
        os.kill(doomed.pid, signal.SIGKILL)  # dies without Bye: only silence tells the hub
        doomed.wait()
        learner = hub.connect("learner", "learner")
        batch = sample(learner, 0, 0, 4)
        assert sorted(g.prompt_id for g in batch.groups) == sorted(taken)
        assert {g.actor_id for g in batch.groups} == {"survivor"}
        s = stats(learner)
        assert s["credits_expired"] == 4 and s["clients"]["doomed"]["alive"] is False
        survivor.stop.set()
        survivor.join()
        survivor.conn.close()
        learner.close()
    finally:
        if doomed.poll() is None:
            os.kill(doomed.pid, signal.SIGKILL)
            doomed.wait()


def test_client_keeps_working_across_a_hub_restart(tmp_path: Path, hubs: list) -> None:
    overrides = ["learner.groups_per_step=4", "replay.max_staleness=1"]
    first = HubProcess(tmp_path, overrides)
    hubs.append(first)
    actor = ActorThread(first.connect("actor", "actor-0", concurrency=4))
    learner = first.connect("learner", "learner")
    actor.start()
    consumed = [g.group_id for g in sample(learner, 0, 0, 4).groups]
    advance(learner, 1, [actor])
    actor.hold.set()  # credits of the old hub arrive but their groups are pushed later
    deadline = time.monotonic() + WAIT_S
    while actor.conn.credits_held() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    first.kill(signal.SIGKILL)  # no goodbye: stored groups and credits die with it
    second = HubProcess(tmp_path, overrides, bind=first.endpoint)
    hubs.append(second)
    actor.hold.clear()  # groups for the old hub's credits now go to the new hub
    for request_id in range(1, 6):
        batch = sample(learner, request_id, request_id, 4)
        consumed += [g.group_id for g in batch.groups]
        advance(learner, request_id + 1, [actor])
    assert len(consumed) == len(set(consumed))
    s = stats(learner)
    assert s["policy_version"] == 6  # learned from the learner after the restart
    assert s["groups_adopted"] >= 1  # groups for the old hub's credits were kept, not lost
    actor.stop.set()
    actor.join()
    actor.conn.close()
    learner.close()


def test_curve_auth_admits_only_allowed_keys(tmp_path: Path, hubs: list) -> None:
    keys, strangers = tmp_path / "keys", tmp_path / "strangers"
    for directory in (keys, strangers):
        subprocess.run(
            [sys.executable, "-m", "asyncrl", "keygen", str(directory), "--clients", "2"],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
    impostor = tmp_path / "impostor"  # knows the hub's public key, holds a key not on the list
    (impostor / "clients").mkdir(parents=True)
    (impostor / "server.key").write_bytes((keys / "server.key").read_bytes())
    for name in ("client-0.key", "client-0.key_secret"):
        (impostor / "clients" / name).write_bytes((strangers / "clients" / name).read_bytes())
    hub = HubProcess(tmp_path, [f"replay.auth_dir={json.dumps(str(keys))}"])
    hubs.append(hub)
    allowed = hub.connect("learner", "learner", auth_dir=str(keys))
    assert stats(allowed)["policy_version"] == 0
    with pytest.raises(ConnectionError):
        hub.connect("actor", "impostor", concurrency=4, timeout_s=2.0, auth_dir=str(impostor))
    s = stats(allowed)
    assert "impostor" not in s["clients"] and s["credits_issued"] == 0
    allowed.close()


def test_binding_beyond_loopback_needs_auth(tmp_path: Path) -> None:
    import zmq

    from asyncrl.config import ReplayConfig
    from asyncrl.transport.sockets import bind_router

    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match=r"replay.bind / --bind"):
            bind_router(ctx, "tcp://0.0.0.0:0", ReplayConfig())
        sock, endpoint = bind_router(ctx, "tcp://0.0.0.0:0", ReplayConfig(), allow_insecure=True)
        assert endpoint.startswith("tcp://0.0.0.0:") and not endpoint.endswith(":0")
        sock.close(linger=0)
        sock, endpoint = bind_router(ctx, f"ipc://{tmp_path}/hub.sock", ReplayConfig())
        assert endpoint == f"ipc://{tmp_path}/hub.sock"
        sock.close(linger=0)
    finally:
        ctx.term()


def test_acks_cover_every_group_batched_only_when_asked(tmp_path: Path, hubs: list) -> None:
    from asyncrl.protocol.codec import decode, encode
    from asyncrl.protocol.messages import Ack

    hub = HubProcess(tmp_path, ["learner.groups_per_step=8"])  # credits for both actors
    hubs.append(hub)
    for batched in (False, True):
        sock, items = raw_actor(hub, f"raw-{batched}", batched)
        for seq, item in enumerate(items):  # back to back: the hub may drain them as one burst
            sock.send_multipart(encode(make_group(f"raw-{batched}", seq, item, 0)))
        acked: list[int] = []
        while len(acked) < len(items):
            assert sock.poll(int(WAIT_S * 1000)), f"acked only {acked}"
            ack = decode(sock.recv_multipart())
            if isinstance(ack, Credits):  # refills for the spent credits
                continue
            assert isinstance(ack, Ack), ack
            assert batched or not ack.seqs  # one Ack per group for a client that did not ask
            acked += [*ack.seqs, ack.seq]
        assert sorted(acked) == list(range(len(items)))
        sock.close()
    learner = hub.connect("learner", "learner")
    assert stats(learner)["groups_stored"] == 12
    learner.close()


def test_burst_acks_are_one_message_per_batched_client() -> None:
    from asyncrl.protocol.messages import Ack, Hello
    from replay.clients import Client

    hello = Hello(
        role="actor", client_id="a", protocol_version=1, config_hash="h", batched_acks=True
    )
    client = Client.from_hello(b"a", hello, now=0.0)
    client.owed += [(1, 11), (2, 12), (3, 13)]
    assert client.take_acks() == [Ack(seq=3, credit_id=13, seqs=[1, 2])] and not client.owed
    client.batched_acks = False
    client.owed += [(4, 14), (5, 15)]
    assert client.take_acks() == [Ack(seq=4, credit_id=14), Ack(seq=5, credit_id=15)]


def test_transport_tunes_malloc_safely() -> None:
    from asyncrl.transport import sockets

    assert sockets.keep_freed_buffers() in (True, False)  # False where libc is not glibc


def test_a_burst_is_handled_a_turn_at_a_time(tmp_path: Path) -> None:
    """A learner waiting for a batch gets it in the turn its groups arrive in, not after the
    rest of the burst behind them; a turn takes at most `turn_messages` messages."""
    import zmq

    from asyncrl.config import load_config
    from asyncrl.protocol.codec import decode, encode
    from asyncrl.protocol.messages import PROTOCOL_VERSION, Hello, SampleRequest, Welcome
    from replay.server import Hub, turn_messages

    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(
        "".join(json.dumps({"prompt_id": f"p{i}", "prompt": "x"}) + "\n" for i in range(99))
    )
    cfg = load_config(None, ["learner.groups_per_step=8", "replay.max_staleness=1000"])
    hub = Hub(cfg, dataset, bind="tcp://127.0.0.1:0")
    ctx = zmq.Context()
    peers = {}
    try:
        for role, concurrency in (("learner", 0), ("actor", 64)):
            sock = peers[role] = ctx.socket(zmq.DEALER)
            sock.connect(hub.endpoint)
            sock.send_multipart(
                encode(
                    Hello(
                        role=role,
                        client_id=role,
                        protocol_version=PROTOCOL_VERSION,
                        config_hash=hub.config_hash,
                        concurrency=concurrency,
                    )
                )
            )
        items: list = []
        deadline = time.monotonic() + WAIT_S
        while len(items) < 64:  # the actor's Welcome and credits
            assert time.monotonic() < deadline, f"{len(items)} credits"
            hub.turn()
            while peers["actor"].poll(10):
                msg = decode(peers["actor"].recv_multipart())
                items += [] if isinstance(msg, Welcome) else msg.items
        assert peers["learner"].poll(int(WAIT_S * 1000))
        assert isinstance(decode(peers["learner"].recv_multipart()), Welcome)
        peers["learner"].send_multipart(
            encode(SampleRequest(request_id=1, policy_version=0, num_groups=8))
        )
        while not hub.parked:  # the request waits at the hub before any group comes
            hub.turn()
        for seq, item in enumerate(items):  # one burst of 64 groups
            peers["actor"].send_multipart(encode(make_group("actor", seq, item, 0)))
        turn = turn_messages(8, 2)
        assert turn == 16
        while hub.counters["groups_consumed"] == 0:  # turns until the batch is handed out
            assert time.monotonic() < deadline, "no batch"
            before = hub.counters["groups_received"]
            hub.turn()
            assert hub.counters["groups_received"] - before <= turn
        assert hub.counters["groups_received"] < len(items)  # the rest of the burst waits
        assert peers["learner"].poll(int(WAIT_S * 1000))
        assert len(decode(peers["learner"].recv_multipart()).groups) == 8
    finally:
        for sock in peers.values():
            sock.close(linger=0)
        ctx.term()
        hub.close()


def test_credits_are_topped_up_a_quarter_window_at_a_time(tmp_path: Path) -> None:
    """An actor with a window of 16 gets no Credits after each group, only once 4 slots are
    free (`refill_at`), and then all of them; a window of 3 is refilled after every group."""
    import zmq

    from asyncrl.config import load_config
    from asyncrl.protocol.codec import decode, encode
    from asyncrl.protocol.messages import PROTOCOL_VERSION, Hello
    from replay.core import refill_at
    from replay.server import Hub

    assert [refill_at(w) for w in (1, 3, 4, 16, 512)] == [1, 1, 1, 4, 128]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(
        "".join(json.dumps({"prompt_id": f"p{i}", "prompt": "x"}) + "\n" for i in range(99))
    )
    cfg = load_config(None, ["learner.groups_per_step=8", "replay.max_staleness=1000"])
    hub = Hub(cfg, dataset, bind="tcp://127.0.0.1:0")
    ctx = zmq.Context()
    socks = []
    try:
        for name, window in (("wide", 16), ("narrow", 3)):
            sock = ctx.socket(zmq.DEALER)
            sock.connect(hub.endpoint)
            sock.send_multipart(
                encode(
                    Hello(
                        role="actor",
                        client_id=name,
                        protocol_version=PROTOCOL_VERSION,
                        config_hash=hub.config_hash,
                        concurrency=window,
                    )
                )
            )
            socks.append(sock)

        def credits_after_turns(sock: zmq.Socket, turns: int = 5) -> list:
            items = []
            for _ in range(turns):
                hub.turn()
                while sock.poll(20):
                    msg = decode(sock.recv_multipart())
                    items += msg.items if isinstance(msg, Credits) else []
            return items

        for sock, window, name in zip(socks, (16, 3), ("wide", "narrow"), strict=True):
            held = credits_after_turns(sock)
            assert len(held) == window  # the whole window at first
            refill, seq = {16: 4, 3: 1}[window], 0
            for spent in range(1, refill + 1):
                item = held.pop(0)
                sock.send_multipart(encode(make_group(name, seq, item, 0)))
                seq += 1
                got = credits_after_turns(sock)
                if spent < refill:
                    assert got == [], f"{name}: topped up after {spent} group(s)"
                else:
                    assert len(got) == spent, f"{name}: {len(got)} credits for {spent} free slots"
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
        hub.close()
