"""Simulate asyncrl at cluster scale: calibrate against measured runs, predict throughput vs η.

    python bench/simulate.py calibrate [--measured bench/results/staleness.json]
    python bench/simulate.py predict --world 512 --actors 2048 [--eta 0 1 2 4 8]
                                     [--modes between_groups,in_flight]
                                     [--assume key=value ...] [--what-if-no-weight-wait]

The model (bench/sim/model.py) drives the hub's own core (`replay.core.HubCore`: admission,
credits, the replay buffer, batches) with simulated actors, learner and weight publications.
`calibrate` fits the free time parameters to `bench/staleness.py`'s measured points and reports
the error per point; `predict` runs the stated `ClusterAssumptions` (bench/sim/cluster.py) for
each η, repeated over seeds (median/min/max), and writes bench/results/simulate.json and
bench/results/simulate_world512.png (named after --world). Both record the command.
The model is asyncrl's behaviour: actors wait for weights >= c - η, the learner pipelines its
sample request. `calibrate` also fits a message latency (from the η = 0 points) and lets batch
and step times vary as measured; `predict` takes both as 0 (one hop of a millisecond against
generation and step times of seconds); `--what-if-no-weight-wait` also runs actors that start
at once (the earlier actor), for comparison.

`--modes` predicts each η for each `actor.weight_update`: `predictions` holds between-groups
updates (as before), `predictions_in_flight` in-flight updates, whose pause per update comes
from `ClusterAssumptions.inflight_pause` (weight copy + KV recompute of the sequences in flight;
`--assume inflight_recompute=0` for a kept cache). Calibration simulates each measured point in
its own mode, in-flight points with the measured pause per update.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.sim.calibrate import calibrate
from bench.sim.cluster import ClusterAssumptions
from bench.sim.model import SimConfig, simulate
from bench.sim.points import load_points

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
METRICS = (
    "samples_per_s",
    "tokens_per_s",
    "learner_idle_fraction",
    "actor_idle_fraction",
    "mean_staleness",
    "groups_dropped_stale",
    "mean_step_s",
    "mean_generate_s",
    "mean_batch_seqs",
    "mean_sync_latency_s",
    "inflight_updates",
    "mixed_version_frac",
    "tokens_per_weight_version",
)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/simulate.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    cal = sub.add_parser("calibrate", help="fit time parameters to measured runs")
    pre = sub.add_parser("predict", help="predict a cluster under stated assumptions")
    for q in (cal, pre):
        q.add_argument("--measured", default=str(RESULTS / "staleness.json"))
        q.add_argument("--out", default=str(RESULTS / "simulate.json"))
    cal.add_argument("--steps", type=int, default=1000, help="simulated steps per point")
    cal.add_argument(
        "--no-spread",
        action="store_true",
        help="every batch and step takes its mean time (ignore the measured time quantiles)",
    )
    pre.add_argument("--world", type=int, default=512, help="learner GPUs L")
    pre.add_argument("--actors", type=int, default=2048, help="rollout actors A")
    pre.add_argument("--concurrency", type=int, default=None)
    pre.add_argument("--group-size", type=int, default=None)
    pre.add_argument("--groups-per-step", type=int, default=None)
    pre.add_argument("--eta", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    pre.add_argument("--measure", type=int, default=20, help="measured learner steps per run")
    pre.add_argument(
        "--warmup", type=int, default=None, help="steps before measuring (default η + 4)"
    )
    pre.add_argument("--repeats", type=int, default=3, help="seeds per η (median/min/max)")
    pre.add_argument(
        "--modes", default="between_groups,in_flight", help="actor.weight_update values to predict"
    )
    pre.add_argument(
        "--assume",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a ClusterAssumptions field",
    )
    pre.add_argument(
        "--jobs",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="simulations run in parallel processes",
    )
    pre.add_argument(
        "--what-if-no-weight-wait",
        action="store_true",
        help="also simulate actors that generate at once with the weights they hold",
    )
    pre.add_argument("--png", default=None, help="plot path (default simulate_world<L>.png)")
    return p.parse_args(list(argv))


def assumptions_from(args: argparse.Namespace) -> ClusterAssumptions:
    """Defaults, then the CLI's shape flags, then `--assume field=value`."""
    values: dict[str, Any] = {"world": args.world, "num_actors": args.actors}
    for flag, name in (
        ("concurrency", "concurrency"),
        ("group_size", "group_size"),
        ("groups_per_step", "groups_per_step"),
    ):
        if getattr(args, flag) is not None:
            values[name] = getattr(args, flag)
    types = {f.name: f.type for f in dataclasses.fields(ClusterAssumptions)}
    for item in args.assume:
        name, _, text = item.partition("=")
        if name not in types or not text:
            raise ValueError(
                f"--assume {item!r}: expected FIELD=VALUE, FIELD one of {sorted(types)}"
            )
        values[name] = int(text) if types[name] == "int" else float(text)
    return ClusterAssumptions(**values)


