"""The record format of the hub's write-ahead log and snapshots, and the raw file I/O under them.

A record is `u32 body_len, u64 xxh3_64(body), body` (xxh3: a 64-bit checksum about 8x cheaper
than zlib's crc32 on 256 KB groups); body = `u32 meta_len`, msgpack `[op, args, [frame
lengths]]` or `[op, args, [frame lengths], gaps]`, then the frames (a Group's received wire
frames, not re-encoded), each after `gaps[i]` zero bytes when there are gaps (`gaps`: u16 per
frame, little-endian, in a msgpack bin). A record packed for a known offset (`pack_record(at=)`,
the hub's log) puts each frame of `PLACED_BYTES` or more where its offset in the file and its
address in memory are the same modulo `BLOCK`, so that O_DIRECT writes the frame from where it
lies instead of copying it (replay/direct_io.py); the gaps cost < `BLOCK` bytes per such frame. The checksum is
seeded with the id of the log segment the record belongs to (0 in a snapshot), so the records a
recycled segment file still holds from its earlier life never pass for records of the new one.
A reader trusts a record only when its length is possible, the file holds all of it and the
checksum matches; anything else is a `TornRecord` at the record's offset. A header of zeros
(`END`) is the end marker each commit writes after its records in a recycled segment, where the
segment's earlier content follows.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import msgpack
import numpy as np
import xxhash

try:
    from asyncrl.protocol._hotpath import address
except ImportError:  # installed without a C compiler

    def address(buf: Any) -> int:
        """The memory address of a contiguous buffer's first byte."""
        return int(np.frombuffer(buf, np.uint8).ctypes.data)


HEADER = struct.Struct("<IQ")  # body length, xxh3_64 of the body
META_LEN = struct.Struct("<I")
MAX_RECORD_BYTES = 1 << 31  # a longer length field is corruption, not a record
IOV_MAX = 512  # buffers per writev call
END = bytes(HEADER.size)  # the end marker: no record has length 0
END_MARKER = "end marker"
BLOCK = 4096  # alignment of O_DIRECT offsets, lengths and memory
PLACED_BYTES = 4 * BLOCK  # frames this long are placed for O_DIRECT (gaps before them)
_ZEROS = memoryview(bytes(BLOCK))

Record = tuple[int, str, dict[str, Any], list[bytes]]
"""(offset after the record, op, args, frames)."""


class TornRecord(Exception):
    """A record that cannot be trusted, at byte `offset` of its file."""

    def __init__(self, offset: int, why: str) -> None:
        super().__init__(f"{why} at byte {offset}")
        self.offset, self.why = offset, why


def pack_record(
    op: str, args: dict[str, Any], frames: Sequence[Any], seed: int = 0, at: int | None = None
) -> list[Any]:
    """The buffers of one record (the header first, joined with what follows it when that is
    small), ready for writev; frames of `PLACED_BYTES` or more are not copied. With `at` (the
    file offset the record will have), those frames are placed for O_DIRECT (gaps before them)
    and the small pieces between them joined, so the syncer handles few buffers per record."""
    views = [memoryview(f).cast("B") for f in frames]
    lengths = [v.nbytes for v in views]
    if at is None or not any(n >= PLACED_BYTES for n in lengths):
        meta = msgpack.packb([op, args, lengths], use_bin_type=True)
        body: list[Any] = [META_LEN.pack(len(meta)) + meta, *views]
        body_len = META_LEN.size + len(meta) + sum(lengths)
    else:
        body, body_len = _placed(op, args, views, lengths, at)
    digest = xxhash.xxh3_64(seed=seed)
    for part in body:
        digest.update(part)
    head = HEADER.pack(body_len, digest.intdigest())
    if len(body[0]) < PLACED_BYTES:
        return [head + body[0], *body[1:]]
    return [head, *body]


