"""Throughput vs staleness: the real system swept over η and loss, side by side in one run.

    python bench/staleness.py [--config configs/tiny_cpu.toml] [--etas 0,1,2,4,8]
                              [--losses decoupled_ppo,ppo] [--seeds 1] [--budget-s 120]
                              [--modes between_groups,in_flight] [--keep-runs DIR]
                              [--summarise JSON]
    asyncrl bench staleness ...                       (the same, from the repository root)

For every (loss, η, seed) point it runs `asyncrl run` (hub, actors, learner as processes) for
a fixed wall-clock budget (start-up included) and records, from the run directory: learner
samples/s and tokens/s, learner time waiting for data, actor time waiting for credits or
weights, the staleness histogram of consumed groups, groups dropped as stale, weight sync time,
and the mean reward at a fixed wall-clock time and at a fixed step count common to all points.

Writes `bench/results/staleness.json` (`points`, each with `max_staleness`, `loss`, `seed`,
`samples_per_s`, `final_reward`, ...; top-level `speedup_eta4_vs_eta0` for the first loss) and
two pictures beside it, named after it: `staleness_throughput.png` (samples/s and idle fractions
vs η) and `staleness_reward.png` (reward vs wall-clock per η, loss and mode). The point fields also serve the
simulator's calibration (bench/sim/calibrate.py).

`--modes` sweeps `actor.weight_update` too (default: between_groups only). Per point: the
actors' idle fraction (`actor_wait_fraction`: waiting for credits or weights), weight loads and
seconds per load, in-flight updates and the KV recompute each costs (`inflight_pause_s`, load
+ recompute), tokens generated per weight version, groups dropped as stale, the loadavg, and
`config.actor.weight_update` (the simulator's calibration reads it). With both modes the JSON
adds `inflight_eta1_over_between_eta4` (samples/s of in-flight updates at η = 1 over
between-groups updates at η = 4; medians over seeds, and per seed) and `by_mode` (the first
loss's figures per mode and η). `final_reward_eta8_minus_eta0` is bench/results/stability.json's
when that file exists (the losses' own bench), else this sweep's (first loss, between-groups,
median of seeds) whenever η = 0 and η = 8 are; `final_reward_eta8_minus_eta0_from` says which
and `final_reward_eta8_minus_eta0_this_sweep` keeps this sweep's.
`--keep-runs DIR` keeps every point's run directory (metrics.jsonl, actor-*.json) for a look;
`--summarise JSON` recomputes the top-level figures and plots from an earlier result's points.
Every point is bound by the learner on the embedded task (it hardly waits for data), so beside
samples/s the JSON gives the learner's share of wall time spent in optimizer steps
(`learner_train_fraction`), each process's CPU per learner step and share of a core, and the
samples trained per CPU second of all of them (`cpu`, `samples_per_cpu_s`; bench/cpu_sampler.py),
with the in-flight ratio of each: these divide out how much CPU the shared machine happened to
give each point.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncrl.config import RunConfig, load_config
from bench.common import REPO, RESULTS, command_line, environment, spread, write_json
from bench.cpu_sampler import CpuSampler
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
)
"""Per-step loss diagnostics (learner metrics.jsonl) reported per point as run means."""


def run_point(
    cfg: RunConfig,
    loss: str,
    eta: int,
    seed: int,
    budget_s: float,
    work: Path,
    mode: str = "between_groups",
) -> dict[str, Any]:
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
    with CpuSampler(run_dir) as cpu:
        summary = run(point_cfg, run_dir, quiet=True)
    rows = read_metrics(run_dir / "metrics.jsonl")
    if len(rows) < 3:
        raise RuntimeError(
            f"{run_dir}: only {len(rows)} learner steps; raise --budget-s (exit codes {summary['exit_codes']})"
        )
    actors = [json.loads(p.read_text()) for p in sorted(run_dir.glob("actor-*.json"))]
    point = measure(rows, actors, eta, loss, seed)
    point.update(weight_costs([a["stats"] for a in actors]))
    point["weight_update"] = mode
    point["config"] = {"actor": {"weight_update": mode}}  # for bench/sim/calibrate.py
    point["loadavg"] = [round(x, 2) for x in os.getloadavg()]  # 1, 5, 15 min, at the end
    point["cpu"] = cpu.summary(rows)  # per process CPU per step and share; samples per CPU s
    if point["cpu"] is not None:
        point["samples_per_cpu_s"] = point["cpu"]["samples_per_cpu_s"]
    return point


def weight_costs(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The actors' weight swaps: how many, seconds per load, in-flight updates and the KV
    recompute each costs, tokens generated per weight version."""
    loads = sum(int(s.get("weights_loaded", 0)) for s in stats)
    updates = sum(int(s.get("inflight_updates", 0)) for s in stats)
    load_s = sum(float(s.get("weights_load_s", 0.0)) for s in stats) / max(1, loads)
    recompute_s = sum(float(s.get("inflight_recompute_s", 0.0)) for s in stats) / max(1, updates)
    return {
        "weights_loaded": loads,
        "weight_load_s": load_s,
        "inflight_updates": updates,
        "inflight_recompute_s": recompute_s,
        # what one update between decode steps costs the actor: the load, then the recompute
        "inflight_pause_s": load_s + recompute_s if updates else 0.0,
        "tokens_per_weight_version": sum(s["tokens"] for s in stats) / max(1, loads),
    }


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
        "window_s": span,  # measured: the end of the first step to the end of the last
        "samples_per_s": samples / span,
        "tokens_per_s": tokens / span,
        "learner_wait_fraction": sum(r["wait_data_s"] for r in train) / span,
        "actor_wait_fraction": statistics.fmean(
            (s.get("wait_credit_s", 0.0) + s.get("wait_weights_s", 0.0)) / w
            for s, w in zip(actor_stats, actor_wall, strict=True)
        )
        if actor_stats
        else None,
        "actor_wait_weights_fraction": statistics.fmean(
            s.get("wait_weights_s", 0.0) / w for s, w in zip(actor_stats, actor_wall, strict=True)
        )
        if actor_stats
        else None,
        "staleness_hist": hist,
        "staleness_mean": sum(k * v for k, v in enumerate(hist)) / max(sum(hist), 1),
        "dropped_stale": sum(int(r["dropped_stale"]) for r in rows),
        "sync_s": statistics.fmean(r["weight_sync_s"] for r in train),
        "step_time_s": statistics.fmean(r["step_s"] for r in train),
        "learner_train_fraction": sum(r["step_s"] for r in train) / span,
        # the spread of both sides' times, as 101 quantiles (seconds), for the simulator
        "step_time_quantiles": time_quantiles([r["step_s"] for r in train]),
        "generate_time_quantiles": time_quantiles(
            [s for a in actors for s in a.get("round_generate_s", ())]
        ),
        "generate_time_s": statistics.fmean(
            s.get("generate_s", 0.0) / n for s, n in zip(actor_stats, rounds, strict=True)
        )
        if actor_stats
        else None,
        "response_lengths": [round(r["response_len_mean"], 3) for r in rows],
        "prompt_tokens": None,  # filled in by main from the config
        "final_reward": statistics.fmean(r["reward_mean"] for r in rows[-tenth:]),
        # the loss's own diagnostics, averaged over the run: how off-policy the data was
        **{key: statistics.fmean(r[key] for r in train) for key in DIAGNOSTICS if key in rows[0]},
        "curve": [[round(r["time_s"], 3), r["step"], round(r["reward_mean"], 4)] for r in rows],
    }


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


