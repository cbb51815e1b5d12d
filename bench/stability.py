"""Learning at high staleness: the real system at a fixed step budget, η × loss × seed.

    python bench/stability.py [--config configs/tiny_cpu.toml] [--etas 0,8]
                              [--losses ppo,decoupled_ppo,m2po] [--seeds 3] [--steps 400]
    asyncrl bench stability ...                       (the same, from the repository root)

```
  for seed, η, loss:  asyncrl run (hub, actor, learner)  -- learner.max_steps = --steps -->
      metrics.jsonl  -> reward per step, loss diagnostics, staleness
  -> per (loss, η): final reward (mean over the last --tail of the steps), median/min/max
     over the seeds; η_max - η_0 per loss; the best correcting loss
  -> bench/results/stability.json, stability_reward.png (reward vs step per η and loss)
```

Every point trains the same number of optimizer steps (no wall-clock budget), so η = 8 sees
exactly as many batches as η = 0 and the difference is one of sample efficiency alone.
`final_reward` is the mean of the per-step mean reward over the last `--tail` fraction of the
steps (default the last 20 %). A loss is "correcting" when it is not plain `ppo`; the top-level
`final_reward_eta8_minus_eta0` is that of the correcting loss whose high-η median is best
(ties: the smaller gap).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncrl.config import RunConfig, load_config
from bench.common import REPO, RESULTS, command_line, environment, spread, write_json
from launch.run import run
from learner.metrics_log import read_metrics

DIAGNOSTICS = (
    "is_weight_mean",
    "is_weight_max",
    "ess",
    "clipped_frac",
    "masked_frac",
    "mismatch_kl",
    "entropy",
    "grad_norm",
    "staleness_mean",
)
"""Per-step learner metrics reported per point as means over the run's steps."""


def run_point(
    cfg: RunConfig, loss: str, eta: int, seed: int, steps: int, tail: float, work: Path
) -> dict[str, Any]:
    """One real run of exactly `steps` optimizer steps; its reward curve and diagnostics."""
    run_dir = work / f"{loss}-eta{eta}-seed{seed}"
    point_cfg = dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, run_dir=str(run_dir), seed=seed, max_wall_s=3600.0),
        replay=dataclasses.replace(cfg.replay, max_staleness=eta),
        loss=dataclasses.replace(cfg.loss, name=loss),
        learner=dataclasses.replace(cfg.learner, max_steps=steps),
    )
    summary = run(point_cfg, run_dir, quiet=True)
    rows = read_metrics(run_dir / "metrics.jsonl")
    if len(rows) < steps:
        raise RuntimeError(
            f"{run_dir}: {len(rows)} of {steps} steps (exit codes {summary['exit_codes']})"
        )
    return measure(rows, loss, eta, seed, tail)


def measure(
    rows: list[dict[str, Any]], loss: str, eta: int, seed: int, tail: float
) -> dict[str, Any]:
    """Per-point figures from the learner's metrics.jsonl rows."""
    last = rows[-max(1, round(tail * len(rows))) :]
    train = rows[1:] or rows
    return {
        "loss": loss,
        "max_staleness": eta,
        "seed": seed,
        "steps": len(rows),
        "wall_s": rows[-1]["time_s"] - rows[0]["time_s"],
        "final_reward": statistics.fmean(r["reward_mean"] for r in last),
        **{k: statistics.fmean(r[k] for r in train) for k in DIAGNOSTICS if k in rows[0]},
        "curve": [round(r["reward_mean"], 4) for r in rows],
    }


