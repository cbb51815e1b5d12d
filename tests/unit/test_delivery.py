"""The hub client's delivery ledger (asyncrl/transport/connection.py): credits spent once, groups kept until
acknowledged, and what a restarted hub must hear again."""

import numpy as np
import pytest

from asyncrl.protocol.messages import (
    Ack,
    Batch,
    BatchAck,
    CreditItem,
    CreditReturn,
    Credits,
    Group,
    SampleRequest,
    Trajectory,
    Version,
    WeightsLoaded,
)
from asyncrl.transport.connection import Ledger


def group(seq: int, credit_id: int) -> Group:
    traj = Trajectory(
        tokens=np.arange(5, dtype=np.int32),
        prompt_len=3,
        loss_mask=np.ones(2, np.uint8),
        behavior_logprobs=np.zeros(2, np.float32),
        reward=0.0,
        min_policy_version=0,
        max_policy_version=0,
        finish_reason="stop",
    )
    return Group.build(
        group_id=f"g{seq}",
        prompt_id=f"p{seq}",
        credit_id=credit_id,
        actor_id="a",
        seq=seq,
        trajectories=[traj],
    )


def credits(*ids: int) -> Credits:
    items = tuple(CreditItem(credit_id=i, prompt_id=f"p{i}", prompt="x", seed=i) for i in ids)
    return Credits(group_size=1, policy_version=0, items=items)


def test_a_group_spends_a_held_credit_once() -> None:
    ledger = Ledger()
    ledger.granted(credits(1, 2))
    assert ledger.credits_held() == 2
    ledger.record(group(0, 1))
    assert (ledger.credits_held(), ledger.unacked()) == (1, 1)
    with pytest.raises(ValueError, match="credit_id 1: this client holds no such credit"):
        ledger.record(group(1, 1))
    with pytest.raises(ValueError, match="credit_id 7"):
        ledger.record(group(1, 7))
    assert ledger.unacked() == 1  # a refused group is not kept


def test_groups_stay_until_acknowledged_and_come_back_in_send_order() -> None:
    ledger = Ledger()
    ledger.granted(credits(*range(5)))
    sent = [group(seq, seq) for seq in range(5)]
    for g in sent:
        ledger.record(g)
    ledger.acked(Ack(seq=1, seqs=[3]))
    assert ledger.groups(None) == [sent[0], sent[2], sent[4]]
    assert ledger.groups([4, 3, 0]) == [sent[4], sent[0]]  # an acknowledged seq is skipped
    ledger.acked(Ack(seq=0, seqs=[2, 4, 9]))  # an unknown seq is no error (a resend's ack)
    assert ledger.unacked() == 0


def test_a_forgetting_hub_retires_held_credits_and_lists_what_to_resend() -> None:
    ledger = Ledger()
    ledger.granted(credits(1, 2, 3))
    ledger.record(group(0, 1))
    ledger.record(group(1, 2))
    ledger.acked(Ack(seq=0))
    assert ledger.hub_forgot() == [1]
    assert ledger.credits_held() == 0  # held from the old hub: no longer counted ...
    ledger.record(group(2, 3))  # ... but a group already being made for one is still sent once
    with pytest.raises(ValueError):
        ledger.record(group(3, 3))
    ledger.granted(credits(3))  # the new hub happens to grant the same id: a fresh credit
    ledger.record(group(3, 3))


def test_returned_credits_are_gone_held_or_retired() -> None:
    ledger = Ledger()
    ledger.granted(credits(1, 2))
    ledger.hub_forgot()
    ledger.granted(credits(3))
    ledger.record(CreditReturn(credit_ids=[1, 3]))
    for credit_id in (1, 3):
        with pytest.raises(ValueError):
            ledger.record(group(credit_id, credit_id))
    ledger.record(group(2, 2))


def test_what_a_restarted_hub_hears_again() -> None:
    ledger = Ledger()
    assert ledger.latest() == []
    ledger.record(Version(policy_version=3))
    ledger.record(Version(policy_version=4))
    ledger.record(BatchAck(request_id=7))
    ledger.record(SampleRequest(request_id=8, policy_version=4, num_groups=2))
    assert ledger.latest() == [
        Version(policy_version=4),
        BatchAck(request_id=7),
        SampleRequest(request_id=8, policy_version=4, num_groups=2),
    ]
    ledger.answered(Batch(request_id=7, policy_version=4, groups=()))  # an older request's
    assert len(ledger.latest()) == 3
    ledger.answered(Batch(request_id=8, policy_version=4, groups=()))
    assert ledger.latest() == [Version(policy_version=4), BatchAck(request_id=7)]


def test_the_policy_version_is_the_highest_spoken_of() -> None:
    ledger = Ledger()
    ledger.record(WeightsLoaded(actor_id="a", policy_version=5))
    ledger.record(Version(policy_version=2))
    ledger.record(SampleRequest(request_id=1, policy_version=4, num_groups=1))
    assert ledger.policy_version == 5
