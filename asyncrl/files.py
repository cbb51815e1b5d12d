"""Small files that other processes read while they change (pids.json, endpoint files, metadata):
written whole to a temporary name beside them, then renamed into place, so a reader sees the old
text or the new one, never a half-written file."""

import os
from pathlib import Path


def replace_text(path: Path, text: str) -> None:
    """Write text to path atomically (a temporary file in the same directory, then os.replace)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
