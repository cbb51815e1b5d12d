"""The syncer's O_DIRECT segment writes on real files: records land byte for byte where the log
says, across block boundaries, staging-buffer refills and a restart mid-block; the end marker
follows them; the buffered fallback writes the same log."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from replay import direct_io
from replay.direct_io import BLOCK, STAGING_BYTES, DirectWriter
from replay.wal_records import END, END_MARKER, TornRecord, pack_record, read_records


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
def test_records_land_where_the_log_says(tmp_path: Path, direct: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
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
