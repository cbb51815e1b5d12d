"""How deep bench/transport.py's learner pipeline should be: volatile and durable hub at 32 KB
and 256 KB groups with the learner keeping 4 sample requests out against 64 MB worth of
batches (its default: `learner_in_flight`, 32 requests at 32 KB, 16 at 256 KB).

A durable hub sends a `Batch` only once the log records before it are on disk, so each batch
waits for the log's tail to be written; the learner hides that wait only with enough requests
out. Each run of bench/transport.py measures `hub` and `hub_durable` side by side (one ratio
per repetition, the machine's noise hitting both alike); the runs of the two depths alternate,
so a slow phase of the machine does not land on one depth only. Writes
bench/results/transport_in_flight.json.

    python bench/transport_in_flight.py [--runs 3] [--reps 5] [--sizes 32768,262144] [--depths 4,0]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import REPO, RESULTS, command_line, environment, spread, write_json


def one_run(depth: int, size: int, reps: int, out: Path) -> dict[str, Any]:
    """One bench/transport.py run of hub and hub_durable at `depth`; its result for `size`."""
    cmd = [
        sys.executable,
        "-m",
        "bench.transport",
        "--sizes",
        str(size),
        "--variants",
        "hub,hub_durable",
        "--reps",
        str(reps),
        "--learner-in-flight",
        str(depth),
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["results"][0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs per depth, alternating")
    p.add_argument("--reps", type=int, default=5, help="repetitions per run")
    p.add_argument(
        "--depths",
        default="4,0",
        help="learner requests out, one run each (0: bench/transport.py's default)",
    )
    p.add_argument("--sizes", default="32768,262144", help="group bytes, comma-separated")
    p.add_argument("--out", default=str(RESULTS / "transport_in_flight.json"))
    args = p.parse_args()
    depths = {(f"{d} requests" if int(d) else "64 MB"): int(d) for d in args.depths.split(",")}
    sizes = [int(s) for s in args.sizes.split(",")]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        str(size): {name: [] for name in depths} for size in sizes
    }
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for size, name in ((size, name) for size in sizes for name in depths):
                r = one_run(depths[name], size, args.reps, Path(tmp) / "transport.json")
                runs[str(size)][name].append(
                    {
                        "learner_in_flight": r["learner_in_flight"],
                        "durable_over_volatile": r["durable_over_volatile"],
                        "hub_groups_per_s": r["hub_groups_per_s"],
                        "hub_durable_groups_per_s": r["hub_durable_groups_per_s"],
                    }
                )
                print(
                    f"run {i} {size:>7} B {name:>11}: durable/volatile {r['durable_over_volatile']:.2f}  "
                    f"volatile {r['hub_groups_per_s']:.0f} g/s  durable "
                    f"{r['hub_durable_groups_per_s']:.0f} g/s",
                    flush=True,
                )
    keys = ("durable_over_volatile", "hub_groups_per_s", "hub_durable_groups_per_s")
    summary = {
        size: {name: {key: spread([r[key] for r in rs]) for key in keys} for name, rs in by.items()}
        for size, by in runs.items()
    }
    write_json(
        args.out,
        {
            "benchmark": "transport_in_flight",
            "command": command_line(__file__),
            "runs": runs,
            "summary": summary,
            **environment(packages=("numpy", "zmq", "msgpack")),
        },
    )


if __name__ == "__main__":
    main()
