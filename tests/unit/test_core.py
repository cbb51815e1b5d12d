"""replay/core.py: the hub's decisions as functions of its state, the message and the time.

No sockets and no clock here: every case builds a `HubCore`, hands it messages as the server
would, and checks what it answers (credits, batches) and what its state became.
"""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.config import RunConfig, load_config
from asyncrl.prompt_records import Prompt
from asyncrl.protocol import codec
from asyncrl.protocol.codec import decode, encode
from asyncrl.protocol.messages import (
    CreditItem,
    Credits,
    Group,
    ProtocolError,
    SampleRequest,
    Trajectory,
)
from replay.core import HubCore, refill_at, weights_floor
from replay.prompts import PromptSource

A, L = b"actor-a", b"learner"


def config(*overrides: str) -> RunConfig:
    return load_config(None, ["learner.groups_per_step=2", "actor.group_size=2", *overrides])


def make_core(cfg: RunConfig, num_prompts: int = 50) -> HubCore:
    prompts = PromptSource([Prompt(f"p{i}", f"sort {i}") for i in range(num_prompts)], seed=1)
    return HubCore(cfg, prompts, incarnation=3)


def group_for(item: CreditItem, seq: int, version: int, actor_id: str = "a") -> Group:
    traj = Trajectory(
        tokens=np.arange(4, dtype=np.int32),
        prompt_len=2,
        loss_mask=np.ones(2, np.uint8),
        behavior_logprobs=np.full(2, -0.5, np.float32),
        reward=1.0,
        min_policy_version=version,
        max_policy_version=version,
        finish_reason="stop",
    )
    return Group.build(
        group_id=f"{actor_id}/{seq}",
        prompt_id=item.prompt_id,
        credit_id=item.credit_id,
        actor_id=actor_id,
        seq=seq,
        trajectories=[traj, traj],
    )


def granted(core: HubCore) -> dict[bytes, Credits]:
    out = core.grant()
    assert len({holder for holder, _ in out}) == len(out), "one Credits per actor and grant"
    return dict(out)


def test_credits_are_granted_under_the_staleness_bound() -> None:
    """At version v the window is (η + v + 1)·B groups admitted in all, whatever the window
    the actor asked for: η = 1, B = 2 -> 4 credits, then none until the learner moves on."""
    core = make_core(config("replay.max_staleness=1"))
    core.actor_joined(A, "a", session=1, window=16)
    (credits,) = granted(core).values()
    assert len(credits.items) == 4 and credits.policy_version == 0 and credits.group_size == 2
    assert granted(core) == {}  # the window is full: 4 in flight
    for seq, item in enumerate(credits.items[:2]):
        core.take_group(A, "a", group_for(item, seq, 0), ())
    assert granted(core) == {}  # stored, not consumed: still in the window
    core.request(L, SampleRequest(request_id=1, policy_version=1, num_groups=2), now=10.0)
    assert [len(b.groups) for _, b in core.serve(now=10.5)] == [2]
    # the window is at the actor's weights (version 0 until it reports loading newer ones)
    assert granted(core) == {}
    core.weights_loaded(A, 1)
    (more,) = granted(core).values()
    assert len(more.items) == 2 and more.policy_version == 1  # (1 + 1 + 1)·2 - 2 - 2 in flight


def test_an_actor_is_topped_up_a_quarter_window_at_a_time() -> None:
    core = make_core(config("replay.max_staleness=1000"))
    core.actor_joined(A, "a", session=1, window=8)
    items = list(granted(core)[A].items)
    assert len(items) == 8 and refill_at(8) == 2
    core.take_group(A, "a", group_for(items[0], 0, 0), ())
    assert granted(core) == {}  # one free slot of 8: not yet
    core.take_group(A, "a", group_for(items[1], 1, 0), ())
    assert len(granted(core)[A].items) == 2


def test_a_batch_is_served_only_when_enough_fresh_groups_exist() -> None:
    core = make_core(config("replay.max_staleness=1"))
    core.actor_joined(A, "a", session=1, window=8)
    items = list(granted(core)[A].items)
    core.request(L, SampleRequest(request_id=7, policy_version=0, num_groups=2), now=1.0)
    assert core.serve(now=1.5) == []  # nothing stored: the request stays parked
    core.take_group(A, "a", group_for(items[0], 0, 0), ())
    assert core.serve(now=2.0) == [] and len(core.parked) == 1  # all or nothing
    core.take_group(A, "a", group_for(items[1], 1, 0), ())
    ((to, batch),) = core.serve(now=3.25)
    assert to == L and batch.request_id == 7 and len(batch.groups) == 2
    assert batch.wait_s == 2.25 and batch.policy_version == 0  # time came in as an argument
    assert not core.parked and core.state.counters["groups_consumed"] == 2


