"""`asyncrl bench NAME [args...]`: run the benchmark `bench/NAME.py` as `python -m bench.NAME`.

The benchmarks are the modules of the `bench` package that run as a script (they end in
`if __name__ == "__main__":`); `bench.common`, `bench.cpu_sampler` and `bench.sim` are what they
share. The package is found where it is installed (`pip install -e .`), else in the current
directory (the repository root, which `python -m` puts on the path). This process becomes the
benchmark (exec), so its exit status, its output and Ctrl-C are the benchmark's own.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path


def bench_dir() -> Path | None:
    """The `bench` package's folder: installed, else `./bench`; None when there is neither."""
    spec = importlib.util.find_spec("bench")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    here = Path.cwd() / "bench"
    return here if (here / "__init__.py").is_file() else None


def benchmarks(folder: Path) -> list[str]:
    """The names of the modules in `folder` that run as a script."""
    return sorted(
        p.stem
        for p in folder.glob("*.py")
        if not p.stem.startswith("_") and 'if __name__ == "__main__":' in p.read_text()
    )


def main(argv: Sequence[str]) -> int:
    """Replace this process with `python -m bench.NAME args...`; 2 with usage on a bad NAME."""
    args = list(argv)
    folder = bench_dir()
    names = benchmarks(folder) if folder is not None else []
    if not args or args[0] not in names:
        where = (
            f"in {folder}"
            if folder is not None
            else "(no bench package: install asyncrl with `pip install -e .` or run from the "
            "repository root)"
        )
        print(
            f"usage: asyncrl bench NAME [args...]; benchmarks {where}: {', '.join(names)}",
            file=sys.stderr,
        )
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", f"bench.{args[0]}", *args[1:]])
    raise AssertionError("unreachable: os.execv returned")
