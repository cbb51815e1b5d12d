"""The hub packs a Batch of small frames into one frame (asyncrl/protocol/codec.py), as
`replay.pack_frames_below` says; a learner decodes either the same. Real hub process, bare
DEALER peers, so the frames on the wire are seen as they arrive."""

from __future__ import annotations

from pathlib import Path

import pytest
from hub_cases import WAIT_S, HubProcess, make_group, raw_actor

from asyncrl.protocol.codec import decode, encode
from asyncrl.protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    Batch,
    Credits,
    Hello,
    SampleRequest,
    Welcome,
)


def raw_learner(hub: HubProcess) -> object:
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(hub.endpoint)
    sock.send_multipart(
        encode(
            Hello(
                role="learner",
                client_id="learner",
                protocol_version=PROTOCOL_VERSION,
                config_hash=hub.config_hash,
            )
        )
    )
    assert sock.poll(int(WAIT_S * 1000)), "no Welcome"
    assert isinstance(decode(sock.recv_multipart()), Welcome)
    return sock


@pytest.mark.parametrize(
    "pack_below, frames", [(None, 2), (0, 1 + 4 * 6)], ids=["default", "never"]
)
def test_batches_of_small_groups_come_packed(
    tmp_path: Path, hubs: list, pack_below: int | None, frames: int
) -> None:
    overrides = ["learner.groups_per_step=6"]
    if pack_below is not None:
        overrides.append(f"replay.pack_frames_below={pack_below}")
    hub = HubProcess(tmp_path, overrides)
    hubs.append(hub)
    actor, items = raw_actor(hub, "raw", True)
    sent = {}
    for seq, item in enumerate(items):
        g = make_group("raw", seq, item, 0, size=seq + 1)  # frames of different lengths
        sent[g.group_id] = g
        actor.send_multipart(encode(g))
    acked: list[int] = []
    while len(acked) < len(items):
        assert actor.poll(int(WAIT_S * 1000)), f"acked only {acked}"
        msg = decode(actor.recv_multipart())
        if isinstance(msg, Ack):
            acked += [*msg.seqs, msg.seq]
        else:
            assert isinstance(msg, Credits), msg
    learner = raw_learner(hub)
    learner.send_multipart(encode(SampleRequest(request_id=1, policy_version=0, num_groups=6)))
    assert learner.poll(int(WAIT_S * 1000)), "no Batch"
    wire = learner.recv_multipart()
    assert len(wire) == frames
    batch = decode(wire, check_values=False)
    assert isinstance(batch, Batch) and len(batch.groups) == 6
    for g in batch.groups:
        mine = sent[g.group_id]
        assert g.size == mine.size
        assert (g.tokens == mine.tokens).all() and (
            g.behavior_logprobs == mine.behavior_logprobs
        ).all()
    for sock in (actor, learner):
        sock.close()
