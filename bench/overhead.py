"""The whole system against a minimal single-process GRPO loop, side by side in one run.

    python bench/overhead.py [--config configs/tiny_cpu.toml] [--budget-s 150] [--repeats 1]

For each repetition, in turn on the same machine:
- system: `asyncrl run` (hub, actor(s), learner as processes; η from the config, 4 for
  tiny_cpu) for `--budget-s` seconds of wall-clock, start-up included;
- minimal: `bench/minimal_grpo.run_minimal` (same model, task, batch, loss family, no sockets,
  no processes) for the same wall-clock, with 1 and with all torch threads; the faster of the
  two is the baseline (the minimal loop gets its best setting).

samples/s is trained samples per second of training time (from the first to the last step;
start-up is reported separately). Writes `bench/results/overhead.json` (`system_samples_per_s`,
`minimal_samples_per_s`, `ratio` = system / minimal, with median/min/max over repetitions) and
`bench/results/overhead.png` (reward vs wall-clock time for both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncrl.config import RunConfig, load_config
from bench.common import REPO, RESULTS, command_line, environment, repeat, spread, write_json
from bench.minimal_grpo import run_minimal
from launch.run import run
from learner.metrics_log import read_metrics


def system_point(cfg: RunConfig, budget_s: float, work: Path) -> dict[str, Any]:
    """One `asyncrl run` for budget_s seconds of wall-clock; its throughput and reward curve."""
    run_dir = work / f"system-{time.time_ns()}"
    overrides = {
        "run": {"max_wall_s": budget_s, "run_dir": str(run_dir)},
        "learner": {"max_steps": 1_000_000},
    }
    point_cfg = _with(cfg, overrides)
    start = time.perf_counter()
    run(point_cfg, run_dir, quiet=True)
    wall = time.perf_counter() - start
    rows = read_metrics(run_dir / "metrics.jsonl")
    return _curve_stats(rows, wall_s=wall, startup_s=wall - (rows[-1]["time_s"] if rows else 0.0))


def minimal_point(cfg: RunConfig, budget_s: float, threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    start = time.perf_counter()
    rows = run_minimal(cfg, max_wall_s=budget_s, max_steps=1_000_000)
    wall = time.perf_counter() - start
    point = _curve_stats(rows, wall_s=wall, startup_s=wall - (rows[-1]["time_s"] if rows else 0.0))
    point["threads"] = threads
    return point


def _curve_stats(rows: list[dict[str, Any]], wall_s: float, startup_s: float) -> dict[str, Any]:
    if len(rows) < 2:
        raise RuntimeError("too few steps to measure; raise --budget-s")
    span = rows[-1]["time_s"] - rows[0]["time_s"]
    samples = sum(r["samples"] for r in rows[1:])
    tenth = max(1, len(rows) // 10)
    return {
        "steps": len(rows),
        "samples_per_s": samples / span,
        "wall_s": wall_s,
        "startup_s": startup_s,
        "reward_first_tenth": statistics.fmean(r["reward_mean"] for r in rows[:tenth]),
        "reward_last_tenth": statistics.fmean(r["reward_mean"] for r in rows[-tenth:]),
        "curve": [[round(r["time_s"], 3), round(r["reward_mean"], 4)] for r in rows],
    }


def _with(cfg: RunConfig, overrides: dict[str, dict[str, Any]]) -> RunConfig:
    import dataclasses

    sections = {
        name: dataclasses.replace(getattr(cfg, name), **vals) for name, vals in overrides.items()
    }
    return dataclasses.replace(cfg, **sections)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, color in (("system", "tab:blue"), ("minimal", "tab:orange")):
        for i, point in enumerate(result[f"{name}_runs"]):
            t, r = zip(*point["curve"], strict=True)
            k = max(1, len(r) // 25)
            smooth = [statistics.fmean(r[max(0, j - k + 1) : j + 1]) for j in range(len(r))]
            label = f"{name} ({point['samples_per_s']:.0f} samples/s)" if i == 0 else None
            ax.plot(t, smooth, color=color, lw=1.5, label=label)
    ax.set_xlabel("wall-clock seconds since the first training step")
    ax.set_ylabel("mean reward (0-1), smoothed")
    ax.set_ylim(0, 1)
    ax.set_title(f"asyncrl run vs minimal GRPO loop: ratio {result['ratio']['median']:.2f}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default=str(REPO / "configs" / "tiny_cpu.toml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--budget-s", type=float, default=150.0, help="wall-clock per run, start-up included"
    )
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default=str(RESULTS / "overhead.json"))
    args = p.parse_args()
    cfg = load_config(args.config, args.set)
    from asyncrl.models.tiny import ensure_model

    ensure_model(cfg.model, cfg.task)  # warm-up: the build is not part of either measurement
    cores = os.cpu_count() or 1

    with tempfile.TemporaryDirectory(prefix="asyncrl-overhead-") as tmp:
        work = Path(tmp)

        def one(rep: int) -> tuple[dict[str, Any], dict[str, Any]]:
            print(
                f"[{rep + 1}/{args.repeats}] system: asyncrl run for {args.budget_s:.0f} s",
                flush=True,
            )
            system = system_point(cfg, args.budget_s, work)
            options = [minimal_point(cfg, args.budget_s, t) for t in sorted({1, cores})]
            best = max(options, key=lambda pt: pt["samples_per_s"])
            print(
                f"[{rep + 1}/{args.repeats}] system {system['samples_per_s']:.1f} samples/s, "
                f"minimal {best['samples_per_s']:.1f} samples/s ({best['threads']} threads)",
                flush=True,
            )
            return system, best

        pairs = repeat(one, reps=args.repeats, warmup=0)  # the model was built above
    system_runs, minimal_runs = [s for s, _ in pairs], [m for _, m in pairs]
    ratios = [
        s["samples_per_s"] / m["samples_per_s"]
        for s, m in zip(system_runs, minimal_runs, strict=True)
    ]
    result = {
        "command": command_line(__file__),
        "config": json.loads(json.dumps(cfg.to_dict())),
        "environment": environment(),
        "system_samples_per_s": spread([r["samples_per_s"] for r in system_runs]),
        "minimal_samples_per_s": spread([r["samples_per_s"] for r in minimal_runs]),
        "ratio": spread(ratios),
        "target_ratio": 1.0,
        "system_runs": system_runs,
        "minimal_runs": minimal_runs,
    }
    out = Path(args.out)
    write_json(out, result)
    plot(result, out.with_suffix(".png"))
    print(
        f"ratio (system / minimal samples/s): {result['ratio']['median']:.2f}; wrote {out}",
        flush=True,
    )


if __name__ == "__main__":
    main()
