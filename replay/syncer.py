"""The syncer thread of the hub's write-ahead log: its disk work, in the order it was queued.

    loop: commit() --request(fd, lsn, buffers, offset)--> jobs --> O_DIRECT write + fdatasync
          snapshot() --snapshot(job)----------------------> jobs --> SnapshotJob.run
                                                                   |
          loop's poller <-- a byte on wake_fd <-- `synced` = lsn --+

Consecutive writes share one sync; the writes before a snapshot job are synced before it runs,
the ones after it only after it (so nothing of a new segment counts as synced before the
snapshot that makes it replayable is in place). An error (a failed disk, a snapshot that could
not be written) is kept in `error`: the hub then stops acknowledging and exits.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from replay.direct_io import DirectWriter
from replay.snapshot import SnapshotJob, retire
from replay.wal_records import END

Write = tuple[int, int, list[Any], int]  # a write job: fd, log position after it, buffers, offset


class Syncer:
    """The log's disk work on a thread of its own, in the order it was queued: write jobs
    (`request(fd, lsn, buffers)`: write, fsync, then `synced` covers `lsn` and a byte on
    `wake_fd` says so; consecutive ones share one fsync) and snapshot jobs (`snapshot(job)`).
    Copying records to the disk is a commit's largest cost after the sync (replay/direct_io.py),
    and a snapshot's file work takes tens of milliseconds, so the hub's loop does none of it."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.jobs: list[Write | SnapshotJob] = []
        self.synced = 0
        self.num_queued = self.num_done = 0  # jobs
        self.error: Exception | None = None
        self.stopping = False
        self.writer = DirectWriter()
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)
        self.thread = threading.Thread(target=self._run, name="asyncrl-wal-fsync", daemon=True)
        self.thread.start()

    def request(self, fd: int, lsn: int, buffers: list[Any], offset: int) -> None:
        """Write `buffers` at `offset` of `fd`; `lsn` is the log position after them."""
        self._queue((fd, lsn, buffers, offset))

    def snapshot(self, job: SnapshotJob) -> int:
        """Queue a snapshot job; returns its number for `wait`."""
        return self._queue(job)

    def _queue(self, job: Write | SnapshotJob) -> int:
        with self.cond:
            self.jobs.append(job)
            self.num_queued += 1
            self.cond.notify_all()
            return self.num_queued

    def wait(self, job: int | None = None) -> None:
        """Block until job number `job` (None: every job queued so far) is done."""
        with self.cond:
            last = self.num_queued if job is None else job
            self.cond.wait_for(lambda: self.num_done >= last or self.error is not None)

    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.stopping or bool(self.jobs))
                if not self.jobs:
                    return  # stopping, nothing left to do
                jobs, self.jobs = self.jobs, []
            try:
                retire(self._do(jobs))
                with self.cond:
                    self.num_done += len(jobs)
                    self.cond.notify_all()
            except Exception as exc:  # the disk failed, or a snapshot could not be written:
                # kept for the loop, which stops acknowledging and exits
                with self.cond:
                    self.error = exc
                    self.cond.notify_all()
                self._wake()
                return

    def _do(self, jobs: list[Write | SnapshotJob]) -> list[Path]:
        """Run `jobs` in order; returns the segments the snapshots among them made needless
        (retired once the writes after them are synced: nothing waits for that)."""
        garbage: list[Path] = []
        fd, lsn, buffers, offset = -1, 0, [], 0
        for job in jobs:
            if isinstance(job, SnapshotJob):  # the closing segment is on disk before it
                self._flush(fd, lsn, buffers, offset)
                buffers = []
                garbage += job.run()
                continue
            if job[0] != fd and buffers:
                self._flush(fd, lsn, buffers, offset)
                buffers = []
            if buffers and buffers[-1] is END:  # the next job's records go where it was
                buffers.pop()
            if not buffers:
                offset = job[3]
            fd, lsn = job[0], job[1]
            buffers.extend(job[2])
        self._flush(fd, lsn, buffers, offset)
        return garbage

    def _flush(self, fd: int, lsn: int, buffers: list[Any], offset: int) -> None:
        if not buffers:
            return
        self.writer.write(fd, buffers, offset)
        os.fdatasync(fd)
        with self.cond:
            self.synced = lsn
            self.cond.notify_all()
        self._wake()

    def _wake(self) -> None:
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
        self.writer.close()
        os.close(self.wake_fd)
        os.close(self._wake_w)
