"""The syncer's writes of log segments with O_DIRECT, past the page cache.

    records (zmq frames, packed headers) --copy--> staging buffer (8 MiB, allocated once)
        --pwrite, whole 4 KiB blocks--> segment file          (then fdatasync, in the syncer)

A buffered write has the kernel allocate a page-cache page for every 4 KiB of log, which on a
virtual machine whose free memory the host has taken back costs several times the copy itself
(the durable hub's largest cost at 256 KB groups when it wrote through the page cache). Here
the only copy is into a staging buffer that stays resident, and the disk reads it directly.
Each write starts at the block holding the log's end (its head is the tail kept from the last
write, or read back after a recovery) and ends with the end marker `END` and zeros up to a block
boundary; the next write overwrites them. Where the filesystem refuses O_DIRECT (tmpfs, some
overlays), the writes go through the page cache as before.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from typing import Any

import numpy as np

from replay.wal_records import END, write_buffers

BLOCK = 4096  # alignment of O_DIRECT offsets, lengths and memory
STAGING_BYTES = 8 << 20


class DirectWriter:
    """Writes records at an offset of a segment (`write`), with O_DIRECT where it can."""

    def __init__(self) -> None:
        self.mm = mmap.mmap(-1, STAGING_BYTES)  # page-aligned
        self.staging = np.frombuffer(self.mm, np.uint8)
        self.fd, self.direct = -1, False
        self.tail, self.tail_end = b"", -1  # the last block's records and where they end

    def write(self, fd: int, buffers: list[Any], offset: int) -> None:
        """Write `buffers` (a commit's records, maybe ending in `END`) at `offset` of `fd`."""
        if fd != self.fd:
            self.fd, self.direct, self.tail_end = fd, _set_direct(fd, True), -1
        if self.direct:
            try:
                self._write_direct(fd, [b for b in buffers if b is not END], offset)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = _set_direct(fd, False)  # refused after all: through the cache
        write_buffers(fd, buffers, offset)

    def _write_direct(self, fd: int, buffers: list[Any], offset: int) -> None:
        start = offset - offset % BLOCK
        n, pos = offset - start, start  # the last block's records come first
        if offset == self.tail_end:
            self.staging[:n] = np.frombuffer(self.tail, np.uint8)
        elif n:  # read back (aligned, as O_DIRECT wants) after a restart
            with memoryview(self.mm) as view:
                got = os.preadv(fd, [view[:BLOCK]], start)
            assert got >= n, "the log's last block is shorter than its records"
        limit = STAGING_BYTES - BLOCK  # room for the end marker and the padding
        for part in buffers:
            src = np.frombuffer(part, np.uint8)
            i = 0
            while i < src.size:
                k = min(src.size - i, limit - n)
                self.staging[n : n + k] = src[i : i + k]
                n, i = n + k, i + k
                if n == limit:
                    self._pwrite(fd, pos, n)
                    pos, n = pos + n, 0
        total = -(-(n + len(END)) // BLOCK) * BLOCK
        self.staging[n:total] = 0  # END, then zeros to the block boundary
        self._pwrite(fd, pos, total)
        keep = n % BLOCK
        self.tail, self.tail_end = bytes(self.staging[n - keep : n]), pos + n

    def _pwrite(self, fd: int, pos: int, n: int) -> None:
        with memoryview(self.mm) as view:
            written = os.pwrite(fd, view[:n], pos)
        if written != n:
            raise OSError(errno.EIO, f"short O_DIRECT write ({written} of {n} bytes)")

    def close(self) -> None:
        del self.staging
        self.mm.close()


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for `fd`; whether it is on."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError:
        return False
    return on
