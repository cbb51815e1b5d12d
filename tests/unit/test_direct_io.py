"""The syncer's O_DIRECT segment writes on real files: records land byte for byte where the log
says, across block boundaries, staging-buffer refills and a restart mid-block; the end marker
follows them; the buffered fallback writes the same log. Large frames of records packed for
their offset are written from their own memory (only their ends and the gaps copied), in commits
of more buffers than one pwritev takes, and read back byte for byte; records packed without an
offset, and frames whose memory does not agree with their place, are copied."""

from __future__ import annotations

import os
from pathlib import Path

import msgpack
import numpy as np
import pytest
import xxhash

from replay import direct_io
from replay.direct_io import BLOCK, STAGING_BYTES, DirectWriter
from replay.wal_records import (
    END,
    END_MARKER,
    HEADER,
    IOV_MAX,
    META_LEN,
    PLACED_BYTES,
    TornRecord,
    address,
    pack_record,
    read_records,
)


def commits(seed: int) -> list[list[bytes]]:
    """Commits of records of odd sizes, one larger than the staging buffer."""
    rng = np.random.default_rng(seed)
    sizes = [[5], [4091, 7, 1], [STAGING_BYTES + 12345], [BLOCK], [300_000, 2, 65_536]]
    return [[rng.bytes(n) for n in commit] for commit in sizes]


def write_log(path: Path, writer: DirectWriter, groups: list[list[bytes]], at: int = 0) -> int:
    """Write each commit as records of one frame each; returns the offset after them."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    offset = at
    for commit in groups:
        parts = [p for frame in commit for p in pack_record("store", {}, [frame], seed=3)]
        writer.write(fd, [*parts, END], offset)
        offset += sum(memoryview(p).nbytes for p in parts)
    os.close(fd)
    return offset


def frames_in(path: Path) -> tuple[list[bytes], str]:
    frames = []
    with path.open("rb") as f:
        try:
            for _, _, _, fs in read_records(f, seed=3):
                frames += fs
        except TornRecord as exc:
            return frames, exc.why
    return frames, "end of file"


@pytest.mark.parametrize("direct", [True, False])
def test_records_land_where_the_log_says(
    tmp_path: Path, direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not direct:  # a filesystem that refuses O_DIRECT
        monkeypatch.setattr(direct_io, "_set_direct", lambda fd, on: False)
    path = tmp_path / "wal-3.log"
    writer = DirectWriter()
    first = commits(1)
    end = write_log(path, writer, first[:3])
    assert writer.direct is direct
    again = DirectWriter()  # a restarted hub goes on mid-block: it reads the block back
    end = write_log(path, again, first[3:], at=end)
    frames, why = frames_in(path)
    assert frames == [frame for commit in first for frame in commit]
    assert why == END_MARKER  # the end marker right after the last record
    if direct:
        assert path.stat().st_size % BLOCK == 0 and path.stat().st_size - end < BLOCK + len(END)
    else:
        assert path.stat().st_size == end + len(END)
    writer.close()
    again.close()


def odd_frames(rng: np.random.Generator, sizes: list[int]) -> list[memoryview]:
    """Frames at unaligned addresses, as received ones are: slices of one buffer."""
    pool = np.frombuffer(rng.bytes(sum(sizes) + 8 * len(sizes)), np.uint8)
    frames, at = [], 0
    for n in sizes:
        at += int(rng.integers(1, 8))
        frames.append(memoryview(pool[at : at + n]))
        at += n
    return frames


def write_placed(
    path: Path,
    writer: DirectWriter,
    commits: list[list[list[memoryview]]],
    at: int = 0,
    place: bool = True,
) -> int:
    """Write each commit of records (lists of frames), each packed for the offset it gets."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    offset = at
    for commit in commits:
        parts: list[object] = []
        for frames in commit:
            record = pack_record(
                "store", {"n": len(frames)}, frames, seed=3, at=offset if place else None
            )
            parts += record
            offset += sum(memoryview(p).nbytes for p in record)
        writer.write(fd, [*parts, END], offset - sum(memoryview(p).nbytes for p in parts))
    os.close(fd)
    return offset


def test_placed_frames_are_written_from_their_own_memory(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    big = [PLACED_BYTES, 117_632, 28_896, 115_584, 5 * BLOCK + 1]
    many = [odd_frames(rng, [561, *big[1:4]]) for _ in range(IOV_MAX // 4 + 30)]  # > 1 pwritev
    commits = [
        [odd_frames(rng, [561, PLACED_BYTES - 1, 7])],  # nothing large enough to place
        many,
        [odd_frames(rng, [STAGING_BYTES + 12_345, 3]), odd_frames(rng, big)],
    ]
    path = tmp_path / "wal-3.log"
    writer = DirectWriter()
    end = end_first = write_placed(path, writer, commits[:2])
    placed_before = writer.placed_bytes
    again = DirectWriter()  # a restart mid-block, then a frame larger than the staging buffer
    end = write_placed(path, again, commits[2:], at=end)
    assert writer.direct and again.direct
    frames, why = frames_in(path)
    assert frames == [bytes(f) for commit in commits for record in commit for f in record]
    assert why == END_MARKER
    assert path.stat().st_size % BLOCK == 0 and path.stat().st_size - end < BLOCK + len(END)
    large = sum(f.nbytes for record in many for f in record if f.nbytes >= PLACED_BYTES)
    # each placed frame's ends (< a block each) are copied, its whole blocks are not
    assert placed_before > large - 2 * BLOCK * 3 * len(many)
    assert writer.copied_bytes < 12 * BLOCK * len(many)
    assert writer.placed_bytes + writer.copied_bytes == end_first  # every byte, counted once
    assert again.placed_bytes > STAGING_BYTES
    writer.close()
    again.close()


def test_frames_not_placed_are_copied_whole(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    commit = [odd_frames(rng, [561, 117_632, 28_896]) for _ in range(3)]
    path = tmp_path / "wal-3.log"
    writer = DirectWriter()
    write_placed(path, writer, [commit], place=False)  # a snapshot's records: no offset known
    frames, why = frames_in(path)
    assert frames == [bytes(f) for record in commit for f in record] and why == END_MARKER
    chance, pos = 0, 0  # a frame whose address agrees with its offset by chance is placed
    for record in commit:
        for part in pack_record("store", {"n": len(record)}, record, seed=3):
            n = memoryview(part).nbytes
            if n >= PLACED_BYTES and (pos - address(part)) % BLOCK == 0:
                chance += (n - (-address(part) % BLOCK)) // BLOCK * BLOCK
            pos += n
    assert writer.placed_bytes == chance
    assert writer.copied_bytes == pos - chance
    writer.close()


def test_a_record_with_gaps_that_do_not_fit_its_frames_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "wal-3.log"
    for gaps in (b"\x00\x00\x00", "two", b"\x00\x00" * 3):  # odd length, not bytes, too many
        meta = msgpack.packb(["store", {}, [4, 4], gaps], use_bin_type=True)
        body = META_LEN.pack(len(meta)) + meta + b"abcdefgh"
        path.write_bytes(HEADER.pack(len(body), xxhash.xxh3_64_intdigest(body, 3)) + body)
        frames, why = frames_in(path)
        assert frames == [] and why.startswith("unreadable record meta"), (gaps, why)