MODE_KEYS = (
    "samples_per_s",
    "samples_per_cpu_s",
    "actor_wait_fraction",
    "learner_wait_fraction",
    "learner_train_fraction",
    "tokens_per_weight_version",
    "dropped_stale",
    "inflight_updates",
    "inflight_pause_s",
    "final_reward",
)
"""Per (mode, η) of the first loss in `by_mode`, median/min/max over seeds."""


def summarise(
    points: list[dict[str, Any]],
    losses: list[str],
    etas: list[int],
    modes: list[str],
    samples_per_step: int,
) -> dict[str, Any]:
    """The top-level figures: speed-ups, the in-flight ratio (of medians, and per seed, each
    pair run back to back), reward differences and the per-mode tables."""
    first = losses[0]
    base, fast = by(points, first, 0, "samples_per_s"), by(points, first, 4, "samples_per_s")
    between = [q for q in points if q.get("weight_update", "between_groups") == "between_groups"]

    def table(pts: list[dict[str, Any]], loss: str, key: str) -> dict[str, Any]:
        cells = {
            str(e): [
                q[key]
                for q in pts
                if q["loss"] == loss and q["max_staleness"] == e and q.get(key) is not None
            ]
            for e in etas
        }
        return {e: spread(values) if values else None for e, values in cells.items()}

    for q in points:
        q["reward_at_fixed_steps_value"] = q["reward_at_fixed_steps"]["reward"]
    for q in points:  # points of sweeps before this field: from their mean step time
        window = (q["steps"] - 1) * samples_per_step / q["samples_per_s"]
        q.setdefault("learner_train_fraction", q["step_time_s"] * (q["steps"] - 1) / window)

    def pair(mine: list[dict[str, Any]], key: str) -> float | None:
        return _ratio(by(mine, first, 1, key, "in_flight"), by(mine, first, 4, key))

    seeds = sorted({q["seed"] for q in points})
    per_seed = [pair([q for q in points if q["seed"] == seed], "samples_per_s") for seed in seeds]
    # the learner bounds every point (it hardly waits), so its share of wall time spent in
    # optimizer steps is samples/s with the machine's speed divided out: a ratio that load
    # from other work on the cores changes much less than samples/s
    trains = [
        pair([q for q in points if q["seed"] == seed], "learner_train_fraction") for seed in seeds
    ]
    return {
        "speedup_eta4_vs_eta0": _ratio(fast, base),
        "speedup_loss": first,
        "inflight_eta1_over_between_eta4": _ratio(
            by(points, first, 1, "samples_per_s", "in_flight"), fast
        ),
        "inflight_eta1_over_between_eta4_per_seed": [r for r in per_seed if r is not None],
        "inflight_eta1_over_between_eta4_train_fraction": pair(points, "learner_train_fraction"),
        "inflight_eta1_over_between_eta4_per_cpu_s": pair(points, "samples_per_cpu_s"),
        "inflight_eta1_over_between_eta4_train_fraction_per_seed": [
            r for r in trains if r is not None
        ],
        "final_reward_inflight_eta1_minus_between_eta0": _difference(
            by(points, first, 1, "final_reward", "in_flight"), by(points, first, 0, "final_reward")
        ),
        # the same at the step count every point reached: learning per sample, not per second
        "final_reward_inflight_eta1_minus_between_eta0_at_fixed_steps": _difference(
            by(points, first, 1, "reward_at_fixed_steps_value", "in_flight"),
            by(points, first, 0, "reward_at_fixed_steps_value"),
        ),
        **eta8_minus_eta0(points, first),
        "samples_per_s_by_eta": {loss: table(between, loss, "samples_per_s") for loss in losses},
        "final_reward_by_eta": {loss: table(between, loss, "final_reward") for loss in losses},
        "by_mode": {
            mode: {
                key: table(
                    [q for q in points if q.get("weight_update", "between_groups") == mode],
                    first,
                    key,
                )
                for key in MODE_KEYS
            }
            for mode in modes
        },
    }