def sim_config(
    a: ClusterAssumptions,
    eta: int,
    measure: int,
    warmup: int,
    seed: int,
    wait_for_weights: bool = True,
    mode: str = "between_groups",
) -> SimConfig:
    """The simulation of one η (and weight-update mode) under the assumptions."""
    plan = a.bucket_plan()
    num_params = plan.total_bytes // a.dtype_bytes
    pause_s, pause_per_seq_s = a.inflight_pause(num_params)
    return SimConfig(
        weight_update=mode,  # type: ignore[arg-type]
        inflight_pause_s=pause_s,
        inflight_pause_per_seq_s=pause_per_seq_s,
        num_actors=a.num_actors,
        concurrency=a.concurrency,
        credit_window=a.credit_window or 2 * a.concurrency,
        group_size=a.group_size,
        groups_per_step=a.groups_per_step,
        max_staleness=eta,
        num_steps=warmup + measure,
        warmup_steps=warmup,
        seed=seed,
        wait_for_weights=wait_for_weights,
        lengths=a.lengths(),
        generation=a.generation(num_params),
        learner=a.learner(num_params),
        sync=a.sync(plan),
    )


def _run_one(job: tuple[ClusterAssumptions, int, int, int, int, bool, str]) -> dict[str, Any]:
    start = time.process_time()
    result = simulate(sim_config(*job)).to_dict()
    return result | {"cpu_s": time.process_time() - start}


def predict(args: argparse.Namespace) -> dict[str, Any]:
    """Every η and mode (and the what-if, when asked) over `repeats` seeds, on `jobs` processes."""
    a = assumptions_from(args)
    modes = args.modes.split(",")
    variants = [(True, m) for m in modes] + [
        (False, "between_groups")
    ] * args.what_if_no_weight_wait
    warmups = {eta: eta + 4 if args.warmup is None else args.warmup for eta in args.eta}
    jobs = [
        (a, eta, args.measure, warmups[eta], seed, wait, mode)
        for wait, mode in variants
        for eta in args.eta
        for seed in range(args.repeats)
    ]
    start = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(_run_one, jobs))
    out: dict[str, Any] = {"assumptions": dataclasses.asdict(a), "derived": a.derived()}
    names = {
        (True, "between_groups"): "predictions",
        (True, "in_flight"): "predictions_in_flight",
        (False, "between_groups"): "what_if_no_weight_wait",
    }
    for wait, mode in variants:
        rows = []
        for eta in args.eta:
            runs = [
                r
                for job, r in zip(jobs, results, strict=True)
                if job[1] == eta and job[5:] == (wait, mode)
            ]
            rows.append(_summary(eta, runs) | {"warmup_steps": warmups[eta], "weight_update": mode})
            _print_row(rows[-1], f"{mode}: " if wait else "what-if no weight wait: ")
        out[names[wait, mode]] = rows
    out["simulation_wall_s"] = time.perf_counter() - start
    print(
        f"simulated {len(jobs)} runs in {out['simulation_wall_s']:.1f} s on {args.jobs} processes"
    )
    return out


