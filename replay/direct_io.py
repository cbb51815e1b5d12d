"""The syncer's writes of log segments with O_DIRECT, past the page cache.

    records (zmq frames, packed headers) --placed frames: their own memory-----> pwritev, whole
                                         --the rest: copy--> staging buffer -->   4 KiB blocks,
                                                              (8 MiB, once)       at the segment
                                                                                  (then fdatasync)

A buffered write has the kernel allocate a page-cache page for every 4 KiB of log, which on a
virtual machine whose free memory the host has taken back costs several times the copy itself
(the durable hub's largest cost at 256 KB groups when it wrote through the page cache). O_DIRECT
wants the memory, the offset and the length of each buffer aligned to a block, which received
frames are not; so the log places each large frame (replay/wal_records.py: a gap before it)
where its offset in the file and its address agree within a block. Its blocks are then written
from the frame itself; only its ends (less than a block each), the gaps and the small records
are copied into a staging buffer that stays resident. A frame that is not placed (its address
does not agree: a snapshot's record, a recovered one) is copied whole, as every byte was before.
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

from replay.wal_records import BLOCK, END, IOV_MAX, PLACED_BYTES, address, write_buffers

STAGING_BYTES = 8 << 20
LIMIT = STAGING_BYTES - BLOCK  # room for the end marker and the padding


class DirectWriter:
    """Writes records at an offset of a segment (`write`), with O_DIRECT where it can. While a
    write runs, `iov` holds what the next pwritev writes at `pos` (`iov_bytes` of it): staging
    regions and frames' blocks; `staging[region:filled]` is the region not yet in it. Regions
    start at a block of the staging buffer and of the file, so each ends on one when cut."""

    def __init__(self) -> None:
        self.mm = mmap.mmap(-1, STAGING_BYTES)  # page-aligned
        self.staging = np.frombuffer(self.mm, np.uint8)
        self.view = memoryview(self.mm)
        self.fd, self.direct = -1, False
        self.tail, self.tail_end = b"", -1  # the last block's records and where they end
        self.iov: list[Any] = []
        self.pos = self.iov_bytes = self.region = self.filled = 0
        self.placed_bytes = self.copied_bytes = 0  # written from frames / through the staging

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
        n = offset - start  # the last block's records come first
        if offset == self.tail_end:
            self.staging[:n] = np.frombuffer(self.tail, np.uint8)
        elif n:  # read back (aligned, as O_DIRECT wants) after a restart
            with memoryview(self.mm) as view:
                got = os.preadv(fd, [view[:BLOCK]], start)
            assert got >= n, "the log's last block is shorter than its records"
        self.iov, self.pos, self.iov_bytes, self.region, self.filled = [], start, 0, 0, n
        view = self.view
        for part in buffers:
            size = len(part)  # bytes, or a memoryview of bytes
            if size < PLACED_BYTES and self.filled + size < LIMIT:  # a small one: copied
                view[self.filled : self.filled + size] = part
                self.filled += size
                self.copied_bytes += size
                continue
            src = np.frombuffer(part, np.uint8)
            i = self._place(fd, src) if src.size >= PLACED_BYTES else 0
            self.copied_bytes += src.size - i
            while i < src.size:
                k = min(src.size - i, LIMIT - self.filled)
                self.staging[self.filled : self.filled + k] = src[i : i + k]
                self.filled, i = self.filled + k, i + k
                if self.filled == LIMIT:
                    self._cut()
                    self._pwritev(fd)
        end = self.filled
        self.tail_end = self.pos + self.iov_bytes + end - self.region
        self.tail = bytes(self.staging[end - end % BLOCK : end])
        self.filled = -(-(end + len(END)) // BLOCK) * BLOCK
        self.staging[end : self.filled] = 0  # END, then zeros to the block boundary
        self._cut()
        self._pwritev(fd)

    def _place(self, fd: int, src: np.ndarray) -> int:
        """Queue the whole blocks of `src` to be written from its memory when its address and
        its place in the file agree within a block (after its head, copied); returns where
        the rest of it, still to copy, starts (0: none of it placed)."""
        here = self.pos + self.iov_bytes + self.filled - self.region  # src[0]'s file offset
        skip = -address(src) % BLOCK
        whole = (src.size - skip) // BLOCK * BLOCK
        if (here + skip) % BLOCK or whole == 0 or self.filled + skip > LIMIT:
            return 0
        self.staging[self.filled : self.filled + skip] = src[:skip]
        self.filled += skip
        self.copied_bytes += skip
        self._cut()
        self.iov.append(src[skip : skip + whole])
        self.iov_bytes += whole
        self.placed_bytes += whole
        if len(self.iov) >= IOV_MAX - 2:
            self._pwritev(fd)
        return skip + whole

    def _cut(self) -> None:
        """End the staging region at `filled` (a block boundary of the file) and queue it."""
        if self.filled > self.region:
            self.iov.append(self.staging[self.region : self.filled])
            self.iov_bytes += self.filled - self.region
            self.region = self.filled

    def _pwritev(self, fd: int) -> None:
        """Write what is queued (no staging region left uncut); the staging is free again."""
        written = os.pwritev(fd, self.iov, self.pos)
        if written != self.iov_bytes:
            raise OSError(errno.EIO, f"short O_DIRECT write ({written} of {self.iov_bytes} bytes)")
        self.pos += written
        self.iov, self.iov_bytes, self.region, self.filled = [], 0, 0, 0

    def close(self) -> None:
        self.iov = []
        del self.staging
        self.view.release()
        self.mm.close()


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for `fd`; whether it is on."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError:
        return False
    return on