def summarize(points: list[dict[str, Any]], losses: list[str], etas: list[int]) -> dict[str, Any]:
    """Per loss: final reward median/min/max per η and the high-η minus η = 0 gap; the best
    correcting loss and its gap."""
    low, high = min(etas), max(etas)
    gap = f"final_reward_eta{high}_minus_eta{low}"
    per_loss: dict[str, Any] = {}
    for loss in losses:
        by_eta = {
            str(e): spread([p["final_reward"] for p in points if _at(p, loss, e)]) for e in etas
        }
        per_loss[loss] = {
            "final_reward_by_eta": by_eta,
            gap: by_eta[str(high)]["median"] - by_eta[str(low)]["median"] if high > low else None,
            "diagnostics_by_eta": {
                str(e): {
                    k: statistics.median(p[k] for p in points if _at(p, loss, e))
                    for k in DIAGNOSTICS
                    if k in points[0]
                }
                for e in etas
            },
        }
    correcting = [loss for loss in losses if loss != "ppo"] or losses
    best = max(correcting, key=lambda n: per_loss[n]["final_reward_by_eta"][str(high)]["median"])
    return {"per_loss": per_loss, "best_correcting_loss": best, gap: per_loss[best][gap]}


def _at(point: dict[str, Any], loss: str, eta: int) -> bool:
    return point["loss"] == loss and point["max_staleness"] == eta


def plot(points: list[dict[str, Any]], losses: list[str], etas: list[int], path: Path) -> None:
    """Reward vs step, one panel per loss, the median over seeds of each η (smoothed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(losses), figsize=(4.6 * len(losses), 3.8), squeeze=False)
    for ax, loss in zip(axes[0], losses, strict=True):
        for eta in etas:
            curves = [p["curve"] for p in points if _at(p, loss, eta)]
            if not curves:
                continue
            steps = min(len(c) for c in curves)
            median = [statistics.median(c[i] for c in curves) for i in range(steps)]
            k = max(1, steps // 20)
            smooth = [statistics.fmean(median[max(0, j - k + 1) : j + 1]) for j in range(steps)]
            ax.plot(range(1, steps + 1), smooth, label=f"η = {eta} (median of {len(curves)})")
        ax.set(xlabel="learner step", ylabel="mean reward (smoothed)", title=loss, ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default=str(REPO / "configs" / "tiny_cpu.toml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--etas", default="0,8")
    p.add_argument("--losses", default="ppo,decoupled_ppo,m2po")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=400, help="learner.max_steps of every point")
    p.add_argument("--tail", type=float, default=0.2, help="final_reward: last fraction of steps")
    p.add_argument("--out", default=str(RESULTS / "stability.json"))
    return p.parse_args()


def main() -> None:
    args = parse_args()
    cfg = load_config(args.config, args.set)
    etas = [int(x) for x in args.etas.split(",")]
    losses = args.losses.split(",")
    from asyncrl.models.tiny import ensure_model

    env = environment()  # the commit measured: taken before the runs
    ensure_model(cfg.model, cfg.task)  # warm-up: built once, outside every point
    # interleaved (each seed's points back to back) so drifts in machine load hit all alike
    combos = [(s, e, n) for s in range(args.seeds) for e in etas for n in losses]
    points = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-stability-") as tmp:
        for i, (seed, eta, loss) in enumerate(combos, 1):
            start = time.perf_counter()
            point = run_point(cfg, loss, eta, cfg.run.seed + seed, args.steps, args.tail, Path(tmp))
            points.append(point)
            print(
                f"[{i}/{len(combos)}] {loss} η={eta} seed={seed}: reward {point['final_reward']:.3f}"
                f" ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    out = Path(args.out)
    result = {
        "command": command_line(__file__),
        "config": cfg.to_dict(),
        "environment": env,
        "steps": args.steps,
        "tail": args.tail,
        **summarize(points, losses, etas),
        "points": points,
    }
    write_json(out, result)
    plot(points, losses, etas, out.with_name(out.stem + "_reward.png"))
    gap = f"final_reward_eta{max(etas)}_minus_eta{min(etas)}"
    print(f"{result['best_correcting_loss']}: {gap} = {result[gap]}; wrote {out}")


if __name__ == "__main__":
    main()
