"""Snapshots of the hub's state next to its write-ahead log, on real files: a snapshot
references the groups of the segment it closes instead of copying them (a group lent for long
is copied inline, and disk use stays bounded); a crash between any two steps of taking one
recovers everything acknowledged; a recycled segment never replays its earlier records."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from durability_cases import (
    copy_state,
    disk_bytes,
    exported,
    fresh,
    names,
    offsets,
    open_wal,
    push_big,
    recover,
    snapshot_head,
)

from replay.durability import HEADER, WriteAheadLog, read_records
from replay.snapshot import SnapshotJob
from replay.wal_records import pack_record


@pytest.mark.parametrize("background", [False, True])
def test_a_snapshot_references_the_groups_of_the_closed_segment(
    tmp_path: Path, background: bool
) -> None:
    live, wal = open_wal(tmp_path, background)
    total = sum(push_big(live, seq) for seq in range(8))
    assert len(live.hand_out(1, 2, float("inf"))) == 2  # two lent, never acknowledged
    wal.snapshot(live)
    push_big(live, 8)  # in the new segment, after the snapshot
    wal.close()
    snapshot = (tmp_path / "snapshot.bin").stat().st_size
    assert total > 500_000 and snapshot < 4096  # references, not copies
    head = snapshot_head(tmp_path)
    assert head["log_id"] == 1 and None not in head["refs"]
    assert {r[0] for r in head["refs"]} == {0}  # all in wal-0
    assert sorted(p.name for p in tmp_path.glob("wal-*")) == ["wal-0.log", "wal-1.log"]
    again, found = recover(tmp_path)
    assert found.snapshot_groups == 8 and found.ops == 2 and not found.reason  # issue, store
    assert exported(again) == exported(live)  # tokens, logprobs, counters, lent, windows
    assert sorted(again.lent) == [1] and again.is_resend("a", 8) and again.next_seq("a") == 9
    current = tmp_path / "wal-1.log"
    os.truncate(current, wal.log_bytes - 1000)  # a torn tail in the current segment
    torn, found = recover(tmp_path)
    assert "torn" in found.reason and found.ops == 1 and found.snapshot_groups == 8
    assert not torn.is_resend("a", 8) and len(torn.buffer) == len(live.buffer) - 1
    assert current.stat().st_size == offsets(current, 1)[-1]  # cut after the last sound record


@pytest.mark.parametrize("keep", [1, 3])
def test_a_long_lived_group_is_copied_inline_and_disk_use_stays_bounded(
    tmp_path: Path, keep: int
) -> None:
    segment = 10 * 90_000
    live, wal = open_wal(tmp_path, background=True, snapshot_log_bytes=segment, keep_segments=keep)
    push_big(live, 0)
    assert len(live.hand_out(10**6, 1, float("inf"))) == 1  # lent for the whole test
    largest, heads = 0, []
    for seq in range(1, 121):
        push_big(live, seq)
        if seq % 2 == 0:
            assert len(live.hand_out(seq, 2, float("inf"))) == 2
            live.trained(seq)  # every batch up to this one: the long-lived one has a higher id
        wal.commit()
        if wal.due_for_snapshot():
            wal.snapshot(live)
            wal.sync()  # let the syncer finish it, to look at the files
            heads.append(snapshot_head(tmp_path))
        files = disk_bytes(tmp_path)
        largest = max(largest, sum(files))
        assert len(files) <= keep + 3  # the snapshot, the kept segments, the current, the spare
    wal.close()
    assert len(heads) >= 8 and largest < (keep + 2) * segment + 4 * 90_000 + 8192
    assert all(len(h["refs"]) == h["groups"] for h in heads)
    # the lent group is referenced while its segment is one of the `keep` newest closed ones,
    # then copied inline
    assert [h["refs"].count(None) for h in heads] == [0] * keep + [1] * (len(heads) - keep)
    again, found = recover(tmp_path)
    assert exported(again) == exported(live) and not found.reason


def test_a_crash_between_snapshot_steps_recovers_what_was_acknowledged(tmp_path: Path) -> None:
    run = tmp_path / "run"
    live, wal = open_wal(run, background=False)
    for seq in range(3):
        push_big(live, seq)
    wal.snapshot(live)  # snapshot 1 references wal-0
    for seq in range(3, 6):
        push_big(live, seq)
    assert len(live.hand_out(1, 2, float("inf"))) == 2
    wal.commit()  # everything so far acknowledged
    acknowledged, acked_dir = exported(live), copy_state(run, tmp_path / "acked")
    wal.snapshot(live)  # snapshot 2 references wal-1; wal-0 goes
    push_big(live, 6)
    wal.close()
    assert names(run) == ["LOCK", "snapshot.bin", "wal-1.log", "wal-2.log", "wal-spare-0.log"]

    # killed before the rename: the old snapshot, the segment it replays, the new segment
    # (nothing of it acknowledged) and a partly written snapshot.tmp
    crash = copy_state(acked_dir, tmp_path / "before_rename")
    shutil.copy(run / "wal-2.log", crash / "wal-2.log")
    (crash / "snapshot.tmp").write_bytes((run / "snapshot.bin").read_bytes()[:100])
    state, found = recover(crash)
    assert exported(state) == acknowledged and not found.reason
    assert names(crash) == ["LOCK", "snapshot.bin", "wal-0.log", "wal-1.log"]
    # the hub goes on there: it appends to wal-1, and its next snapshot starts wal-2 empty
    state = fresh(incarnation=2)
    wal = WriteAheadLog(crash, fsync=True, snapshot_log_bytes=1 << 30, keep_segments=1)
    wal.recover(state)
    state.journal = wal.journal
    (crash / "wal-2.log").write_bytes(b"stale records of a segment a crash left behind")
    wal.snapshot(state)
    push_big(state, 7)
    wal.close()
    again, found = recover(crash)
    assert exported(again) == exported(state) and not found.reason and found.ops == 2

    # killed after the rename, before the segment before the referenced one was deleted
    crash = copy_state(run, tmp_path / "after_rename")
    shutil.copy(acked_dir / "wal-0.log", crash / "wal-0.log")
    state, found = recover(crash)
    assert exported(state) == exported(live) and not found.reason
    assert names(crash) == ["LOCK", "snapshot.bin", "wal-1.log", "wal-2.log", "wal-spare-0.log"]


def test_nothing_of_the_new_segment_is_synced_before_the_snapshot_is_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    live, wal = open_wal(tmp_path, background=True)
    assert wal.syncer is not None
    seen: list[Any] = []
    real_run = SnapshotJob.run

    def run(job: SnapshotJob) -> list[Path]:
        assert wal.syncer is not None
        seen.append((wal.syncer.synced, (tmp_path / "wal-1.log").stat().st_size))
        return real_run(job)

    monkeypatch.setattr(SnapshotJob, "run", run)
    push_big(live, 0)
    assert len(live.hand_out(1, 1, float("inf"))) == 1
    switch = wal.lsn
    with wal.syncer.cond:  # the syncer takes every job below in one go, once this lets go
        wal.snapshot(live)
        for seq in range(1, 4):
            push_big(live, seq)
            wal.commit()
        assert wal.durable_lsn < switch
    wal.sync()
    assert seen == [(switch, 0)]  # the old segment synced, nothing of the new one written
    assert wal.durable_lsn == wal.lsn > switch
    wal.close()
    again, _ = recover(tmp_path)
    assert exported(again) == exported(live)


def test_a_damaged_referenced_record_is_a_damaged_snapshot(tmp_path: Path) -> None:
    live, wal = open_wal(tmp_path, background=False)
    for seq in range(3):
        push_big(live, seq)
    wal.snapshot(live)
    wal.close()
    log_id, offset, size = snapshot_head(tmp_path)["refs"][1]
    assert log_id == 0
    segment = tmp_path / "wal-0.log"
    with segment.open("r+b") as f:  # flip one byte inside the second group's record
        f.seek(offset + size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    wal = WriteAheadLog(tmp_path, fsync=False, snapshot_log_bytes=1 << 30)
    with pytest.raises(
        ValueError,
        match=rf"damaged record at byte {offset} of \S*wal-0.log "
        r"\(checksum mismatch\)",
    ):
        wal.recover(fresh(incarnation=2))
    segment.unlink()
    with pytest.raises(ValueError, match=r"wal-0.log, which is missing"):
        wal.recover(fresh(incarnation=2))
    wal.close()


def test_a_recycled_segment_never_replays_its_earlier_records(tmp_path: Path) -> None:
    live, wal = open_wal(tmp_path, background=False)
    for seq in range(12):
        push_big(live, seq)
        assert len(live.hand_out(seq, 1, float("inf"))) == 1
        live.trained(seq)
        if seq % 4 == 3:
            wal.snapshot(live)  # nothing to reference: the closed segment becomes the spare
    push_big(live, 12)
    wal.close()
    log_id = wal.log_id
    path = tmp_path / f"wal-{log_id}.log"
    with path.open("rb") as f:
        _, op, args, _ = next(read_records(f, seed=log_id))
    assert op == "segment" and args["recycled_from"] == log_id - 2
    ends, size = offsets(path, log_id), path.stat().st_size
    assert size > ends[-1] + 200_000  # the earlier life's records follow the new ones
    again, found = recover(tmp_path)
    assert exported(again) == exported(live) and found.ops == 2 and not found.reason
    assert path.stat().st_size == size  # kept for the log to overwrite
    with path.open("r+b") as f:  # a bad byte in the last new record: cut as in any segment
        f.seek(ends[-2] + HEADER.size + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    torn, found = recover(tmp_path)
    assert "checksum" in found.reason and path.stat().st_size == ends[-2]
    assert not torn.is_resend("a", 12)


def test_a_buffer_spanning_segments_is_referenced_not_rewritten(tmp_path: Path) -> None:
    """Groups stored over three segments and never sampled: each snapshot references all of
    them (none copied), keeps exactly the segments they are in, and a recovered hub's next
    snapshot references them again."""
    live, wal = open_wal(tmp_path, background=False, keep_segments=3)
    for seq in range(9):
        push_big(live, seq)
        if seq % 3 == 2:
            wal.snapshot(live)  # segments 0, 1, 2 closed, three groups each
    head = snapshot_head(tmp_path)
    assert head["log_id"] == 3 and None not in head["refs"]
    assert sorted({r[0] for r in head["refs"]}) == [0, 1, 2]
    assert (tmp_path / "snapshot.bin").stat().st_size < 4096  # references only
    assert names(tmp_path) == [
        "LOCK",
        "snapshot.bin",
        "wal-0.log",
        "wal-1.log",
        "wal-2.log",
        "wal-3.log",
    ]
    push_big(live, 9)
    wal.snapshot(live)  # wal-0 leaves the kept window: its groups are copied, it goes
    head = snapshot_head(tmp_path)
    assert head["refs"].count(None) == 3 and {r[0] for r in head["refs"] if r} == {1, 2, 3}
    wal.close()
    assert names(tmp_path) == [
        "LOCK",
        "snapshot.bin",
        "wal-1.log",
        "wal-2.log",
        "wal-3.log",
        "wal-4.log",
        "wal-spare-0.log",
    ]
    state = fresh(incarnation=2)
    again = WriteAheadLog(tmp_path, fsync=False, snapshot_log_bytes=1 << 30, keep_segments=3)
    found = again.recover(state)
    assert exported(state) == exported(live) and not found.reason
    state.journal = again.journal
    again.snapshot(state)  # wal-1's groups leave the window; wal-2, wal-3 still referenced
    again.close()
    head = snapshot_head(tmp_path)
    assert head["refs"].count(None) == 6 and {r[0] for r in head["refs"] if r} == {2, 3}
    final, found = recover(tmp_path)
    assert exported(final) == exported(live) and not found.reason


def test_a_snapshot_of_the_earlier_format_still_loads(tmp_path: Path) -> None:
    """Snapshots written before per-group segment ids: `ref_log` in the head, [offset, size]."""
    live, wal = open_wal(tmp_path, background=False)
    for seq in range(4):
        push_big(live, seq)
    wal.snapshot(live)
    wal.close()
    path = tmp_path / "snapshot.bin"
    with path.open("rb") as f:
        records = read_records(f)
        _, _, head, _ = next(records)
        rest = f.read()
    assert all(r is not None and r[0] == 0 for r in head["refs"])
    head["ref_log"] = 0
    head["refs"] = [r[1:] for r in head["refs"]]
    path.write_bytes(
        b"".join(bytes(memoryview(p)) for p in pack_record("snapshot", head, ())) + rest
    )
    again, found = recover(tmp_path)
    assert exported(again) == exported(live) and found.snapshot_groups == 4 and not found.reason
