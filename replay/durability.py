"""The hub's write-ahead log: group commit, the syncer thread, snapshots, recovery
(`replay.durability`).

    HubState op --journal--> WriteAheadLog.append  (kept in memory: a list of buffers)
    end of each loop turn --> commit(): the pending records go to the syncer thread as a write
                              job; it writes them (O_DIRECT: large frames from their own memory) and
                              fdatasyncs, one sync for everything queued meanwhile (the loop
                              goes on receiving), then wakes the loop through a pipe; the hub
                              releases a turn's Acks and Batches once `durable_lsn` covers them
    segment > snapshot_log_bytes --> snapshot(): the loop exports the state (meta encoded, groups
                              referenced or kept as immutable objects), writes to a new segment
                              from then on and queues a snapshot job between the two segments'
                              write jobs; the syncer runs the jobs in order:

        writes to wal-K (sync) -> snapshot.tmp, fsync, rename to snapshot.bin, fsync dir
          -> writes to wal-K+1 (sync) -> `synced` covers them -> wal-K-1 becomes the spare

On disk (`replay.state_dir`): `snapshot.bin` (absent before the first snapshot; see
replay/snapshot.py), `wal-<N>.log` segments, at most one `wal-spare-<N>.log` and `LOCK` (one hub
per directory). The snapshot names the segment replayed after it (`log_id` = K+1) and, per
buffered or lent group, the segment and offset of its `store` record, if that is one of the
`replay.snapshot_keep_segments` newest closed segments (K and before); groups stored earlier
are copied into the snapshot. A new segment is the spare renamed and overwritten in place (its
pages stay cached and its blocks allocated, so the log's writes allocate neither; its first
record, `segment`, says it was recycled and each commit in it ends with an end marker, a header
of zeros, before the file's earlier content) or, when there is none, a new file. Bound on disk
use: the snapshot (meta, one reference per group, at most capacity groups copied inline) plus
`snapshot_keep_segments` + 2 segments (the referenced ones up to wal-K, wal-K+1, the spare) of
about `snapshot_log_bytes` each; one snapshot is written at a time (the loop waits for the
previous one before it switches again), and while it is, snapshot.tmp too. Record format and checksums
(seeded with the segment id): replay/wal_records.py. Record kinds: one per HubState op in the
log (`begin`, `store` with the group's wire frames, `issue`, `hand_out`, ...) plus `segment`;
`snapshot` and `group` in the snapshot file.

Nothing of wal-K+1 is acknowledged before the snapshot that makes it replayable is renamed into
place, so a crash at any step recovers: before the rename, the old snapshot + wal-K (wal-K+1 is
deleted at recovery, never written to again); after it, the new snapshot + wal-K+1 and the segments it
references (a leftover older segment is deleted). Recovery loads the snapshot (reading referenced records by offset, checked
like any record), then replays the current segment record by record with `HubState.apply`, and
stops at the first record that is torn (the file ends inside it) or corrupt (bad length or
checksum): that record and everything after it is never loaded, and the file is cut there so new
records never follow garbage (in a recycled segment the end marker is where its records end:
nothing is cut, the next commit overwrites from there). Nothing was acknowledged for such a record (acks leave only after
the commit that wrote it), so skipping it loses nothing promised.

`fsync = "commit"` makes every commit reach the disk before its acks (survives power loss);
`"off"` leaves flushing to the OS (survives a killed hub process, not a crashed machine).
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config import ReplayConfig
from asyncrl.protocol.codec import decode
from asyncrl.protocol.messages import Group
from replay.core import HubState
from replay.snapshot import (
    SnapshotJob,
    load_snapshot,
    prepare,
    retire,
    segment_ids,
    segment_path,
    take_spare,
)
from replay.syncer import Syncer
from replay.wal_records import (
    END,
    END_MARKER,
    HEADER,
    TornRecord,
    fsync_dir,
    pack_record,
    read_records,
    record_size,
    write_buffers,
)

__all__ = ["HEADER", "Recovery", "Syncer", "WriteAheadLog", "pack_record", "read_records"]
log = logging.getLogger("asyncrl.replay")
Write = tuple[int, int, list[Any], int]  # a write job: fd, log position after it, buffers, offset


@dataclass
class Recovery:
    """What `recover` found: ops replayed, groups restored, and the tail it refused."""

    snapshot_groups: int = 0
    ops: int = 0
    skipped_bytes: int = 0
    reason: str = ""  # why the log ended before the file did ("" = it did not)


class WriteAheadLog:
    """The log of one hub state directory; `journal` is what HubState records through. With
    `background`, writes, fsyncs and snapshot files are done on a `Syncer` thread (the hub's
    loop); without, in `commit` and `snapshot`."""

    def __init__(
        self,
        directory: str | Path,
        *,
        fsync: bool,
        snapshot_log_bytes: int,
        background: bool = False,
        keep_segments: int = ReplayConfig.snapshot_keep_segments,
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = (self.dir / "LOCK").open("a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"replay.state_dir {self.dir}: another hub is using it") from None
        self.fsync, self.snapshot_log_bytes = fsync, snapshot_log_bytes
        self.keep_segments = keep_segments  # closed segments a snapshot may reference groups in
        self.log_id = 0
        self.fd = -1
        self.pending: list[Any] = []
        self.pending_bytes = 0
        self.recycled = False  # the current segment is a recycled file: commits end with END
        self.lsn = 0  # bytes appended by this process (log position of the latest record)
        self.written_lsn = 0  # handed to the kernel (with a syncer: to the syncer)
        self.syncer = Syncer() if fsync and background else None
        self.log_bytes = 0  # size of the current segment, pending records included
        # (actor_id, seq) -> (log_id, offset, size) of a group's store record, for the groups
        # of the current segment and those the latest snapshot references
        self.stored_at: dict[tuple[str, int], tuple[int, int, int]] = {}
        self.last_snapshot: SnapshotJob | None = None
        self.snapshot_job = 0  # the syncer's number for the latest snapshot job
        self.num_commits = 0
        self.num_snapshots = 0

    # --- writing --------------------------------------------------------------------------------

    def journal(
        self,
        op: str,
        args: dict[str, Any],
        frames: Sequence[Any],
        key: tuple[str, int] | None = None,
    ) -> int:
        """Append one record (written at the next `commit`); returns its log position. `key`:
        the (actor_id, seq) of the group a `store` record holds (a snapshot may reference it)."""
        at = self.log_bytes if self.syncer is not None else None  # placed for O_DIRECT
        parts = pack_record(op, args, frames, seed=self.log_id, at=at)
        size = record_size(parts)
        if key is not None:
            self.stored_at[key] = (self.log_id, self.log_bytes, size)
        self.pending.extend(parts)
        self.pending_bytes += size
        self.lsn += size
        self.log_bytes += size
        return self.lsn

    def commit(self) -> int:
        """Write every pending record with one writev per IOV_MAX buffers, then fsync (policy);
        returns the durable log position."""
        if not self.pending:
            return self.durable_lsn
        pending, self.pending = self.pending, []
        offset, self.pending_bytes = self.log_bytes - self.pending_bytes, 0
        if self.recycled:  # overwritten by the next commit
            pending.append(END)
        if self.syncer is not None:  # written and fsynced on the syncer thread
            self.syncer.request(self.fd, self.lsn, pending, offset)
        else:
            write_buffers(self.fd, pending, offset)
            if self.fsync:
                os.fdatasync(self.fd)
        self.written_lsn = self.lsn
        self.num_commits += 1
        return self.durable_lsn

    @property
    def durable_lsn(self) -> int:
        """Log position up to which records are durable under the fsync policy."""
        if self.syncer is None:
            return self.written_lsn
        if self.syncer.error is not None:
            raise RuntimeError(f"replay state: fsync failed: {self.syncer.error}")
        return self.syncer.synced

    def sync(self) -> None:
        """Commit and wait until everything logged so far is durable and the snapshots taken
        so far are in place."""
        self.commit()
        if self.syncer is not None:
            self.syncer.wait()

    @property
    def snapshot_bytes(self) -> int:
        """Size of the latest snapshot file (0 while it is being written)."""
        return self.last_snapshot.num_bytes if self.last_snapshot is not None else 0

    def due_for_snapshot(self) -> bool:
        """The log outgrew `snapshot_log_bytes` and the last snapshot (so snapshot work stays
        proportional to what was logged)."""
        return self.log_bytes >= max(self.snapshot_log_bytes, self.snapshot_bytes)

    def snapshot(self, state: HubState) -> None:
        """Close the current segment with a snapshot of `state` and append to a new one from
        now on. Only the export happens here; the syncer writes the rest of the old segment,
        then the snapshot file, before anything of the new segment counts as synced. One
        snapshot at a time: this waits for the previous one (the syncer is then a whole
        segment behind), which bounds the disk and the syncer's queue."""
        if self.syncer is not None:
            self.syncer.wait(self.snapshot_job)
        self.commit()
        job = prepare(
            self.dir, state, self.log_id, self.stored_at, self.fd, self.fsync, self.keep_segments
        )
        self.stored_at = dict(job.kept)  # still referenceable by the next snapshot
        self.fd = -1  # the job closes it, once its records are on disk
        self.open_segment(self.log_id + 1)
        self.last_snapshot = job
        self.num_snapshots += 1
        if self.syncer is not None:
            self.snapshot_job = self.syncer.snapshot(job)
        else:
            retire(job.run())

    def open_segment(self, log_id: int, at: int | None = None) -> None:
        """Write `wal-<log_id>.log` from now on: from byte `at` of the file (recovery), or, with
        `at` None, a new segment: the spare renamed (its first record, `segment`, says so: the
        records after the last new one are its earlier life's) or a new file. Its directory
        entry becomes durable with the snapshot that names it."""
        if self.fd >= 0:
            os.close(self.fd)
        self.log_id = log_id
        path = segment_path(self.dir, log_id)
        if at is not None:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            self.log_bytes = at
            fsync_dir(self.dir)
            return
        recycled = take_spare(path)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_TRUNC if recycled < 0 else 0), 0o644)
        self.log_bytes, self.recycled = 0, recycled >= 0
        if self.recycled:
            self.journal("segment", {"recycled_from": recycled}, ())

    def close(self) -> None:
        if self.fd >= 0:
            self.sync()
        if self.syncer is not None:
            self.syncer.close()  # after the jobs still queued (a snapshot) are done
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._lock.close()

    # --- recovery -------------------------------------------------------------------------------

    def recover(self, state: HubState) -> Recovery:
        """Load the snapshot and replay the log into a fresh `state`; leaves the log open for
        appending after its last sound record."""
        found = Recovery()
        log_id, keep_from = 0, 0
        snapshot = self.dir / "snapshot.bin"
        if snapshot.exists():
            loaded = load_snapshot(snapshot, state)
            log_id, keep_from, found.snapshot_groups = (
                loaded.log_id,
                loaded.keep_from,
                loaded.num_groups,
            )
            self.stored_at = dict(loaded.refs)  # the next snapshot references them again
        (self.dir / "snapshot.tmp").unlink(missing_ok=True)
        for stale in segment_ids(self.dir):
            if stale > log_id or stale < keep_from:  # a snapshot that never got in / garbage
                log.info(
                    "replay state: deleting %s (not part of the snapshot's log)",
                    segment_path(self.dir, stale),
                )
                segment_path(self.dir, stale).unlink()
        path = segment_path(self.dir, log_id)
        self.log_id = log_id  # the seed of its records
        end = self._replay(path, state, found) if path.exists() else 0
        self.open_segment(log_id, at=end)
        return found

    def _replay(self, path: Path, state: HubState, found: Recovery) -> int:
        """Apply each sound record of the segment at `path`; returns the offset after the
        last. A bad record there is cut off, unless it is the end marker of a recycled segment
        (its earlier content follows: overwritten as the log goes on)."""
        end = 0
        with path.open("rb") as f:
            try:
                for after, op, args, frames in read_records(f, seed=self.log_id):
                    if op == "segment":
                        self.recycled = True
                    else:
                        self._apply(state, op, args, frames, end, after)
                        found.ops += 1
                    end = after
            except TornRecord as exc:
                end = exc.offset
                if exc.why == END_MARKER:  # written by the syncer, or in a recycled segment
                    return end
                found.reason = str(exc)
                found.skipped_bytes = path.stat().st_size - exc.offset
                log.warning(
                    "replay state: log %s ends in a bad record (%s); %d bytes "
                    "after the last sound record are skipped",
                    path,
                    exc,
                    found.skipped_bytes,
                )
        os.truncate(path, end)
        return end

    def _apply(
        self,
        state: HubState,
        op: str,
        args: dict[str, Any],
        frames: list[bytes],
        start: int,
        end: int,
    ) -> None:
        state.apply(op, args, frames)
        if op == "store":  # the next snapshot may reference it
            group = decode(frames, 1 << 62, check_values=False)
            assert isinstance(group, Group)
            self.stored_at[group.actor_id, group.seq] = (self.log_id, start, end - start)


def open_log(state: HubState, rc: ReplayConfig) -> tuple[WriteAheadLog, Recovery]:
    """Durable mode at hub start: recover `state` from `rc.state_dir` (logged), then journal
    every change to it from this process's first op (`begin`) on."""
    if not rc.state_dir:
        raise ValueError("replay.state_dir: durable mode needs a directory")
    wal = WriteAheadLog(
        rc.state_dir,
        fsync=rc.fsync == "commit",
        snapshot_log_bytes=rc.snapshot_log_bytes,
        background=True,
        keep_segments=rc.snapshot_keep_segments,
    )
    incarnation = state.credits.incarnation  # this process's, not the recovered one
    found = wal.recover(state)
    if found.ops or found.snapshot_groups:
        log.info(
            "recovered from %s: %d stored, %d lent groups, policy version %d, %d ops "
            "after the snapshot%s",
            rc.state_dir,
            len(state.buffer),
            sum(map(len, state.lent.values())),
            state.policy_version,
            found.ops,
            f"; skipped a bad tail ({found.reason})" if found.reason else "",
        )
    state.journal = wal.journal
    state.begin(incarnation)
    wal.commit()
    return wal, found