def _print_row(row: dict[str, Any], prefix: str) -> None:
    m = {k: v["median"] for k, v in row["metrics"].items()}
    print(
        f"{prefix}η={row['max_staleness']}: {m['samples_per_s']:.0f} samples/s, learner idle "
        f"{m['learner_idle_fraction']:.2f}, actor idle {m['actor_idle_fraction']:.2f}, "
        f"mean staleness {m['mean_staleness']:.2f}, dropped {m['groups_dropped_stale']:.0f}, "
        f"{row['cpu_s']:.1f} s cpu",
        flush=True,
    )


def _summary(eta: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    metrics = {}
    for key in METRICS:
        values = [float(r[key]) for r in runs]
        metrics[key] = {"median": float(np.median(values)), "min": min(values), "max": max(values)}
    hist = np.sum([r["staleness_histogram"] for r in runs], axis=0)
    return {
        "max_staleness": eta,
        "metrics": metrics,
        "staleness_histogram": [int(x) for x in hist],
        "sync_s": runs[0]["sync_s"],
        "window_s": [r["window_s"] for r in runs],
        "cpu_s": sum(r["cpu_s"] for r in runs),
    }


def calibration_section(measured: str, steps: int = 1000, spread: bool = True) -> dict[str, Any]:
    """Calibrate when measured points exist; otherwise say why not."""
    if not Path(measured).is_file():
        return {"status": f"not run: {measured} not found (bench/staleness.py writes it)"}
    cal = calibrate(load_points(measured), num_steps=steps, spread=spread)
    return {"status": "ok", "measured": measured, "spread": spread, **cal.to_dict()}


def print_calibration(section: dict[str, Any]) -> None:
    if section["status"] != "ok":
        print(f"calibration {section['status']}")
        return
    g = section["generation"]
    print(
        f"generation: fixed {g['fixed_s']:.4g} s + {g['step_s']:.4g} s/step + "
        f"{g['token_s']:.4g} s/token; sync {section['sync_s']:.4g} s; in-flight pause "
        f"{section.get('inflight_pause_s', 0.0):.4g} s"
    )
    fit = section["latency_fit"]
    print(
        f"message latency {section['message_latency_s'] * 1e3:.3g} ms "
        f"({fit['status']}; hops per step {[round(h, 2) for h in fit.get('hops_per_step', [])]}); "
        f"time spread {'on' if section['spread'] else 'off'}"
    )
    for loss, f in section["learner"].items():
        print(
            f"learner[{loss}]: {f['overhead_s']:.4g} s + {f['token_s']:.4g} s/token/rank "
            f"+ {f['outside_s']:.4g} s outside the step"
        )
    print(
        "loss     mode      η | samples/s meas  sim  err  own | learner wait meas sim own | "
        "actor wait meas sim own | staleness meas sim | drops/step meas sim"
    )
    for p in section["points"]:
        m, s, o = p["measured"], p["simulated"], p["own_times"]
        mode = "in-flight" if p.get("weight_update") == "in_flight" else ""
        print(
            f"{p['loss'][:9]:9s}{mode:>9s} {p['max_staleness']:d} | {m['samples_per_s']:8.1f} "
            f"{s['samples_per_s']:6.1f} {p['rel_err_samples_per_s']:+5.0%} "
            f"{o['rel_err_samples_per_s']:+5.0%} | {m['learner_wait_fraction']:9.2f} "
            f"{s['learner_wait_fraction']:.2f} {o['simulated']['learner_wait_fraction']:.2f} | "
            f"{m['actor_wait_fraction']:10.2f} {s['actor_wait_fraction']:.2f} "
            f"{o['simulated']['actor_wait_fraction']:.2f} | {_fmt(m['mean_staleness'])} "
            f"{s['mean_staleness']:.2f} | {_fmt(m['groups_dropped_stale_per_step'])} "
            f"{s['groups_dropped_stale_per_step']:.2f}"
        )


def _fmt(x: float | None) -> str:
    return "  -  " if x is None else f"{x:5.2f}"


def provenance(argv: Sequence[str]) -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "command": "python bench/simulate.py " + shlex.join(argv),
        "git_commit": commit,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
        },
        "versions": {"numpy": np.__version__},
    }


def write_json(path: str, data: dict[str, Any]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}")


