"""The hub's snapshot file (`snapshot.bin`): writing one off the hub's loop, and loading one.

A snapshot is taken when the log switches from segment K to segment K+1. It holds a head record
(`snapshot`: the state's meta, `log_id` = K+1, the log replayed after it, and one entry per
exported group) and then an inline `group` record for each group that has no reference:

    head refs:  [ [log_id, offset, size] | None , ... ]   one per group, in `HubState.export` order
      [j, offset, size]: the group is the `store` record at `offset` of wal-j.log (`size`
                      bytes), with K - keep + 1 <= j <= K (`keep` = replay.snapshot_keep_segments):
                      a closed segment, already on disk
      None:           the group follows inline (stored in an older segment)

A group referenced once stays referenced by later snapshots while its segment is among the
`keep` newest closed ones (recovery re-learns where referenced groups are), so a buffer that
spans several segments is not rewritten by every snapshot. Snapshots written before per-group
segment ids (`ref_log` = K in the head, refs [offset, size] into wal-K) still load.

After the rename the snapshot, wal-K+1 and the segments it references are needed: of the older
segments the newest is kept as the spare (`wal-spare-<id>.log`) the next segment is recycled
from (its pages stay in the page cache and its blocks allocated, so writing the log does not
allocate either), the others are deleted. The head is encoded on the loop at the switch (later changes cannot leak
in; the exported groups are immutable); `SnapshotJob.run` writes the file, on the syncer thread
in the hub.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from asyncrl.protocol.codec import decode, encode
from asyncrl.protocol.messages import Group
from replay.core import HubState
from replay.wal_records import TornRecord, fsync_dir, pack_record, read_record, read_records

SEGMENT = re.compile(r"wal-(\d+)\.log")
SPARE = re.compile(r"wal-spare-(\d+)\.log")


def segment_path(directory: Path, log_id: int) -> Path:
    return directory / f"wal-{log_id}.log"


def segment_ids(directory: Path) -> list[int]:
    """The ids of the log segments in `directory`, ascending."""
    return sorted(int(m[1]) for p in directory.iterdir() if (m := SEGMENT.fullmatch(p.name)))


def retire(segments: list[Path]) -> None:
    """Segments no longer needed: the newest becomes the spare (any older spare goes), the
    others are deleted."""
    if not segments:
        return
    directory = segments[0].parent
    for old in directory.glob("wal-spare-*.log"):
        old.unlink()
    *rest, newest = sorted(segments, key=lambda p: int(p.name[4:-4]))
    for path in rest:
        path.unlink(missing_ok=True)
    os.rename(newest, directory / f"wal-spare-{newest.name[4:-4]}.log")


def take_spare(path: Path) -> int:
    """Rename the spare segment (if any) to `path`; returns the id it had (-1: no spare)."""
    for spare in path.parent.glob("wal-spare-*.log"):
        if m := SPARE.fullmatch(spare.name):
            os.rename(spare, path)
            return int(m[1])
    return -1


@dataclass
class SnapshotJob:
    """One snapshot, prepared on the loop at a segment switch; `run` writes it to disk."""

    directory: Path
    head: list[Any]  # the packed head record: meta and references, encoded at the switch
    inline: list[Group]  # groups copied into the file (no reference to them)
    kept: dict[Any, tuple[int, int, int]]  # (actor_id, seq) -> where the snapshot references it
    old_fd: int  # the segment being closed: written (and fsynced) before `run`, closed by it
    keep_from: int  # the oldest segment the new snapshot needs
    fsync: bool
    num_bytes: int = 0  # the file's size, once written

    def run(self) -> list[Path]:
        """Write snapshot.tmp, fsync it, rename it to snapshot.bin, fsync the directory (which
        also makes the new segment's file durable), close the old segment. Returns the
        segments no longer needed: the caller retires them."""
        tmp = self.directory / "snapshot.tmp"
        with tmp.open("wb") as f:
            _write_all(f, self.head)
            for group in self.inline:
                _write_all(f, pack_record("group", {}, encode(group)))
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
            self.num_bytes = f.tell()
        os.replace(tmp, self.directory / "snapshot.bin")
        if self.fsync:
            fsync_dir(self.directory)
        if self.old_fd >= 0:
            os.close(self.old_fd)
        return [
            segment_path(self.directory, i)
            for i in segment_ids(self.directory)
            if i < self.keep_from
        ]


def prepare(
    directory: Path,
    state: HubState,
    log_id: int,
    stored_at: dict[Any, tuple[int, int, int]],
    old_fd: int,
    fsync: bool,
    keep_segments: int = 1,
) -> SnapshotJob:
    """The snapshot of `state` as segment `log_id` closes: a reference for each group whose
    store record `stored_at` locates in one of the `keep_segments` newest closed segments
    (`log_id` and before), the others inline."""
    meta, groups = state.export()
    oldest = log_id - keep_segments + 1
    refs: list[Any] = []
    inline: list[Group] = []
    kept: dict[Any, tuple[int, int, int]] = {}
    for g in groups:
        key = (g.actor_id, g.seq)
        at = stored_at.get(key)
        if at is not None and at[0] >= oldest:
            refs.append(list(at))
            kept[key] = at
        else:
            refs.append(None)
            inline.append(g)
    head = {"log_id": log_id + 1, "groups": len(groups), "refs": refs, "meta": meta}
    keep_from = min((at[0] for at in kept.values()), default=log_id + 1)
    return SnapshotJob(
        directory, pack_record("snapshot", head, ()), inline, kept, old_fd, keep_from, fsync
    )


@dataclass
class Loaded:
    """What `load_snapshot` restored: the log to replay after it, the oldest segment it needs."""

    log_id: int
    keep_from: int
    num_groups: int
    num_referenced: int
    refs: dict[Any, tuple[int, int, int]]  # (actor_id, seq) -> (log_id, offset, size)


def load_snapshot(path: Path, state: HubState) -> Loaded:
    """Restore `state` from a snapshot file, reading referenced groups from their segment."""
    with path.open("rb") as f:
        try:
            records = read_records(f)
            _, op, head, _ = next(records)
            assert op == "snapshot", op
            refs = [_where(r, head) for r in head.get("refs") or [None] * head["groups"]]
            segments: dict[int, BinaryIO] = {}
            try:
                frames = [
                    next(records)[3] if r is None else _referenced(path, segments, *r) for r in refs
                ]
            finally:
                for seg in segments.values():
                    seg.close()
        except (TornRecord, StopIteration) as exc:
            raise ValueError(f"replay state: snapshot {path} is damaged ({exc!r})") from exc
        except FileNotFoundError as exc:
            raise ValueError(
                f"replay state: snapshot {path} references {exc.filename}, which is missing"
            ) from exc
    groups = [_group(fs) for fs in frames]
    state.restore(head["meta"], groups)
    where = {(g.actor_id, g.seq): r for g, r in zip(groups, refs, strict=True) if r is not None}
    keep_from = min((r[0] for r in where.values()), default=head["log_id"])
    return Loaded(head["log_id"], keep_from, len(groups), len(where), where)


def _where(ref: list[int] | None, head: dict[str, Any]) -> tuple[int, int, int] | None:
    """A head's reference as (log_id, offset, size); [offset, size] is the earlier format,
    into the segment `ref_log`."""
    if ref is None:
        return None
    return (head["ref_log"], *ref) if len(ref) == 2 else tuple(ref)  # type: ignore[return-value]


def _referenced(
    path: Path, segments: dict[int, BinaryIO], log_id: int, offset: int, size: int
) -> list[bytes]:
    """The frames of the store record at `offset` of wal-`log_id`.log; a ValueError naming both
    files and the offset when it is not there whole."""
    segment = segment_path(path.parent, log_id)
    f = segments.get(log_id)
    if f is None:
        f = segments[log_id] = segment.open("rb")
    try:
        record = read_record(f, offset, seed=log_id)
        why = "end of file" if record is None else ""
    except TornRecord as exc:
        record, why = None, exc.why
    if record is not None and record[0] - offset != size:
        why = f"a record of {record[0] - offset} bytes, not {size}"
    elif record is not None and record[1] != "store":
        why = f"a {record[1]!r} record, not a store"
    if why:
        raise ValueError(
            f"replay state: snapshot {path} references a damaged record at byte "
            f"{offset} of {segment} ({why})"
        )
    assert record is not None
    return record[3]


def _group(frames: list[bytes]) -> Group:
    group = decode(frames, 1 << 62, check_values=False)
    assert isinstance(group, Group)
    return group


def _write_all(f: BinaryIO, parts: list[Any]) -> None:
    for part in parts:
        f.write(part)
