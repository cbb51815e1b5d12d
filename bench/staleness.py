"""Throughput vs staleness: the real system swept over η and loss, side by side in one run.

    python bench/staleness.py [--config configs/tiny_cpu.toml] [--etas 0,1,2,4,8]
                              [--losses decoupled_ppo,ppo] [--seeds 1] [--budget-s 120]
                              [--modes between_groups,in_flight]
    asyncrl bench staleness ...                       (the same, from the repository root)

For every (loss, η, seed) point it runs `asyncrl run` (hub, actors, learner as processes) for
a fixed wall-clock budget (start-up included) and records, from the run directory: learner
samples/s and tokens/s, learner time waiting for data, actor time waiting for credits or
weights, the staleness histogram of consumed groups, groups dropped as stale, weight sync time,
and the mean reward at a fixed wall-clock time and at a fixed step count common to all points.

Writes `bench/results/staleness.json` (`points`, each with `max_staleness`, `loss`, `seed`,
`samples_per_s`, `final_reward`, ...; top-level `speedup_eta4_vs_eta0` for the first loss) and
two pictures: `staleness_throughput.png` (samples/s and idle fractions vs η) and
`staleness_reward.png` (reward vs wall-clock per η and loss). The point fields also serve the
simulator's calibration (bench/sim/calibrate.py).

`--modes` sweeps `actor.weight_update` too (default: between_groups only). With both modes the
JSON adds `inflight_eta1_over_between_eta4` (samples/s of in-flight updates at η = 1 over
between-groups updates at η = 4) and per point the actors' idle fraction, in-flight updates and
tokens generated per weight version; `final_reward_eta8_minus_eta0` (first loss,
between-groups, median of seeds) is there whenever η = 0 and η = 8 are.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_common import environment, spread, write_json  # noqa: E402

from asyncrl.config import RunConfig, load_config  # noqa: E402
from asyncrl.run import read_metrics, run  # noqa: E402

DIAGNOSTICS = ("is_weight_mean", "is_weight_max", "ess", "clipped_frac", "masked_frac",
               "mismatch_kl", "entropy", "grad_norm")  # fmt: skip
"""Per-step loss diagnostics (learner metrics.jsonl) reported per point as run means."""


def run_point(
    cfg: RunConfig, loss: str, eta: int, seed: int, budget_s: float, work: Path,
    mode: str = "between_groups",
) -> dict[str, Any]:  # fmt: skip
    """One real run; its measurements (curves included, for the reward-at-fixed-x columns)."""
    run_dir = work / f"{loss}-eta{eta}-seed{seed}-{mode}"
    point_cfg = dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, run_dir=str(run_dir), seed=seed, max_wall_s=budget_s),
        replay=dataclasses.replace(cfg.replay, max_staleness=eta),
        loss=dataclasses.replace(cfg.loss, name=loss),
        learner=dataclasses.replace(cfg.learner, max_steps=1_000_000),
        actor=dataclasses.replace(cfg.actor, weight_update=mode),
    )
    summary = run(point_cfg, run_dir, quiet=True)
    rows = read_metrics(run_dir / "metrics.jsonl")
    if len(rows) < 3:
        raise RuntimeError(
            f"{run_dir}: only {len(rows)} learner steps; raise --budget-s (exit codes {summary['exit_codes']})"
        )
    actors = [json.loads(p.read_text()) for p in sorted(run_dir.glob("actor-*.json"))]
    point = measure(rows, actors, eta, loss, seed)
    stats = [a["stats"] for a in actors]
    point["weight_update"] = mode
    point["inflight_updates"] = sum(int(s.get("inflight_updates", 0)) for s in stats)
    point["tokens_per_weight_version"] = sum(s["tokens"] for s in stats) / max(
        1, sum(int(s.get("weights_loaded", 0)) for s in stats)
    )
    return point


def measure(
    rows: list[dict[str, Any]], actors: list[dict[str, Any]], eta: int, loss: str, seed: int
) -> dict[str, Any]:
    """Per-point metrics from metrics.jsonl rows and the actors' exit status files."""
    train = rows[1:]  # the first step includes waiting for actors to start
    span = rows[-1]["time_s"] - rows[0]["time_s"]
    samples = sum(r["samples"] for r in train)
    tokens = sum(r["tokens_per_s"] * (r["wait_data_s"] + r["step_s"]) for r in train)
    hist = [0] * (eta + 2)
    for r in rows:
        for k, v in enumerate(r["staleness_hist"][: eta + 2]):
            hist[k] += int(v)
    actor_stats = [a["stats"] for a in actors]
    actor_wall = [max(s.get("wall_s", 0.0), 1e-9) for s in actor_stats]
    rounds = [max(s.get("rounds", 0), 1) for s in actor_stats]
    tenth = max(1, len(rows) // 10)
    return {
        "loss": loss,
        "max_staleness": eta,
        "seed": seed,
        "steps": len(rows),
        "samples_per_s": samples / span,
        "tokens_per_s": tokens / span,
        "learner_wait_fraction": sum(r["wait_data_s"] for r in train) / span,
        "actor_wait_fraction": statistics.fmean(
            (s.get("wait_credit_s", 0.0) + s.get("wait_weights_s", 0.0)) / w for s, w in zip(actor_stats, actor_wall, strict=True)
        ) if actor_stats else None,
        "actor_wait_weights_fraction": statistics.fmean(
            s.get("wait_weights_s", 0.0) / w for s, w in zip(actor_stats, actor_wall, strict=True)
        ) if actor_stats else None,
        "staleness_hist": hist,
        "staleness_mean": sum(k * v for k, v in enumerate(hist)) / max(sum(hist), 1),
        "dropped_stale": sum(int(r["dropped_stale"]) for r in rows),
        "sync_s": statistics.fmean(r["weight_sync_s"] for r in train),
        "step_time_s": statistics.fmean(r["step_s"] for r in train),
        # the spread of both sides' times, as 101 quantiles (seconds), for the simulator
        "step_time_quantiles": time_quantiles([r["step_s"] for r in train]),
        "generate_time_quantiles": time_quantiles([s for a in actors for s in a.get("round_generate_s", ())]),
        "generate_time_s": statistics.fmean(s.get("generate_s", 0.0) / n for s, n in zip(actor_stats, rounds, strict=True)) if actor_stats else None,
        "response_lengths": [round(r["response_len_mean"], 3) for r in rows],
        "prompt_tokens": None,  # filled in by main from the config
        "final_reward": statistics.fmean(r["reward_mean"] for r in rows[-tenth:]),
        # the loss's own diagnostics, averaged over the run: how off-policy the data was
        **{key: statistics.fmean(r[key] for r in train) for key in DIAGNOSTICS if key in rows[0]},
        "curve": [[round(r["time_s"], 3), r["step"], round(r["reward_mean"], 4)] for r in rows],
    }  # fmt: skip


def time_quantiles(seconds: list[float], num: int = 101) -> list[float] | None:
    """`num` equally spaced quantiles of measured times (None with fewer than 2 times)."""
    if len(seconds) < 2:
        return None
    cuts = statistics.quantiles(seconds, n=num - 1, method="inclusive")
    return [round(x, 6) for x in (min(seconds), *cuts, max(seconds))]


def reward_at(points: list[dict[str, Any]]) -> None:
    """Mean reward at a wall-clock time and at a step count that every point reached."""
    t_fixed = min(p["curve"][-1][0] for p in points)
    n_fixed = min(p["curve"][-1][1] for p in points)
    for p in points:
        near_t = [r for t, _, r in p["curve"] if 0.9 * t_fixed <= t <= t_fixed] or [
            p["curve"][-1][2]
        ]
        near_n = [r for _, n, r in p["curve"] if 0.9 * n_fixed <= n <= n_fixed] or [
            p["curve"][-1][2]
        ]
        p["reward_at_fixed_time"] = {"time_s": t_fixed, "reward": statistics.fmean(near_t)}
        p["reward_at_fixed_steps"] = {"steps": n_fixed, "reward": statistics.fmean(near_n)}


def by(points: list[dict[str, Any]], loss: str, eta: int, key: str,
       mode: str = "between_groups") -> float | None:  # fmt: skip
    values = [p[key] for p in points if p["loss"] == loss and p["max_staleness"] == eta
              and p.get("weight_update", "between_groups") == mode]  # fmt: skip
    return statistics.median(values) if values else None


def plot(points: list[dict[str, Any]], losses: list[str], etas: list[int], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for loss in losses:
        ax1.plot(etas, [by(points, loss, e, "samples_per_s") for e in etas], marker="o", label=loss)
        ax2.plot(
            etas,
            [by(points, loss, e, "learner_wait_fraction") for e in etas],
            marker="o",
            label=f"learner waits ({loss})",
        )
        ax2.plot(
            etas,
            [by(points, loss, e, "actor_wait_fraction") for e in etas],
            marker="s",
            ls="--",
            label=f"actor waits ({loss})",
        )
    ax1.set(xlabel="max_staleness η", ylabel="learner samples/s", title="throughput vs η")
    ax2.set(
        xlabel="max_staleness η",
        ylabel="fraction of wall time",
        title="idle fractions vs η",
        ylim=(0, 1),
    )
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "staleness_throughput.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(losses), figsize=(5.5 * len(losses), 4), squeeze=False)
    for ax, loss in zip(axes[0], losses, strict=True):
        for p in [p for p in points if p["loss"] == loss]:
            t = [c[0] for c in p["curve"]]
            r = [c[2] for c in p["curve"]]
            k = max(1, len(r) // 25)
            smooth = [statistics.fmean(r[max(0, j - k + 1) : j + 1]) for j in range(len(r))]
            ax.plot(t, smooth, label=f"η={p['max_staleness']} seed {p['seed']}")
        ax.set(
            xlabel="wall-clock s (learner)",
            ylabel="mean reward (smoothed)",
            title=loss,
            ylim=(0, 1),
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "staleness_reward.png", dpi=120)
    plt.close(fig)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default=str(REPO / "configs" / "tiny_cpu.toml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--etas", default="0,1,2,4,8")
    p.add_argument("--losses", default="decoupled_ppo,ppo")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument(
        "--budget-s", type=float, default=120.0, help="wall-clock per point, start-up included"
    )
    p.add_argument("--modes", default="between_groups", help="actor.weight_update values")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "staleness.json"))
    args = p.parse_args()
    cfg = load_config(args.config, args.set)
    etas = [int(x) for x in args.etas.split(",")]
    losses = args.losses.split(",")
    from asyncrl.tiny_model import ensure_model

    ensure_model(cfg.model, cfg.task)  # warm-up: built once, outside every point
    # interleaved (each η's losses back to back) so slow drifts in machine load hit all alike
    modes = args.modes.split(",")
    combos = [(loss, eta, seed, mode) for seed in range(args.seeds) for eta in etas
              for mode in modes for loss in losses]  # fmt: skip
    points = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-staleness-") as tmp:
        for i, (loss, eta, seed, mode) in enumerate(combos, 1):
            print(
                f"[{i}/{len(combos)}] loss={loss} η={eta} seed={seed} {mode}: running for {args.budget_s:.0f} s ...",
                flush=True,
            )
            start = time.perf_counter()
            point = run_point(cfg, loss, eta, cfg.run.seed + seed, args.budget_s, Path(tmp), mode)
            point["prompt_tokens"] = cfg.task.num_digits + 2  # <bos>, digits, ':'
            points.append(point)
            print(f"[{i}/{len(combos)}]   {point['samples_per_s']:.1f} samples/s, learner waits {point['learner_wait_fraction']:.0%}, "
                  f"reward {point['final_reward']:.3f}, mean staleness {point['staleness_mean']:.2f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    reward_at(points)
    between = [q for q in points if q["weight_update"] == "between_groups"]
    first = losses[0]
    base = by(points, first, 0, "samples_per_s")
    fast = by(points, first, 4, "samples_per_s")
    out = Path(args.out)
    result = {
        "command": "python " + " ".join([os.path.relpath(__file__, REPO), *sys.argv[1:]]),
        "config": cfg.to_dict(),
        "environment": environment(),
        "budget_s": args.budget_s,
        "speedup_eta4_vs_eta0": fast / base if base and fast else None,
        "speedup_loss": first,
        "inflight_eta1_over_between_eta4": _ratio(
            by(points, first, 1, "samples_per_s", "in_flight"), fast
        ),
        "final_reward_eta8_minus_eta0": _difference(
            by(points, first, 8, "final_reward"), by(points, first, 0, "final_reward")
        ),
        "samples_per_s_by_eta": {loss: {str(e): spread([q["samples_per_s"] for q in between if q["loss"] == loss and q["max_staleness"] == e]) for e in etas} for loss in losses},
        "final_reward_by_eta": {loss: {str(e): spread([q["final_reward"] for q in between if q["loss"] == loss and q["max_staleness"] == e]) for e in etas} for loss in losses},
        "points": points,
    }  # fmt: skip
    write_json(out, result)
    plot(between or points, losses, etas, out.parent)
    print(
        f"speedup η=4 vs η=0 ({first}): {result['speedup_eta4_vs_eta0']}; wrote {out}", flush=True
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _difference(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


if __name__ == "__main__":
    main()