def eta8_minus_eta0(points: list[dict[str, Any]], loss: str) -> dict[str, Any]:
    """`final_reward_eta8_minus_eta0`: bench/results/stability.json's (the losses' own bench,
    median of its seeds, same step budget) when that file exists, else this sweep's (first
    loss, between-groups, median of seeds); `..._from` says which."""
    mine = _difference(by(points, loss, 8, "final_reward"), by(points, loss, 0, "final_reward"))
    out = {"final_reward_eta8_minus_eta0_this_sweep": mine}
    stability = RESULTS / "stability.json"
    data = json.loads(stability.read_text()) if stability.is_file() else {}
    if "final_reward_eta8_minus_eta0" in data:
        return out | {
            "final_reward_eta8_minus_eta0": data["final_reward_eta8_minus_eta0"],
            "final_reward_eta8_minus_eta0_from": {
                "file": "bench/results/stability.json",
                "command": data.get("command"),
            },
        }
    return out | {
        "final_reward_eta8_minus_eta0": mine,
        "final_reward_eta8_minus_eta0_from": {"file": "this sweep", "loss": loss},
    }


# --- the pictures -------------------------------------------------------------------------


def by(
    points: list[dict[str, Any]], loss: str, eta: int, key: str, mode: str = "between_groups"
) -> float | None:
    """The median of `key` over the points of one (loss, η, mode); None where none has it."""
    values = [
        p[key]
        for p in points
        if p["loss"] == loss
        and p["max_staleness"] == eta
        and p.get("weight_update", "between_groups") == mode
        and p.get(key) is not None
    ]
    return statistics.median(values) if values else None


