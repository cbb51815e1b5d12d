"""The hub's write-ahead log: records, group commit, snapshots, recovery (`replay.durability`).

    HubState op --journal--> WriteAheadLog.append  (kept in memory: a list of buffers)
    end of each loop turn --> commit(): the pending records go to the syncer thread, which
                              writes them (writev, no copy but the kernel's) and fsyncs, one
                              fsync for everything queued meanwhile (the loop goes on
                              receiving), then wakes the loop through a pipe; the hub releases
                              a turn's Acks and Batches once `durable_lsn` covers its records
    log > snapshot_log_bytes --> snapshot(): state + groups to snapshot.tmp, fsync, rename;
                                 a new log segment starts and the old one is deleted

On disk (`replay.state_dir`): `snapshot.bin` (absent before the first snapshot), `wal-<N>.log`
(N = the snapshot's `log_id`: the log of the ops that followed it) and `LOCK` (one hub per
directory). A record is `u32 body_len, u64 xxh3_64(body), body` (xxh3: a 64-bit checksum
about 8x cheaper than zlib's crc32 on 256 KB groups); body = `u32 meta_len`,
msgpack `[op, args, [frame lengths]]`, then the frames (a Group's received wire frames, not
re-encoded). Recovery loads the snapshot, then replays the log record by record with
`HubState.apply`, and stops at the first record that is torn (the file ends inside it) or
corrupt (bad length or checksum): that record and everything after it is never loaded, and the
file is cut there so new records never follow garbage. Nothing was acknowledged for such a
record (acks leave only after the commit that wrote it), so skipping it loses nothing promised.

`fsync = "commit"` makes every commit reach the disk before its acks (survives power loss);
`"off"` leaves flushing to the OS (survives a killed hub process, not a crashed machine).
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import msgpack
import xxhash

from asyncrl.protocol import Group, decode, encode
from replay.state import HubState

log = logging.getLogger("asyncrl.replay")
HEADER = struct.Struct("<IQ")  # body length, xxh3_64 of the body
META_LEN = struct.Struct("<I")
MAX_RECORD_BYTES = 1 << 31  # a longer length field is corruption, not a record
IOV_MAX = 512  # buffers per writev call


@dataclass
class Recovery:
    """What `recover` found: ops replayed, groups restored, and the tail it refused."""

    snapshot_groups: int = 0
    ops: int = 0
    skipped_bytes: int = 0
    reason: str = ""  # why the log ended before the file did ("" = it did not)


def pack_record(op: str, args: dict[str, Any], frames: Sequence[Any]) -> list[Any]:
    """The buffers of one record (header first), ready for writev; frames are not copied."""
    views = [memoryview(f).cast("B") for f in frames]
    meta = msgpack.packb([op, args, [v.nbytes for v in views]], use_bin_type=True)
    parts: list[Any] = [META_LEN.pack(len(meta)), meta, *views]
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    body_len = sum(memoryview(p).nbytes for p in parts)
    return [HEADER.pack(body_len, digest.intdigest()), *parts]


def read_records(f: BinaryIO) -> Iterator[tuple[int, str, dict[str, Any], list[bytes]]]:
    """(offset after the record, op, args, frames) for each sound record; raises `TornRecord`
    at the first record that is incomplete or fails its checksum."""
    offset = 0
    while True:
        head = f.read(HEADER.size)
        if not head:
            return
        if len(head) < HEADER.size:
            raise TornRecord(offset, "torn record header")
        body_len, checksum = HEADER.unpack(head)
        if not META_LEN.size <= body_len < MAX_RECORD_BYTES:
            raise TornRecord(offset, f"impossible record length {body_len}")
        body = f.read(body_len)
        if len(body) < body_len:
            raise TornRecord(offset, f"torn record ({len(body)} of {body_len} bytes)")
        if xxhash.xxh3_64_intdigest(body) != checksum:
            raise TornRecord(offset, "checksum mismatch")
        yield offset + HEADER.size + body_len, *_parse_body(memoryview(body), offset)
        offset += HEADER.size + body_len


def _parse_body(body: memoryview, offset: int) -> tuple[str, dict[str, Any], list[bytes]]:
    (meta_len,) = META_LEN.unpack_from(body)
    start = META_LEN.size + meta_len
    try:
        op, args, lengths = msgpack.unpackb(body[META_LEN.size : start], raw=False)
    except (ValueError, msgpack.ExtraData) as exc:
        raise TornRecord(offset, f"unreadable record meta: {exc}") from exc
    frames = []
    for n in lengths:
        frames.append(bytes(body[start : start + n]))
        start += n
    return op, args, frames


class TornRecord(Exception):
    """A record that cannot be trusted, at byte `offset` of its file."""

    def __init__(self, offset: int, why: str) -> None:
        super().__init__(f"{why} at byte {offset}")
        self.offset, self.why = offset, why


class Syncer:
    """Writes and fsyncs on a thread of its own: `request(fd, lsn, buffers)` queues `buffers`
    for `fd` and asks for everything up to `lsn` to reach the disk; `synced` then covers `lsn`,
    and a byte on `wake_fd` says so. Copying records into the page cache is a commit's largest
    cost after the fsync (most of a durable hub's loop time when the loop did it), so the
    hub's loop does neither."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.fd, self.target, self.synced = -1, 0, 0
        self.queue: list[Any] = []  # buffers to write to `fd` before the next fsync
        self.error: OSError | None = None
        self.stopping = False
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)
        self.thread = threading.Thread(target=self._run, name="asyncrl-wal-fsync", daemon=True)
        self.thread.start()

    def request(self, fd: int, lsn: int, buffers: list[Any]) -> None:
        with self.cond:
            assert fd == self.fd or not self.queue, "a new log segment before the old one synced"
            self.fd, self.target = fd, max(self.target, lsn)
            self.queue.extend(buffers)
            self.cond.notify_all()

    def wait(self, lsn: int) -> None:
        """Block until `lsn` is synced (snapshots and shutdown only)."""
        with self.cond:
            self.cond.wait_for(lambda: self.synced >= lsn or self.error is not None)

    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.stopping or self.target > self.synced)
                if self.target <= self.synced:
                    return  # stopping, nothing left to sync
                fd, target = self.fd, self.target
                buffers, self.queue = self.queue, []
            try:
                write_buffers(fd, buffers)
                os.fsync(fd)
            except OSError as exc:  # the disk failed: the hub stops acknowledging and exits
                with self.cond:
                    self.error = exc
                    self.cond.notify_all()
                return
            with self.cond:
                self.synced = target
                self.cond.notify_all()
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # a wake-up is already pending

    def drain(self) -> None:
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join()
        os.close(self.wake_fd)
        os.close(self._wake_w)


