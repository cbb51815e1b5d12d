"""The hub's write-ahead log on real files: a state rebuilt from snapshot + log equals the live
one; a torn or corrupt tail is detected, never loaded, and cut; snapshots bound the log."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asyncrl.config import load_config
from asyncrl.protocol import Group, Trajectory, encode
from replay.durability import HEADER, WriteAheadLog, pack_record, read_records
from replay.prompts import Prompt, PromptSource
from replay.snapshot import SnapshotJob
from replay.state import HubState, SeqWindow
from replay.wal_records import END_MARKER, TornRecord

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
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["LOCK", "snapshot.bin", "wal-0.log", "wal-1.log"]  # wal-0: the z groups
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


def offsets(path: Path, log_id: int = 0) -> list[int]:
    """Where each record of a segment starts, then where the last one ends."""
    ends = [0]
    with path.open("rb") as f:
        try:
            for end, *_ in read_records(f, seed=log_id):
                ends.append(end)
        except TornRecord as exc:  # the end marker of a recycled segment
            assert exc.why == END_MARKER
    return ends


def disk_bytes(directory: Path) -> list[int]:
    """Sizes of the state files (the syncer thread may rename or delete one meanwhile)."""
    sizes = []
    for p in directory.iterdir():
        try:
            if p.name != "LOCK":
                sizes.append(p.stat().st_size)
        except FileNotFoundError:
            pass
    return sizes


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
        largest = max(largest, sum(disk_bytes(tmp_path)))
    wal.close()
    # three segments at most: the one the snapshot references, the current one, the spare
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


def big_group(actor_id: str, seq: int, credit_id: int, prompt_id: str) -> Group:
    """A group of about 80 KB whose arrays differ from seq to seq."""
    rng = np.random.default_rng(seq)
    trajs = [Trajectory(tokens=rng.integers(0, 50_000, 4096, dtype=np.int32), prompt_len=96,
                        loss_mask=np.ones(4000, np.uint8),
                        behavior_logprobs=-rng.random(4000, dtype=np.float32), reward=float(k),
                        min_policy_version=0, max_policy_version=0, finish_reason="length")
             for k in range(2)]  # fmt: skip
    return Group.build(group_id=f"{actor_id}/{seq}", prompt_id=prompt_id, credit_id=credit_id,
                       actor_id=actor_id, seq=seq, trajectories=trajs)  # fmt: skip


def push_big(state: HubState, seq: int) -> int:
    """Store a big group from actor "a"; returns its encoded size."""
    (item,) = state.issue(b"a", 1)
    g = big_group("a", seq, item.credit_id, item.prompt_id)
    frames = encode(g)
    state.store(b"a", g, frames)
    return sum(memoryview(f).nbytes for f in frames)


def open_wal(tmp_path: Path, background: bool, **kw: Any) -> tuple[HubState, WriteAheadLog]:
    state = fresh()
    wal = WriteAheadLog(tmp_path, fsync=True, background=background,
                        snapshot_log_bytes=kw.get("snapshot_log_bytes", 1 << 30))  # fmt: skip
    wal.recover(state)
    state.journal = wal.journal
    state.begin(1)
    state.actor_hello(b"a", "a", session=1)
    state.learner_hello(session=1, acks_batches=True)
    return state, wal


def snapshot_head(tmp_path: Path) -> dict[str, Any]:
    with (tmp_path / "snapshot.bin").open("rb") as f:
        _, op, head, _ = next(read_records(f))
    assert op == "snapshot"
    return head


@pytest.mark.parametrize("background", [False, True])
def test_a_snapshot_references_the_groups_of_the_closed_segment(tmp_path: Path,
                                                                background: bool) -> None:  # fmt: skip
    live, wal = open_wal(tmp_path, background)
    total = sum(push_big(live, seq) for seq in range(8))
    assert len(live.hand_out(1, 2, float("inf"))) == 2  # two lent, never acknowledged
    wal.snapshot(live)
    push_big(live, 8)  # in the new segment, after the snapshot
    wal.close()
    snapshot = (tmp_path / "snapshot.bin").stat().st_size
    assert total > 500_000 and snapshot < 4096  # references, not copies
    head = snapshot_head(tmp_path)
    assert head["log_id"] == 1 and head["ref_log"] == 0 and None not in head["refs"]
    assert sorted(p.name for p in tmp_path.glob("wal-*")) == ["wal-0.log", "wal-1.log"]
    again, found = recover(tmp_path)
    assert found.snapshot_groups == 8 and found.ops == 2 and not found.reason  # issue, store
    assert exported(again) == exported(live)  # tokens, logprobs, counters, lent, windows
    assert sorted(again.lent) == [1] and again.is_resend("a", 8) and again.next_seq("a") == 9
    current = tmp_path / "wal-1.log"
    os.truncate(current, current.stat().st_size - 1000)  # a torn tail in the current segment
    torn, found = recover(tmp_path)
    assert "torn" in found.reason and found.ops == 1 and found.snapshot_groups == 8
    assert not torn.is_resend("a", 8) and len(torn.buffer) == len(live.buffer) - 1
    assert current.stat().st_size == offsets(current, 1)[-1]  # cut after the last sound record


def test_a_long_lived_group_is_copied_inline_and_disk_use_stays_bounded(tmp_path: Path) -> None:
    segment = 10 * 90_000
    live, wal = open_wal(tmp_path, background=True, snapshot_log_bytes=segment)
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
        assert len(files) <= 4  # the snapshot, two segments and the spare
    wal.close()
    assert len(heads) >= 8 and largest < 3 * segment + 4 * 90_000 + 8192
    assert all(len(h["refs"]) == h["groups"] for h in heads)
    # the lent group is referenced while its segment is the one closing, then copied inline
    assert [h["refs"].count(None) for h in heads] == [0] + [1] * (len(heads) - 1)
    again, found = recover(tmp_path)
    assert exported(again) == exported(live) and not found.reason


def copy_state(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        if p.name != "LOCK":
            shutil.copy(p, dst / p.name)
    return dst


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


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
    state, wal = fresh(incarnation=2), WriteAheadLog(crash, fsync=True, snapshot_log_bytes=1 << 30)
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
    offset, size = snapshot_head(tmp_path)["refs"][1]
    segment = tmp_path / "wal-0.log"
    with segment.open("r+b") as f:  # flip one byte inside the second group's record
        f.seek(offset + size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    wal = WriteAheadLog(tmp_path, fsync=False, snapshot_log_bytes=1 << 30)
    with pytest.raises(ValueError, match=rf"damaged record at byte {offset} of \S*wal-0.log "
                                         r"\(checksum mismatch\)"):  # fmt: skip
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