def plot(
    points: list[dict[str, Any]], losses: list[str], etas: list[int], out: Path, modes: list[str]
) -> None:
    """<out stem>_throughput.png (samples/s, idle fractions vs η) and <out stem>_reward.png
    (reward vs wall-clock): a line (a panel) per loss and weight-update mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    etas = sorted(etas)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for loss, mode in [(loss, mode) for loss in losses for mode in modes]:
        name = f"{loss}, {mode}" if len(modes) > 1 else loss
        ax1.plot(
            etas, [by(points, loss, e, "samples_per_s", mode) for e in etas], marker="o", label=name
        )
        ax2.plot(
            etas,
            [by(points, loss, e, "learner_wait_fraction", mode) for e in etas],
            marker="o",
            label=f"learner waits ({name})",
        )
        ax2.plot(
            etas,
            [by(points, loss, e, "actor_wait_fraction", mode) for e in etas],
            marker="s",
            ls="--",
            label=f"actor waits ({name})",
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
    fig.savefig(out.with_name(f"{out.stem}_throughput.png"), dpi=120)
    plt.close(fig)

    panels = [(loss, mode) for loss in losses for mode in modes]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (loss, mode) in zip(axes[0], panels, strict=True):
        for p in [p for p in points if p["loss"] == loss and p["weight_update"] == mode]:
            t = [c[0] for c in p["curve"]]
            r = [c[2] for c in p["curve"]]
            k = max(1, len(r) // 25)
            smooth = [statistics.fmean(r[max(0, j - k + 1) : j + 1]) for j in range(len(r))]
            ax.plot(t, smooth, label=f"η={p['max_staleness']} seed {p['seed']}")
        ax.set(
            xlabel="wall-clock s (learner)",
            ylabel="mean reward (smoothed)",
            title=f"{loss}, {mode}",
            ylim=(0, 1),
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_name(f"{out.stem}_reward.png"), dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default=str(REPO / "configs" / "tiny_cpu.toml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--etas", default="0,1,2,4,8", help="in this order within each seed")
    p.add_argument("--losses", default="decoupled_ppo,ppo")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument(
        "--budget-s", type=float, default=120.0, help="wall-clock per point, start-up included"
    )
    p.add_argument("--modes", default="between_groups", help="actor.weight_update values")
    p.add_argument("--out", default=str(RESULTS / "staleness.json"))
    p.add_argument("--keep-runs", default="", help="keep every point's run directory under here")
    p.add_argument(
        "--summarise",
        default="",
        metavar="JSON",
        help="no runs: summarise and plot the points of an earlier result again",
    )
    args = p.parse_args()
    if args.summarise:
        resummarise(Path(args.summarise), Path(args.out))
        return
    cfg = load_config(args.config, args.set)
    etas = [int(x) for x in args.etas.split(",")]
    losses = args.losses.split(",")
    modes = args.modes.split(",")
    from asyncrl.models.tiny import ensure_model

    ensure_model(cfg.model, cfg.task)  # warm-up: built once, outside every point
    points = sweep(cfg, losses, etas, modes, args.seeds, args.budget_s, args.keep_runs)
    reward_at(points)
    out = Path(args.out)
    result = {
        "command": command_line(__file__),
        "config": cfg.to_dict(),
        "environment": environment(),
        "budget_s": args.budget_s,
        **summarise(points, losses, etas, modes, cfg.samples_per_step),
        "points": points,
    }
    write_json(out, result)
    plot(points, losses, etas, out, modes)
    print(
        f"speedup η=4 vs η=0 ({losses[0]}): {result['speedup_eta4_vs_eta0']}; in-flight η=1 "
        f"over between-groups η=4: {result['inflight_eta1_over_between_eta4']}; wrote {out}",
        flush=True,
    )


def resummarise(src: Path, out: Path) -> None:
    """The top-level figures and plots of `src`'s points again (with this file's summary code),
    written to `out`; the runs' own command stays, this one is added as `summarised_by`."""
    data = json.loads(src.read_text())
    points = data["points"]
    losses = list(dict.fromkeys(q["loss"] for q in points))
    etas = list(dict.fromkeys(q["max_staleness"] for q in points))
    modes = list(dict.fromkeys(q.get("weight_update", "between_groups") for q in points))
    per_step = data["config"]["learner"]["groups_per_step"] * data["config"]["actor"]["group_size"]
    data.update(summarise(points, losses, etas, modes, per_step))
    data["summarised_by"] = command_line(__file__)
    write_json(out, data)
    plot(points, losses, etas, out, modes)
    print(
        f"in-flight η=1 over between-groups η=4: {data['inflight_eta1_over_between_eta4']}, "
        f"learner training share: {data['inflight_eta1_over_between_eta4_train_fraction']}"
    )