def plot_predictions(result: dict[str, Any], png: Path) -> None:
    """Throughput, idle fractions and dropped groups vs η per weight-update mode; staleness
    histograms per η (between-groups)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [
        (k, label)
        for k, label in (("predictions", "between groups"), ("predictions_in_flight", "in flight"))
        if k in result
    ]
    rows = result[modes[0][0]]  # the staleness histograms: between groups when predicted
    etas = [r["max_staleness"] for r in rows]
    x = np.arange(len(etas))
    width = 0.8 / len(modes)

    def series(rows: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
        med = np.array([r["metrics"][key]["median"] for r in rows])
        spread = np.array(
            [
                [med[i] - r["metrics"][key]["min"], r["metrics"][key]["max"] - med[i]]
                for i, r in enumerate(rows)
            ]
        ).T
        return med, spread

    a = result["assumptions"]
    fig, ax = plt.subplots(2, 2, figsize=(12, 8.5))
    steps = result["config"]["measure"]
    for m, (key, label) in enumerate(modes):
        at = x + (m - (len(modes) - 1) / 2) * width
        med, err = series(result[key], "samples_per_s")
        ax[0, 0].bar(at, med, width, yerr=err, capsize=3, label=label)
        med, err = series(result[key], "groups_dropped_stale")
        ax[1, 1].bar(at, med / steps, width, yerr=err / steps, capsize=3, label=label)
        for metric, style in (("learner_idle_fraction", "-o"), ("actor_idle_fraction", "--s")):
            med, err = series(result[key], metric)
            ax[0, 1].errorbar(
                etas,
                med,
                yerr=err,
                fmt=style,
                capsize=3,
                label=f"{metric.replace('_', ' ')} ({label})",
            )
    if "what_if_no_weight_wait" in result:
        what_if = [
            r["metrics"]["samples_per_s"]["median"] for r in result["what_if_no_weight_wait"]
        ]
        ax[0, 0].plot(x, what_if, "k--o", label="what-if: actors do not wait for weights")
    ax[0, 0].set(title="learner throughput", ylabel="samples / s", xlabel="η (max_staleness)")
    ax[0, 0].legend()
    ax[0, 1].set(title="idle (waiting) fractions", ylim=(-0.02, 1.02), xlabel="η")
    ax[0, 1].legend(fontsize=7)
    hist_width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        hist = np.asarray(r["staleness_histogram"], dtype=float)
        ax[1, 0].bar(
            np.arange(hist.size) + i * hist_width,
            hist / max(1.0, hist.sum()),
            hist_width,
            label=f"η={r['max_staleness']}",
        )
    ax[1, 0].set(
        title=f"staleness of consumed groups ({modes[0][1]})",
        xlabel="policy_version - min_policy_version",
        ylabel="share of groups",
    )
    ax[1, 0].legend()
    ax[1, 1].set(title=f"groups dropped as stale per step (of {a['groups_per_step']})", xlabel="η")
    ax[1, 1].legend()
    for axis in (ax[0, 0], ax[1, 1]):
        axis.set_xticks(x, [str(e) for e in etas])
    fig.suptitle(
        f"asyncrl simulated: L={a['world']} learner GPUs, A={a['num_actors']} actors, "
        f"{a['groups_per_step']}x{a['group_size']} samples/step (8B bf16, H200)"
    )
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    print(f"wrote {png}")


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    if args.command == "calibrate":
        if not Path(args.measured).is_file():
            print(
                f"calibrate: {args.measured} not found (bench/staleness.py writes it)",
                file=sys.stderr,
            )
            return 2
        section = calibration_section(args.measured, args.steps, not args.no_spread) | provenance(
            argv
        )
        print_calibration(section)
        out = Path(args.out)  # keep an earlier prediction, replace its calibration
        data = json.loads(out.read_text()) if out.is_file() else {}
        write_json(args.out, data | {"calibration": section})
        return 0
    result = predict(args) | provenance(argv)
    result["config"] = {k: v for k, v in vars(args).items() if k != "command"}
    result["calibration"] = calibration_section(args.measured)
    print_calibration(result["calibration"])
    png = Path(args.png or RESULTS / f"simulate_world{args.world}.png")
    plot_predictions(result, png)
    result["plot"] = str(png.relative_to(ROOT) if png.is_relative_to(ROOT) else png)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
