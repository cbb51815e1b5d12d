"""asyncrl/files.py: a file other processes read is replaced whole, never seen half-written."""

import json
import threading
from pathlib import Path

from asyncrl.files import replace_text


def test_replace_text_writes_the_text_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "pids.json"
    replace_text(path, "old")
    replace_text(path, "new")
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
