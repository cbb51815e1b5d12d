"""The hub's write-ahead log on real files: a state rebuilt from snapshot + log equals the live
one; a torn or corrupt tail is detected, never loaded, and cut; snapshots bound the log."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asyncrl.config import load_config
from asyncrl.protocol import Group, Trajectory, encode
from replay.durability import HEADER, WriteAheadLog, pack_record, read_records
from replay.prompts import Prompt, PromptSource
from replay.state import HubState, SeqWindow

CFG = load_config(None, ["learner.groups_per_step=2", "replay.max_staleness=1"])


def fresh(incarnation: int = 1) -> HubState:
    prompts = PromptSource([Prompt(f"p{i}", f"sort {i}") for i in range(7)], seed=3)
    return HubState(CFG, prompts, incarnation)


def group(actor_id: str, seq: int, credit_id: int, prompt_id: str, version: int) -> Group:
    traj = Trajectory(tokens=np.arange(6, dtype=np.int32), prompt_len=2,
                      loss_mask=np.ones(4, np.uint8), behavior_logprobs=np.full(4, -0.5, np.float32),
                      reward=float(seq), min_policy_version=version, max_policy_version=version,
                      finish_reason="stop")  # fmt: skip
    return Group.build(group_id=f"{actor_id}/{seq}", prompt_id=prompt_id, credit_id=credit_id,
                       actor_id=actor_id, seq=seq, trajectories=[traj, traj])  # fmt: skip


def push(state: HubState, holder: bytes, actor_id: str, seq: int, version: int) -> None:
    (item,) = state.issue(holder, 1)
    g = group(actor_id, seq, item.credit_id, item.prompt_id, version)
    state.store(holder, g, encode(g))


def workload(state: HubState) -> None:
    """Every kind of op: hellos, credits, stores, hand-outs, acks, versions, a dead actor."""
    state.begin(state.credits.incarnation)
    state.actor_hello(b"a", "a", session=11)
    state.actor_hello(b"b", "b", session=12)
    state.learner_hello(session=5, acks_batches=True)
    for seq in range(4):
        push(state, b"a", "a", seq, 0)
    push(state, b"b", "b", 0, 0)
    assert len(state.hand_out(1, 2, float("inf"))) == 2
    state.trained(1)
    state.adopt_version(1, rewind=True)
    assert len(state.hand_out(2, 2, float("inf"))) == 2  # lent, never acknowledged
    state.issue(b"b", 3)
    state.give_back(b"b", [state.credits.incarnation << 32 | state.credits._serial])
    state.expire(b"b")
    state.adopt_version(3)  # what is left goes stale
    push(state, b"a", "a", 4, 3)


def exported(state: HubState) -> tuple[Any, list[bytes]]:
    meta, groups = state.export()
    return meta, [b"".join(bytes(memoryview(f)) for f in encode(g)) for g in groups]


def test_snapshot_plus_log_rebuilds_the_live_state(tmp_path: Path) -> None:
    live = fresh()
    wal = WriteAheadLog(tmp_path, fsync=True, snapshot_log_bytes=1 << 30)
    wal.recover(live)
    live.journal = wal.journal
    live.begin(1)
    for seq in range(2):
        push(live, b"z", "z", seq, 0)
    wal.snapshot(live)  # half the history in the snapshot, half in the log after it
    workload(live)
    wal.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LOCK", "snapshot.bin", "wal-1.log"]
    again = fresh(incarnation=2)
    found = WriteAheadLog(tmp_path, fsync=True, snapshot_log_bytes=1 << 30).recover(again)
    assert found.snapshot_groups == 2 and found.ops > 10 and not found.reason
    assert exported(again) == exported(live)
    assert again.is_resend("a", 3) and not again.is_resend("a", 5)
    assert again.next_seq("a") == 5 and sorted(again.lent) == [2]


def write_log(tmp_path: Path) -> tuple[HubState, Path]:
    live = fresh()
    wal = WriteAheadLog(tmp_path, fsync=False, snapshot_log_bytes=1 << 30)
    wal.recover(live)
    live.journal = wal.journal
    workload(live)
    wal.close()
    return live, tmp_path / "wal-0.log"


def offsets(path: Path) -> list[int]:
    with path.open("rb") as f:
        return [0] + [end for end, *_ in read_records(f)]


def recover(tmp_path: Path) -> tuple[HubState, Any]:
    state = fresh(incarnation=2)
    wal = WriteAheadLog(tmp_path, fsync=False, snapshot_log_bytes=1 << 30)
    found = wal.recover(state)
    wal.close()
    return state, found


@pytest.mark.parametrize("cut", [1, HEADER.size + 3, -1])
def test_a_torn_tail_is_skipped_and_cut(tmp_path: Path, cut: int) -> None:
    live, path = write_log(tmp_path)
    ends = offsets(path)
    last_start = ends[-2]
    os.truncate(path, last_start + (cut if cut > 0 else ends[-1] - last_start - 1))
    state, found = recover(tmp_path)
    assert "torn" in found.reason and found.ops == len(ends) - 2
    assert path.stat().st_size == last_start  # the torn record is gone from the file
    assert len(state.buffer) == len(live.buffer) - 1  # the last op was the last store
    assert not state.is_resend("a", 4)  # never loaded: the actor's resend will be taken
    again, found = recover(tmp_path)  # the cut log recovers cleanly
    assert not found.reason and exported(again) == exported(state)


def test_a_corrupt_record_ends_the_log_there(tmp_path: Path) -> None:
    live, path = write_log(tmp_path)
    ends = offsets(path)
    middle = len(ends) // 2
    with path.open("r+b") as f:  # flip one byte inside a middle record's body
        f.seek(ends[middle] + HEADER.size + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    state, found = recover(tmp_path)
    assert "checksum" in found.reason and found.ops == middle
    assert found.skipped_bytes == ends[-1] - ends[middle]
    assert path.stat().st_size == ends[middle]


def test_an_impossible_length_is_corruption(tmp_path: Path) -> None:
    _, path = write_log(tmp_path)
    ends = offsets(path)
    with path.open("ab") as f:
        f.write(HEADER.pack(2**31 + 5, 0) + b"x" * 20)
    _, found = recover(tmp_path)
    assert "impossible record length" in found.reason and found.ops == len(ends) - 1


@pytest.mark.parametrize("background", [False, True])
def test_snapshots_bound_the_log(tmp_path: Path, background: bool) -> None:
    """With `background`, the syncer thread writes and fsyncs every commit (the hub's mode)."""
    state = fresh()
    size = sum(memoryview(p).nbytes for p in pack_record("store", {"holder": b"a"}, encode(
        group("a", 0, 1, "p0", 0))))  # fmt: skip
    wal = WriteAheadLog(tmp_path, fsync=background, snapshot_log_bytes=20 * size,
                        background=background)  # fmt: skip
    wal.recover(state)
    state.journal = wal.journal
    state.actor_hello(b"a", "a", session=1)
    state.learner_hello(session=1, acks_batches=True)
    largest = 0
    for seq in range(200):
        push(state, b"a", "a", seq, 0)
        if seq % 2:
            state.hand_out(seq, 2, float("inf"))
            state.trained(seq)
        durable = wal.commit()
        assert durable <= wal.lsn
        if wal.due_for_snapshot():
            wal.snapshot(state)
            assert wal.durable_lsn == wal.lsn  # a snapshot waits for the log it replaces
        largest = max(largest, sum(p.stat().st_size for p in tmp_path.glob("wal-*.log")))
    wal.close()
    assert wal.num_snapshots >= 5 and largest < 25 * size
    assert len(list(tmp_path.glob("wal-*.log"))) == 1
    again, found = recover(tmp_path)
    assert exported(again) == exported(state) and not found.reason


def test_one_hub_per_directory(tmp_path: Path) -> None:
    first = WriteAheadLog(tmp_path, fsync=False, snapshot_log_bytes=1 << 20)
    with pytest.raises(ValueError, match="another hub"):
        WriteAheadLog(tmp_path, fsync=False, snapshot_log_bytes=1 << 20)
    first.close()


def test_seq_windows_remember_exactly_the_seqs_taken() -> None:
    rng = np.random.default_rng(5)
    for _ in range(50):
        window, taken = SeqWindow(), set()
        order = rng.permutation(40)[: rng.integers(1, 40)]
        if rng.random() < 0.5:
            order = np.sort(order)  # in order, gaps where seqs are missing
        for seq in order.tolist():
            assert not window.seen(seq)
            window.add(seq)
            taken.add(seq)
            assert [s for s in range(41) if window.seen(s)] == sorted(taken)
            assert window.next_seq == max(taken) + 1
