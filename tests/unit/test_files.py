"""asyncrl/files.py: a file or directory other processes read is replaced whole, never seen
half-written."""

import json
import threading
from pathlib import Path

import pytest

from asyncrl.files import atomic_dir, replace_text


def test_replace_text_writes_the_text_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "pids.json"
    replace_text(path, "old")
    replace_text(path, "new", fsync=True)
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["pids.json"]


def test_a_reader_sees_only_whole_documents_while_the_file_is_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "pids.json"
    replace_text(path, json.dumps({"hub": 0}))
    done = threading.Event()

    def rewrite() -> None:
        for n in range(2000):
            replace_text(path, json.dumps({"hub": n, "pad": "x" * 4096}))
        done.set()

    writer = threading.Thread(target=rewrite)
    writer.start()
    reads = 0
    while not done.is_set():
        assert "hub" in json.loads(path.read_text())  # a torn read raises JSONDecodeError
        reads += 1
    writer.join()
    assert reads > 0


def test_atomic_dir_renames_a_complete_directory_into_place(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    with atomic_dir(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".tmp-ckpt-")
        (tmp / "a").write_text("1")
        assert not target.exists()  # nothing at the target until the directory is complete
    assert (target / "a").read_text() == "1"
    with atomic_dir(target) as tmp:  # an existing directory is replaced whole
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in target.iterdir()) == ["b"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_a_failed_atomic_dir_leaves_the_previous_directory(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    with atomic_dir(target) as tmp:
        (tmp / "a").write_text("old")
    with pytest.raises(RuntimeError, match="crashed"), atomic_dir(target) as tmp:
        (tmp / "a").write_text("new")
        raise RuntimeError("crashed")
    assert (target / "a").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # the temporary one is gone


def test_atomic_dir_with_a_named_temporary_directory(tmp_path: Path) -> None:
    """Several processes fill one temporary directory they all know by name."""
    target, tmp = tmp_path / "ckpt", tmp_path / ".tmp-ckpt"
    tmp.mkdir()
    (tmp / "stale").write_text("from a crashed write")
    with atomic_dir(target, tmp) as into:
        assert into == tmp and not any(tmp.iterdir())  # emptied first
        (into / "shard-0").write_text("0")
    assert [p.name for p in target.iterdir()] == ["shard-0"] and not tmp.exists()
    with pytest.raises(ValueError, match="not beside"), atomic_dir(target, tmp_path / "x" / "t"):
        pass
