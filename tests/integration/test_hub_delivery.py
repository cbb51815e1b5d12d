"""At-least-once delivery through a real hub process: resends are stored once whichever
connection brings them, a restarted actor numbers on where the hub is, and batches a learner
never acknowledged come back to its next session (and only those)."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import zmq
from hub_cases import WAIT_S, ActorThread, HubProcess, advance, make_group, sample, stats

from asyncrl.protocol.codec import decode, encode
from asyncrl.protocol.messages import PROTOCOL_VERSION, Ack, BatchAck, Credits, Hello, Welcome


def hello_raw(hub: HubProcess, client_id: str, session: int) -> tuple[zmq.Socket, Welcome, list]:
    """A bare DEALER that says Hello as an actor of `session`: (socket, Welcome, credit items)."""
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
                concurrency=2,
                batched_acks=True,
                session=session,
            )
        )
    )
    welcome, items = None, []
    while welcome is None or len(items) < 2:
        assert sock.poll(int(WAIT_S * 1000)), "no Welcome or Credits"
        msg = decode(sock.recv_multipart())
        if isinstance(msg, Welcome):
            welcome = msg
        elif isinstance(msg, Credits):
            items += msg.items
    return sock, welcome, items


def acked(sock: zmq.Socket) -> list[int]:
    while True:
        assert sock.poll(int(WAIT_S * 1000)), "no Ack"
        msg: Any = decode(sock.recv_multipart())
        if isinstance(msg, Ack):
            return sorted([*msg.seqs, msg.seq])


def test_a_resend_through_another_connection_is_stored_once(tmp_path: Path, hubs: list) -> None:
    hub = HubProcess(tmp_path, ["learner.groups_per_step=4"])
    hubs.append(hub)
    first, welcome, items = hello_raw(hub, "a", session=7)
    assert welcome.next_seq == 0
    groups = [make_group("a", seq, item, 0) for seq, item in enumerate(items)]
    for group in groups:
        first.send_multipart(encode(group))
    got = acked(first)
    if len(got) < 2:
        got += acked(first)
    assert got == [0, 1]
    first.close()  # the connection drops: acks may have been lost, so the actor resends
    again, welcome, _ = hello_raw(hub, "a", session=7)
    assert welcome.next_seq == 2
    again.send_multipart(encode(groups[1]))
    assert acked(again) == [1]  # acknowledged again, not stored again
    again.close()
    restarted, welcome, items = hello_raw(hub, "a", session=8)  # a new process of actor "a"
    assert welcome.next_seq == 2  # it numbers on from here: its groups are not resends
    restarted.send_multipart(encode(make_group("a", welcome.next_seq, items[0], 0)))
    assert acked(restarted) == [2]
    restarted.close()
    learner = hub.connect("learner", "learner")
    s = stats(learner)
    assert s["groups_duplicate"] == 1 and s["groups_stored"] == 3 and s["stored"] == 3
    learner.close()


def test_unacknowledged_batches_come_back_to_the_next_learner(tmp_path: Path, hubs: list) -> None:
    hub = HubProcess(tmp_path, ["learner.groups_per_step=4", "replay.max_staleness=4"])
    hubs.append(hub)
    actor = ActorThread(hub.connect("actor", "actor-0", concurrency=8))
    actor.start()
    first = hub.connect("learner", "learner", acks_batches=True)
    trained = [g.group_id for g in sample(first, 1, 0, 4).groups]
    first.send(BatchAck(request_id=1))
    advance(first, 1, [actor])
    lost = [g.group_id for g in sample(first, 2, 1, 4).groups]  # handed out, never trained
    advance(first, 2, [actor])
    assert stats(first)["groups_lent"] == 4
    first.close()  # the learner dies before training batch 2 (resumes from version 1)
    second = hub.connect("learner", "learner", acks_batches=True)
    again = [g.group_id for g in sample(second, 1, 1, 4).groups]
    assert again == lost  # the same groups, ahead of everything newer
    second.send(BatchAck(request_id=1))
    later = [g.group_id for g in sample(second, 2, 2, 4).groups]
    assert not set(later) & set(trained + lost)
    s = stats(second)
    assert s["groups_returned"] == 4 and s["groups_duplicate"] == 0
    assert s["groups_trained"] == 8 and s["groups_lent"] == 4
    assert s["policy_version"] == 2
    actor.stop.set()
    actor.join()
    actor.conn.close()
    second.close()


def test_a_resumed_learner_takes_the_hub_back_to_its_version(tmp_path: Path, hubs: list) -> None:
    hub = HubProcess(tmp_path, ["learner.groups_per_step=2", "replay.max_staleness=1"])
    hubs.append(hub)
    actor = ActorThread(hub.connect("actor", "actor-0", concurrency=4))
    actor.start()
    first = hub.connect("learner", "learner", acks_batches=True)
    for version in range(3):
        sample(first, version + 1, version, 2)
        first.send(BatchAck(request_id=version + 1))
        advance(first, version + 1, [actor])
    assert stats(first)["policy_version"] == 3
    first.close()
    second = hub.connect("learner", "learner", acks_batches=True)  # resumed from version 1
    batch = sample(second, 1, 1, 2)
    assert batch.policy_version == 1 and stats(second)["policy_version"] == 1
    actor.stop.set()
    actor.join()
    actor.conn.close()
    second.close()


def test_a_durable_hub_killed_and_restarted_loses_and_repeats_nothing(
    tmp_path: Path, hubs: list
) -> None:
    overrides = [
        "learner.groups_per_step=4",
        "replay.max_staleness=1000",
        'replay.durability="durable"',
        f'replay.state_dir="{tmp_path / "state"}"',
        "replay.snapshot_log_bytes=20000",
    ]
    first = HubProcess(tmp_path, overrides)
    hubs.append(first)
    actor = ActorThread(first.connect("actor", "actor-0", concurrency=8))
    actor.start()
    learner = first.connect("learner", "learner", acks_batches=True)
    consumed: list[str] = []
    for version in range(6):
        consumed += [g.group_id for g in sample(learner, version + 1, version, 4).groups]
        learner.send(BatchAck(request_id=version + 1))
        advance(learner, version + 1, [actor])
    lent = [g.group_id for g in sample(learner, 7, 6, 4).groups]  # not acknowledged yet
    actor.hold.set()  # quiet, so the counts before and after can be compared
    wait_acked(actor)
    before = stats(learner)
    assert before["durability"]["snapshots"] >= 1 and before["groups_lent"] == 4
    first.kill(signal.SIGKILL)
    second = HubProcess(tmp_path, overrides, bind=first.endpoint)
    hubs.append(second)
    observer = second.connect("client", "observer")
    after = stats(observer)
    for key in (
        "stored",
        "policy_version",
        "groups_stored",
        "groups_trained",
        "groups_lent",
        "dataset_epoch",
        "credits_issued",
        "credits_outstanding",
    ):
        assert after[key] == before[key], key
    assert after["durability"]["recovered_ops"] + after["durability"]["recovered_snapshot_groups"]
    consumed += lent
    learner.send(BatchAck(request_id=7))  # trained while the hub was down; sent again on reconnect
    actor.hold.clear()
    for version in range(7, 12):  # actor and learner reconnect by themselves
        consumed += [g.group_id for g in sample(learner, version + 1, version, 4).groups]
        learner.send(BatchAck(request_id=version + 1))
        advance(learner, version + 1, [actor])
    actor.stop.set()
    actor.join()
    wait_acked(actor)
    left = stats(observer)["stored"]
    for request_id in range(13, 13 + left // 4):  # drain what is left
        consumed += [g.group_id for g in sample(learner, request_id, 12, 4).groups]
    assert len(consumed) == len(set(consumed))  # nothing handed out twice
    s = stats(observer)  # every acknowledged group was handed out once or is still stored
    assert set(consumed) <= set(actor.pushed)
    assert len(set(actor.pushed)) == len(consumed) + s["stored"] and s["stored"] < 4
    assert s["groups_duplicate"] >= 0 and s["groups_dropped_stale"] == 0
    for conn in (actor.conn, learner, observer):
        conn.close()


def wait_acked(actor: ActorThread) -> None:
    deadline = time.monotonic() + WAIT_S
    while actor.conn.unacked() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert actor.conn.unacked() == 0
