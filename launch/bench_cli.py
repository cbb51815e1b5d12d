"""`asyncrl bench NAME [args...]`: run `bench/NAME.py` from the repository root."""

from __future__ import annotations

import runpy
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str]) -> int:
    """Run a benchmark script as `__main__` with the remaining arguments."""
    args = list(argv)
    bench_dir = Path.cwd() / "bench"
    names = sorted(p.stem for p in bench_dir.glob("*.py") if not p.stem.startswith("_"))
    if not args or args[0] not in names:
        where = (
            f"in {bench_dir}"
            if bench_dir.is_dir()
            else f"({bench_dir} not found: run from the repository root)"
        )
        print(
            f"usage: asyncrl bench NAME [args...]; benchmarks {where}: {', '.join(names)}",
            file=sys.stderr,
        )
        return 2
    script = bench_dir / f"{args[0]}.py"
    sys.argv = [str(script), *args[1:]]
    sys.path.insert(0, str(Path.cwd()))
    runpy.run_path(str(script), run_name="__main__")
    return 0
