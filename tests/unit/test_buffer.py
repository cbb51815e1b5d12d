"""The replay buffer's invariants under any sequence of inserts, version advances and samples
(a hypothesis state machine), plus the reuse limiter's refusal of deadlocking settings."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from asyncrl.protocol.messages import Group, Trajectory
from replay.buffer import InsertResult, ReplayBuffer


def group(actor_id: str, seq: int, min_version: int, span: int = 0) -> Group:
    traj = Trajectory(
        tokens=np.arange(5, dtype=np.int32),
        prompt_len=3,
        loss_mask=np.ones(2, np.uint8),
        behavior_logprobs=np.zeros(2, np.float32),
        reward=0.0,
        min_policy_version=min_version,
        max_policy_version=min_version + span,
        finish_reason="stop",
    )
    return Group.build(
        group_id=f"{actor_id}/{seq}",
        prompt_id=f"prompt-{actor_id}-{seq}",
        credit_id=seq,
        actor_id=actor_id,
        seq=seq,
        trajectories=[traj],
    )


class BufferMachine(RuleBasedStateMachine):
    """Model: the fate of every key ever stored is exactly one of stored / exhausted / dropped."""

    @initialize(
        capacity=st.integers(4, 8),
        eta=st.integers(0, 2),
        batch=st.integers(1, 3),
        sampling=st.sampled_from(["fifo", "freshest"]),
        reuse=st.sampled_from([(1, 0.0), (2, 0.0), (2, 1.0), (3, 0.5), (2, 2.0)]),
        slack=st.integers(0, 3),
    )
    def setup(
        self,
        capacity: int,
        eta: int,
        batch: int,
        sampling: str,
        reuse: tuple[int, float],
        slack: int,
    ) -> None:
        times, rate = reuse
        tolerance = max(rate * batch, (batch + rate) / 2) + slack
        self.buf = ReplayBuffer(
            capacity=capacity,
            max_staleness=eta,
            batch_groups=batch,
            sampling=sampling,
            max_times_sampled=times,
            samples_per_insert=rate,
            tolerance=tolerance,
        )
        self.eta, self.batch, self.times = eta, batch, times
        self.fate: dict[tuple[str, int], str] = {}
        self.samples: dict[tuple[str, int], int] = {}
        self.versions: dict[tuple[str, int], int] = {}
        self.reported: set[str] = set()  # prompt ids handed back for re-issue
        self.next_seq = 0

    @property
    def version(self) -> int:
        return self.buf.policy_version

    def note_dropped(self, groups: list[Group]) -> None:
        for g in groups:
            key = (g.actor_id, g.seq)
            assert self.fate.get(key) == "stored", f"{key} dropped twice or never stored"
            assert self.version - g.min_policy_version > self.eta
            self.fate[key] = "dropped"
            self.reported.add(g.prompt_id)

    @rule(actor=st.sampled_from(["a", "b"]), lag=st.integers(-1, 4), span=st.integers(0, 2))
    def insert_new(self, actor: str, lag: int, span: int) -> None:
        self.next_seq += 1
        g = group(actor, self.next_seq, max(0, self.version - lag), span)
        key = (actor, self.next_seq)
        sampled_before = {k for k, n in self.samples.items() if n > 0 and self.fate[k] == "stored"}
        was_full = len(self.buf) >= self.buf.capacity
        result = self.buf.insert(g)
        if self.version - g.min_policy_version > self.eta:
            assert result is InsertResult.STALE
            self.reported.add(g.prompt_id)
            return
        if result is InsertResult.FULL:
            assert was_full and not sampled_before  # only unsampled groups block an insert
            return
        assert result is InsertResult.STORED
        if was_full:  # an already-sampled group made room
            (evicted,) = [k for k in sampled_before if k not in self.buf]
            self.fate[evicted] = "exhausted"
        self.fate[key], self.samples[key], self.versions[key] = "stored", 0, g.min_policy_version

    @precondition(lambda self: any(fate == "stored" for fate in self.fate.values()))
    @rule(data=st.data())
    def insert_duplicate(self, data: st.DataObject) -> None:
        stored = sorted(k for k, fate in self.fate.items() if fate == "stored")
        actor, seq = data.draw(st.sampled_from(stored))
        assert (
            self.buf.insert(group(actor, seq, self.versions[(actor, seq)]))
            is InsertResult.DUPLICATE
        )

    @rule(steps=st.integers(0, 2))
    def advance(self, steps: int) -> None:
        self.note_dropped(self.buf.drop_stale(self.version + steps))

    @rule(ahead=st.integers(0, 1), extra=st.integers(0, 2))
    def sample(self, ahead: int, extra: int) -> None:
        n = self.batch + extra if extra < 2 else 1
        groups, dropped = self.buf.sample(self.version + ahead, n)
        self.note_dropped(dropped)
        if not groups:
            # all-or-nothing, and never a deadlock: if a batch cannot be had, an insert can
            evictable = any(self.samples[k] > 0 for k, f in self.fate.items() if f == "stored")
            if n <= self.batch:
                assert self.buf.insert_room() >= 1
                assert len(self.buf) < self.buf.capacity or evictable
            return
        assert len(groups) == n
        keys = [(g.actor_id, g.seq) for g in groups]
        assert len(set(keys)) == n
        self.check_order(groups)
        for g, key in zip(groups, keys, strict=True):
            assert self.version - g.min_policy_version <= self.eta
            assert self.fate[key] == "stored"
            self.samples[key] += 1
            assert self.samples[key] <= self.times
            if self.samples[key] == self.times:
                self.fate[key] = "exhausted"

    def check_order(self, groups: list[Group]) -> None:
        chosen = {(g.actor_id, g.seq) for g in groups}
        others = [g for g in self.buf.stored_groups() if (g.actor_id, g.seq) not in chosen]
        if not others:
            return
        if self.buf.sampling == "fifo":  # seq grows with every insert: it is insertion order
            assert max(g.seq for g in groups) < min(g.seq for g in others)
        else:
            assert min(g.min_policy_version for g in groups) >= max(
                g.min_policy_version for g in others
            )

    @invariant()
    def nothing_lost_or_duplicated(self) -> None:
        if not hasattr(self, "buf"):
            return
        stored = {(g.actor_id, g.seq) for g in self.buf.stored_groups()}
        assert stored == {k for k, fate in self.fate.items() if fate == "stored"}
        assert len(self.buf) <= self.buf.capacity
        assert all(
            self.version - g.min_policy_version <= self.eta for g in self.buf.stored_groups()
        )
        for key, fate in self.fate.items():
            if fate == "dropped":
                assert f"prompt-{key[0]}-{key[1]}" in self.reported
        unsampled = sum(1 for k in stored if self.samples[k] == 0)
        assert self.buf.num_unsampled == unsampled


TestBufferMachine = BufferMachine.TestCase
TestBufferMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
)


def test_fifo_and_freshest_order() -> None:
    for sampling, expected in (("fifo", [1, 2]), ("freshest", [3, 2])):
        buf = ReplayBuffer(capacity=8, max_staleness=5, batch_groups=2, sampling=sampling)
        for seq, version in ((1, 1), (2, 2), (3, 3)):
            buf.insert(group("a", seq, version))
        groups, _ = buf.sample(3, 2)
        assert [g.seq for g in groups] == expected


def test_staleness_is_measured_from_the_oldest_policy_of_a_group() -> None:
    buf = ReplayBuffer(capacity=8, max_staleness=1, batch_groups=1)
    assert buf.insert(group("a", 1, 0, span=3)) is InsertResult.STORED
    groups, dropped = buf.sample(2, 1)
    assert groups == [] and [g.seq for g in dropped] == [1] and buf.num_dropped_stale == 1


def test_capacity_refuses_rather_than_drops() -> None:
    buf = ReplayBuffer(capacity=2, max_staleness=5, batch_groups=1)
    assert [buf.insert(group("a", s, 0)) for s in (1, 2, 3)][-1] is InsertResult.FULL
    assert len(buf) == 2 and {g.seq for g in buf.stored_groups()} == {1, 2}


@pytest.mark.parametrize(
    ("rate", "tolerance", "batch", "times", "match"),
    [
        (1.0, 4.0, 8, 1, "samples_per_insert_tolerance"),  # smaller than one batch
        (2.0, 10.0, 8, 2, "samples_per_insert_tolerance"),  # fills less than a batch of inserts
        (0.5, 2.0, 8, 1, "samples_per_insert_tolerance"),  # 2T < n + r: both sides can block
        (3.0, 100.0, 8, 2, "max_times_sampled"),  # groups leave before their samples
    ],
)
def test_limiter_refuses_settings_that_could_deadlock(
    rate: float, tolerance: float, batch: int, times: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        ReplayBuffer(
            capacity=64,
            max_staleness=1,
            batch_groups=batch,
            max_times_sampled=times,
            samples_per_insert=rate,
            tolerance=tolerance,
        )


def test_limiter_paces_reuse() -> None:
    buf = ReplayBuffer(
        capacity=64,
        max_staleness=9,
        batch_groups=2,
        max_times_sampled=8,
        samples_per_insert=2.0,
        tolerance=4.0,
    )
    assert buf.insert_room() == 2
    buf.insert(group("a", 1, 0))
    buf.insert(group("a", 2, 0))
    assert buf.insert_room() == 0  # two inserts ahead of sampling: wait for samples
    for _ in range(4):  # 4 inserts' worth of samples allowed (+ tolerance), then inserts needed
        assert len(buf.sample(0, 2)[0]) == 2
    assert buf.sample(0, 2)[0] == [] and buf.insert_room() >= 1


def test_capacity_below_one_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="replay.capacity_groups"):
        ReplayBuffer(capacity=4, max_staleness=0, batch_groups=8)