class WriteAheadLog:
    """The log of one hub state directory; `journal` is what HubState records through. With
    `background`, writes and fsyncs run on a `Syncer` thread (the hub's loop); without, in
    `commit`."""

    def __init__(self, directory: str | Path, *, fsync: bool, snapshot_log_bytes: int,
                 background: bool = False) -> None:  # fmt: skip
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = (self.dir / "LOCK").open("a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"replay.state_dir {self.dir}: another hub is using it") from None
        self.fsync, self.snapshot_log_bytes = fsync, snapshot_log_bytes
        self.log_id = 0
        self.fd = -1
        self.pending: list[Any] = []
        self.lsn = 0  # bytes appended by this process (log position of the latest record)
        self.written_lsn = 0  # handed to the kernel (with a syncer: to the syncer)
        self.syncer = Syncer() if fsync and background else None
        self.log_bytes = 0  # size of the current segment, pending records included
        self.num_commits = 0
        self.num_snapshots = 0
        self.snapshot_bytes = 0  # size of the latest snapshot

    # --- writing --------------------------------------------------------------------------------

    def journal(self, op: str, args: dict[str, Any], frames: Sequence[Any]) -> int:
        """Append one record (written at the next `commit`); returns its log position."""
        parts = pack_record(op, args, frames)
        size = HEADER.size + HEADER.unpack(parts[0])[0]
        self.pending.extend(parts)
        self.lsn += size
        self.log_bytes += size
        return self.lsn

    def commit(self) -> int:
        """Write every pending record with one writev per IOV_MAX buffers, then fsync (policy);
        returns the durable log position."""
        if not self.pending:
            return self.durable_lsn
        pending, self.pending = self.pending, []
        if self.syncer is not None:  # written and fsynced on the syncer thread
            self.syncer.request(self.fd, self.lsn, pending)
        else:
            write_buffers(self.fd, pending)
            if self.fsync:
                os.fsync(self.fd)
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
        """Commit and wait until everything logged so far is durable."""
        self.commit()
        if self.syncer is not None:
            self.syncer.wait(self.lsn)

    def due_for_snapshot(self) -> bool:
        """The log outgrew `snapshot_log_bytes` and the last snapshot (so snapshot work stays
        proportional to what was logged)."""
        return self.log_bytes >= max(self.snapshot_log_bytes, self.snapshot_bytes)

    def snapshot(self, state: HubState) -> None:
        """Write the whole state as a new snapshot and start an empty log segment after it."""
        self.sync()  # no fsync of the old segment may be in flight when it goes
        meta, groups = state.export()
        tmp = self.dir / "snapshot.tmp"
        with tmp.open("wb") as f:
            head = {"log_id": self.log_id + 1, "groups": len(groups), "meta": meta}
            _write_all(f, pack_record("snapshot", head, ()))
            for group in groups:
                _write_all(f, pack_record("group", {}, encode(group)))
            f.flush()
            os.fsync(f.fileno())
            self.snapshot_bytes = f.tell()
        os.replace(tmp, self.dir / "snapshot.bin")
        _fsync_dir(self.dir)
        old = self._segment(self.log_id)
        self.open_segment(self.log_id + 1)
        old.unlink(missing_ok=True)
        self.num_snapshots += 1

    def open_segment(self, log_id: int) -> None:
        """Append to `wal-<log_id>.log` from now on (created if absent)."""
        if self.fd >= 0:
            os.close(self.fd)
        self.log_id = log_id
        path = self._segment(log_id)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.log_bytes = os.fstat(self.fd).st_size
        _fsync_dir(self.dir)

    def close(self) -> None:
        if self.fd >= 0:
            self.sync()
            os.close(self.fd)
            self.fd = -1
        if self.syncer is not None:
            self.syncer.close()
        self._lock.close()

    def _segment(self, log_id: int) -> Path:
        return self.dir / f"wal-{log_id}.log"

    # --- recovery -------------------------------------------------------------------------------

    def recover(self, state: HubState) -> Recovery:
        """Load the snapshot and replay the log into a fresh `state`; leaves the log open for
        appending after its last sound record."""
        found = Recovery()
        log_id = 0
        snapshot = self.dir / "snapshot.bin"
        if snapshot.exists():
            log_id, found.snapshot_groups = _load_snapshot(snapshot, state)
        path = self._segment(log_id)
        if path.exists():
            with path.open("rb") as f:
                end = 0
                try:
                    for after, op, args, frames in read_records(f):
                        state.apply(op, args, frames)
                        found.ops += 1
                        end = after
                except TornRecord as exc:
                    found.reason = str(exc)
                    found.skipped_bytes = path.stat().st_size - exc.offset
                    log.warning("replay state: log %s ends in a bad record (%s); %d bytes "
                                "after the last sound record are skipped", path, exc,
                                found.skipped_bytes)  # fmt: skip
                    end = exc.offset
            os.truncate(path, end)
        self.open_segment(log_id)
        return found


def _load_snapshot(path: Path, state: HubState) -> tuple[int, int]:
    """Restore `state` from a snapshot file: (the log id that follows it, groups restored)."""
    with path.open("rb") as f:
        try:
            records = read_records(f)
            _, op, head, _ = next(records)
            assert op == "snapshot", op
            groups = []
            for _ in range(head["groups"]):
                _, _, _, frames = next(records)
                group = decode(frames, 1 << 62, check_values=False)
                assert isinstance(group, Group)
                groups.append(group)
        except (TornRecord, StopIteration) as exc:
            raise ValueError(f"replay state: snapshot {path} is damaged ({exc!r})") from exc
    state.restore(head["meta"], groups)
    return head["log_id"], len(groups)


def write_buffers(fd: int, buffers: list[Any]) -> None:
    """Write `buffers` in order, one writev per IOV_MAX of them (no copies in user space)."""
    for i in range(0, len(buffers), IOV_MAX):
        chunk = buffers[i : i + IOV_MAX]
        written = os.writev(fd, chunk)
        total = sum(memoryview(p).nbytes for p in chunk)
        if written < total:  # a short write (a signal, a full disk): write the rest plainly
            os.write(fd, b"".join(bytes(memoryview(p)) for p in chunk)[written:])


def _write_all(f: BinaryIO, parts: list[Any]) -> None:
    for part in parts:
        f.write(part)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
