"""Atomic writes: a file or a directory is written whole under a temporary name beside its
target, then renamed into place, so a reader sees the old content or the new, never half of it.

- `replace_text`: small files other processes read while they change (pids.json, endpoint
  files, metadata, a checkpoint's `latest` pointer).
- `atomic_dir`: a directory filled under `.tmp-<name>-*`, fsynced and renamed into place (both
  kinds of learner checkpoint, learner/checkpoint.py). A crash leaves the previous directory or
  the new one; the temporary one is removed on an error, and one a crash left behind starts
  with `.`, so readers that skip dot-names never take it for a complete directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def replace_text(path: Path, text: str, *, fsync: bool = False) -> None:
    """Write text to path atomically (a temporary file in the same directory, then os.replace);
    `fsync` flushes it to the disk before the rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_dir(target: Path, tmp: Path | None = None) -> Iterator[Path]:
    """Yield an empty temporary directory beside `target` to fill; on a clean exit, fsync it
    and rename it into place (an existing `target` is replaced); on an error, remove it.

    `tmp` names the temporary directory when other processes must find it too (the ranks of a
    sharded checkpoint write into it); it must sit beside `target` and is emptied first. By
    default a fresh `.tmp-<name>-*` is made.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    if tmp is None:
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    else:
        if Path(tmp).parent != target.parent:
            raise ValueError(f"atomic_dir: {tmp} is not beside {target}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    try:
        os.chmod(tmp, 0o755)
        yield tmp
        _fsync_dir(tmp)
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_dir(root: Path) -> None:
    """fsync the files directly in `root`, then `root` itself."""
    for path in root.iterdir():
        if not path.is_file():
            continue
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(tmp: Path, target: Path) -> None:
    """Rename `tmp` to `target`; an existing `target` is moved aside first, then removed."""
    if not target.exists():
        os.rename(tmp, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".old-{target.name}-", dir=target.parent))
    os.rename(target, old / target.name)
    os.rename(tmp, target)
    shutil.rmtree(old, ignore_errors=True)