def sweep(
    cfg: RunConfig,
    losses: list[str],
    etas: list[int],
    modes: list[str],
    seeds: int,
    budget_s: float,
    keep: str,
) -> list[dict[str, Any]]:
    """Every point, interleaved (per seed: each η's modes and losses back to back) so slow
    drifts in machine load hit all alike; run directories under `keep` (else a temporary one)."""
    combos = [
        (loss, eta, seed, mode)
        for seed in range(seeds)
        for eta in etas
        for mode in modes
        for loss in losses
    ]
    points = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-staleness-") as tmp:
        for i, (loss, eta, seed, mode) in enumerate(combos, 1):
            print(
                f"[{i}/{len(combos)}] loss={loss} η={eta} seed={seed} {mode}: running for "
                f"{budget_s:.0f} s (loadavg {os.getloadavg()[0]:.1f}) ...",
                flush=True,
            )
            start = time.perf_counter()
            point = run_point(
                cfg, loss, eta, cfg.run.seed + seed, budget_s, Path(keep or tmp), mode
            )
            point["prompt_tokens"] = cfg.task.num_digits + 2  # <bos>, digits, ':'
            points.append(point)
            print(
                f"[{i}/{len(combos)}]   {point['samples_per_s']:.1f} samples/s, learner waits {point['learner_wait_fraction']:.0%}, "
                f"actor waits {point['actor_wait_fraction']:.0%}, reward {point['final_reward']:.3f}, "
                f"mean staleness {point['staleness_mean']:.2f}, dropped {point['dropped_stale']}, "
                f"{point['inflight_updates']} in-flight updates ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    return points


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _difference(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


if __name__ == "__main__":
    main()
