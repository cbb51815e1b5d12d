"""`asyncrl sandbox run FILE [--stdin F] [--timeout S] [--memory-mb M]`: one sandboxed run.

Prints one JSON object, `ExecResult.to_json()` (status, exit_code, stdout, stderr, wall_s,
cpu_s, max_rss_mb). Exits 0 when the run was made (whatever the program did), 2 on bad
arguments or when the sandbox cannot isolate code here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from actors.sandbox.pool import Sandbox, SandboxError, SandboxLimits


def main(argv: list[str]) -> int:
    """Entry point of `asyncrl sandbox`."""
    parser = argparse.ArgumentParser(prog="asyncrl sandbox", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    run = sub.add_parser("run", help="run a Python file in the sandbox, print one JSON object")
    run.add_argument("file", type=Path)
    run.add_argument("--stdin", type=Path, default=None, help="file fed to the program's stdin")
    run.add_argument("--timeout", type=float, default=10.0, help="wall-clock limit, seconds")
    run.add_argument("--memory-mb", type=int, default=512, help="address-space limit, MiB")
    args = parser.parse_args(argv)
    try:
        limits = SandboxLimits(timeout_s=args.timeout, cpu_s=args.timeout, memory_mb=args.memory_mb)
        code = args.file.read_text()
        stdin = args.stdin.read_text() if args.stdin else ""
    except (ValueError, OSError) as exc:
        print(f"asyncrl sandbox: {exc}", file=sys.stderr)
        return 2
    try:
        with Sandbox(num_workers=1, limits=limits) as sandbox:
            result = sandbox.run(code, stdin=stdin)
    except SandboxError as exc:
        print(f"asyncrl sandbox: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json()))
    return 0
