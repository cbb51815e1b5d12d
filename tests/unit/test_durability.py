"""The hub's write-ahead log on real files: a state rebuilt from snapshot + log equals the live
one; a torn or corrupt tail is detected, never loaded, and cut; snapshots bound the log.
Snapshots that reference the log, crashes between their steps and recycled segments:
test_snapshots.py."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from durability_cases import (
    disk_bytes,
    exported,
    fresh,
    group,
    offsets,
    push,
    recover,
    workload,
    write_log,
)

from asyncrl.protocol.codec import encode
from replay.core import SeqWindow
from replay.durability import HEADER, WriteAheadLog, pack_record


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
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["LOCK", "snapshot.bin", "wal-0.log", "wal-1.log"]  # wal-0: the z groups
    again = fresh(incarnation=2)
    found = WriteAheadLog(tmp_path, fsync=True, snapshot_log_bytes=1 << 30).recover(again)
    assert found.snapshot_groups == 2 and found.ops > 10 and not found.reason
    assert exported(again) == exported(live)
    assert again.is_resend("a", 3) and not again.is_resend("a", 5)
    assert again.next_seq("a") == 5 and sorted(again.lent) == [2]


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
    size = sum(
        memoryview(p).nbytes
        for p in pack_record("store", {"holder": b"a"}, encode(group("a", 0, 1, "p0", 0)))
    )
    wal = WriteAheadLog(
        tmp_path, fsync=background, snapshot_log_bytes=20 * size, background=background
    )
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
        largest = max(largest, sum(disk_bytes(tmp_path)))
    wal.close()
    # groups here never outlive a segment, so three segments at most: the one the snapshot
    # references, the current one, the spare
    assert wal.num_snapshots >= 5 and largest < 75 * size
    assert len(list(tmp_path.glob("wal-*.log"))) <= 3
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


# --- snapshots that reference the log ---------------------------------------------------------