def _placed(
    op: str, args: dict[str, Any], views: list[memoryview], lengths: list[int], at: int
) -> tuple[list[Any], int]:
    """A record's body as buffers, each large frame after the gap that puts its file offset
    and its memory address at the same place in a `BLOCK` (the gaps are fixed-width in the
    meta, so its length, and where the frames start, do not depend on them), the small pieces
    between large frames joined; and the body's length."""
    n = len(views)
    meta_len = len(msgpack.packb([op, args, lengths, bytes(2 * n)], use_bin_type=True))
    pos = at + HEADER.size + META_LEN.size + meta_len
    gaps = [0] * n
    runs: list[list[Any]] = [[]]  # the small pieces before, between and after large frames
    large: list[memoryview] = []
    for i, v in enumerate(views):
        if v.nbytes >= PLACED_BYTES:
            gaps[i] = gap = (address(v) - pos) % BLOCK
            runs[-1].append(_ZEROS[:gap])
            large.append(v)
            runs.append([])
            pos += gap
        else:
            runs[-1].append(v)
        pos += v.nbytes
    meta = msgpack.packb([op, args, lengths, struct.pack(f"<{n}H", *gaps)], use_bin_type=True)
    assert len(meta) == meta_len
    parts: list[Any] = [b"".join([META_LEN.pack(meta_len), meta, *runs[0]])]
    for v, run in zip(large, runs[1:], strict=True):
        parts.append(v)
        if run:
            parts.append(b"".join(run))
    return parts, pos - at - HEADER.size


def record_size(parts: list[Any]) -> int:
    """Bytes on disk of a record `pack_record` returned."""
    return HEADER.size + HEADER.unpack_from(parts[0])[0]


def read_record(f: BinaryIO, offset: int, seed: int = 0) -> Record | None:
    """The sound record at `offset` of `f` (None at the end of the file); raises `TornRecord`
    when it is incomplete or fails its checksum."""
    f.seek(offset)
    head = f.read(HEADER.size)
    if not head:
        return None
    if len(head) < HEADER.size:
        raise TornRecord(offset, "torn record header")
    if head == END:
        raise TornRecord(offset, END_MARKER)
    body_len, checksum = HEADER.unpack(head)
    if not META_LEN.size <= body_len < MAX_RECORD_BYTES:
        raise TornRecord(offset, f"impossible record length {body_len}")
    body = f.read(body_len)
    if len(body) < body_len:
        raise TornRecord(offset, f"torn record ({len(body)} of {body_len} bytes)")
    if xxhash.xxh3_64_intdigest(body, seed) != checksum:
        raise TornRecord(offset, "checksum mismatch")
    return offset + HEADER.size + body_len, *_parse_body(memoryview(body), offset)


def read_records(f: BinaryIO, offset: int = 0, seed: int = 0) -> Iterator[Record]:
    """Each sound record from `offset` on; raises `TornRecord` at the first that is not."""
    while (record := read_record(f, offset, seed)) is not None:
        yield record
        offset = record[0]


def _parse_body(body: memoryview, offset: int) -> tuple[str, dict[str, Any], list[bytes]]:
    (meta_len,) = META_LEN.unpack_from(body)
    start = META_LEN.size + meta_len
    try:
        op, args, lengths, *placed = msgpack.unpackb(body[META_LEN.size : start], raw=False)
        gaps = struct.unpack(f"<{len(lengths)}H", placed[0]) if placed else (0,) * len(lengths)
    except (ValueError, TypeError, msgpack.ExtraData, struct.error) as exc:
        raise TornRecord(offset, f"unreadable record meta: {exc}") from exc
    frames = []
    for n, gap in zip(lengths, gaps, strict=True):
        start += gap
        frames.append(bytes(body[start : start + n]))
        start += n
    return op, args, frames


def write_buffers(fd: int, buffers: list[Any], offset: int) -> int:
    """Write `buffers` in order at `offset`, one pwritev per IOV_MAX of them (no copies in
    user space); returns the offset after them."""
    for i in range(0, len(buffers), IOV_MAX):
        chunk = buffers[i : i + IOV_MAX]
        written = os.pwritev(fd, chunk, offset)
        total = sum(memoryview(p).nbytes for p in chunk)
        if written < total:  # a short write (a signal, a full disk): write the rest plainly
            rest = b"".join(bytes(memoryview(p)) for p in chunk)[written:]
            while rest:
                n = os.pwrite(fd, rest, offset + written)
                written, rest = written + n, rest[n:]
        offset += total
    return offset


def fsync_dir(directory: Path) -> None:
    """Make the directory's entries (created, renamed, deleted files) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