def test_adopting_a_version_drops_too_stale_groups_and_reissues_their_prompts() -> None:
    core = make_core(config("replay.max_staleness=1"))
    core.actor_joined(A, "a", session=1, window=8)
    items = list(granted(core)[A].items)
    core.take_group(A, "a", group_for(items[0], 0, 0), ())
    core.take_group(A, "a", group_for(items[1], 1, 1), ())
    core.adopt_version(2)  # η = 1: the group made with version 0 is too stale now
    assert core.policy_version == 2 and len(core.state.buffer) == 1
    assert core.state.counters["groups_dropped_stale"] == 1
    assert core.state.prompts.reissue_pending == 1
    core.adopt_version(1)  # versions only move forward
    assert core.policy_version == 2
    core.request(L, SampleRequest(request_id=1, policy_version=2, num_groups=1), now=0.0)
    ((_, batch),) = core.serve(now=0.0)
    assert [g.seq for g in batch.groups] == [1] and batch.dropped_stale == 1


@pytest.mark.parametrize(
    ("version", "eta", "every", "floor"),
    [(0, 2, 1, 0), (1, 2, 1, 0), (3, 2, 1, 1), (7, 2, 1, 5), (7, 2, 2, 4), (8, 3, 4, 4)],
)
def test_the_weights_floor_is_v_minus_eta_rounded_down_to_a_published_version(
    version: int, eta: int, every: int, floor: int
) -> None:
    assert weights_floor(version, eta, every) == floor


def test_credits_carry_the_floor() -> None:
    core = make_core(config("replay.max_staleness=2", "learner.publish_every=2"))
    core.actor_joined(A, "a", session=1, window=4)
    assert granted(core)[A].min_weights_version == 0
    core.adopt_version(7)
    core.left(A)  # its credits expire, and it comes back
    core.actor_joined(A, "a", session=2, window=4)
    (credits,) = granted(core).values()
    assert credits.policy_version == 7 and credits.min_weights_version == 4


def test_a_group_is_refused_for_a_credit_not_held_or_from_another_sender() -> None:
    core = make_core(config())
    core.actor_joined(A, "a", session=1, window=4)
    item = granted(core)[A].items[0]
    with pytest.raises(ProtocolError, match="is not the sender"):
        core.take_group(A, "a", group_for(item, 0, 0, actor_id="b"), ())
    with pytest.raises(ProtocolError, match="not held by this actor"):
        core.take_group(b"other", "a", group_for(item, 0, 0), ())
    core.take_group(A, "a", group_for(item, 0, 0), ())
    core.take_group(A, "a", group_for(item, 0, 0), ())  # a resend: counted, stored once
    assert len(core.state.buffer) == 1 and core.state.counters["groups_duplicate"] == 1


def test_a_client_leaving_expires_its_credits_and_parked_requests() -> None:
    core = make_core(config())
    core.actor_joined(A, "a", session=1, window=4)
    assert len(granted(core)[A].items) == 4
    core.request(L, SampleRequest(request_id=1, policy_version=0, num_groups=2), now=0.0)
    assert core.left(A) == 4 and core.state.credits.outstanding == 0
    assert core.state.prompts.reissue_pending == 4 and granted(core) == {}
    core.left(L)
    assert not core.parked
    with pytest.raises(ProtocolError, match="num_groups"):
        core.request(L, SampleRequest(request_id=2, policy_version=0, num_groups=0), now=0.0)


GOLDEN_CREDITS_WITH_FLOOR = (
    "86aa67726f75705f73697a6508ae706f6c6963795f76657273696f6e09a56974656d739185a96372"
    "656469745f696407a970726f6d70745f6964a27031a670726f6d7074a7736f7274203331a4736565"
    "642aa4696e666f81a6646967697473a23331b36d696e5f776569676874735f76657273696f6e04a4"
    "74797065a743726564697473a870726f746f636f6c03"
)


def test_credits_with_a_floor_round_trip_on_both_decode_paths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The floor is an appended field: off the wire at 0 (the golden bytes of Credits stay,
    tests/unit/golden_wire.py), its own key otherwise, decoded by the fast path and the
    generic one alike."""
    item = CreditItem(credit_id=7, prompt_id="p1", prompt="sort 31", seed=42, info={"digits": "31"})
    msg = Credits(group_size=8, policy_version=9, items=(item,), min_weights_version=4)
    frames = encode(msg)
    assert len(frames) == 1 and bytes(frames[0]).hex() == GOLDEN_CREDITS_WITH_FLOOR
    assert decode(frames) == msg  # the fast path (asyncrl/protocol/group_codec.py)
    plain = Credits(group_size=8, policy_version=9, items=(item,))
    assert b"min_weights_version" not in bytes(encode(plain)[0])
    monkeypatch.setattr(codec, "decode_credits", lambda bufs: None)  # the generic path only
    assert decode(frames) == msg and decode(encode(plain)) == plain
