"""`asyncrl run CONFIG`: hub, actors and learner as processes on this machine, with progress.

```
  asyncrl run ──starts──> asyncrl replay  (writes its bound endpoint to run_dir/hub.endpoint)
              ──starts──> asyncrl actor × run.num_actors   (--hub <endpoint>)
              ──starts──> asyncrl learner                  (--hub <endpoint>)
              <──tails─── run_dir/metrics.jsonl  -> one progress line per run.progress_every_s
  stop: the learner exits after learner.max_steps (or run.max_wall_s / Ctrl-C sends it SIGTERM;
  it checkpoints and hands its final weights to the actors), then actors, then the hub get
  SIGTERM, each by pid; anything still alive after a grace period is killed, by pid.
```

The run directory receives: config.toml (resolved), prompts.jsonl, metrics.jsonl, tb/
(TensorBoard), checkpoints/, actor-*.json (each actor's final version and weights digest),
learner_summary.json, hub.log / actor-*.log / learner.log, reward.png and summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.config import RunConfig, load_config, to_toml


class Processes:
    """The child processes of a run, started and ended by pid."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, args: Sequence[str], threads: int) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
        log = open(self.run_dir / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the child
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl", *args], stdout=log, stderr=subprocess.STDOUT, env=env
        )
        self.procs[name] = proc
        pids = {n: p.pid for n, p in self.procs.items()}
        (self.run_dir / "pids.json").write_text(json.dumps(pids))  # for operators and tests
        return proc

    def stop(self, names: Sequence[str], grace_s: float) -> None:
        """SIGTERM these children, wait up to grace_s, then SIGKILL the rest (all by pid)."""
        live = [self.procs[n] for n in names if n in self.procs and self.procs[n].poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in live:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def failed(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() not in (None, 0)]


def prepare(cfg: RunConfig, run_dir: Path) -> tuple[Path, Path]:
    """Resolved config, the hub's prompts (from the task registry) and the model, before any
    process starts."""
    from actors.envs.registry import write_prompts
    from asyncrl.tiny_model import ensure_model

    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.toml"
    config_path.write_text(to_toml(cfg))
    dataset = write_prompts(cfg.task, run_dir / "prompts.jsonl")
    ensure_model(cfg.model, cfg.task)  # built once here, so children never race to build it
    return config_path, dataset


def wait_for_file(path: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        if proc.poll() is not None:
            raise RuntimeError(
                f"the hub exited with code {proc.returncode} before binding; see {path.parent / 'hub.log'}"
            )
        time.sleep(0.05)
    raise TimeoutError(f"the hub did not report its endpoint within {timeout_s} s")


def thread_split(cfg: RunConfig) -> tuple[int, int]:
    """(learner threads, threads per actor) on this machine."""
    cores = os.cpu_count() or 2
    learner = cfg.run.learner_threads or max(1, cores // 2)
    actor = cfg.run.actor_threads or max(1, (cores - learner) // cfg.run.num_actors)
    return learner, actor


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a metrics.jsonl (the line being written is left for later)."""
    return MetricsTail(path, keep=None).poll()


class MetricsTail:
    """The records a growing metrics.jsonl gained since the last poll, parsed once each: the
    progress line of a long run costs its new lines, not the whole file every second."""

    def __init__(self, path: Path, keep: int | None = 10) -> None:
        self.path = path
        self.offset = 0
        self.recent: deque[dict[str, Any]] = deque(maxlen=keep)

    def poll(self) -> list[dict[str, Any]]:
        """The last `keep` records (all of them with keep=None), new ones read first."""
        if self.path.is_file():
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
            complete = data.rfind(b"\n") + 1  # a line without its newline is still being written
            for line in data[:complete].splitlines():
                try:
                    self.recent.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # blank, or torn by a crash and continued by a resumed learner
            self.offset += complete
        return list(self.recent)


def progress_line(rows: list[dict[str, Any]], elapsed_s: float) -> str:
    if not rows:
        return f"[{elapsed_s:6.1f}s] waiting for the first learner step..."
    last = rows[-1]
    recent = rows[-10:]
    reward = sum(r["reward_mean"] for r in recent) / len(recent)
    span = recent[-1]["time_s"] - recent[0]["time_s"]
    samples = sum(r["samples"] for r in recent[1:])
    rate = samples / span if span > 0 else last["samples_per_s"]
    return (
        f"[{elapsed_s:6.1f}s] step {last['step']:4d}  version {last['policy_version']:4d}  "
        f"reward {reward:.3f}  staleness max {last['staleness_max']} mean {last['staleness_mean']:.2f}  "
        f"samples/s {rate:7.1f}  wait {last['wait_data_s']:.2f}s"
    )


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """First-tenth and last-tenth mean reward (the learning criterion) and totals."""
    if not rows:
        return {"steps": 0}
    tenth = max(1, len(rows) // 10)
    first = [r["reward_mean"] for r in rows[:tenth]]
    last = [r["reward_mean"] for r in rows[-tenth:]]
    return {
        "steps": len(rows),
        "final_policy_version": rows[-1]["policy_version"],
        "reward_first_tenth": sum(first) / len(first),
        "reward_last_tenth": sum(last) / len(last),
        "reward_gain": sum(last) / len(last) - sum(first) / len(first),
        "staleness_max": max(r["staleness_max"] for r in rows),
        "time_s": rows[-1]["time_s"],
        "samples_per_s": sum(r["samples"] for r in rows) / max(rows[-1]["time_s"], 1e-9),
    }


def plot_reward(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    times = [r["time_s"] for r in rows]
    ax.plot(times, [r["reward_mean"] for r in rows], lw=1, alpha=0.4, label="per step")
    k = max(1, len(rows) // 20)
    smooth = [
        sum(r["reward_mean"] for r in rows[max(0, i - k + 1) : i + 1])
        / len(rows[max(0, i - k + 1) : i + 1])
        for i in range(len(rows))
    ]
    ax.plot(times, smooth, lw=2, label=f"mean of last {k} steps")
    ax.set_xlabel("wall-clock time since training started (s)")
    ax.set_ylabel("mean reward (0-1)")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: RunConfig, run_dir: Path, quiet: bool = False, resume: bool = False) -> dict[str, Any]:
    """Start everything, show progress until the learner finishes or the budget runs out.

    With `resume`, the learner continues from the run directory's latest checkpoint (its
    policy_version included) and metrics.jsonl is appended to.
    """
    config_path, dataset = prepare(cfg, run_dir)
    (run_dir / "hub.endpoint").unlink(missing_ok=True)
    if not resume:
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    procs = Processes(run_dir)
    learner_threads, actor_threads = thread_split(cfg)
    start = time.monotonic()
    interrupted = False
    try:
        hub = procs.start(
            "hub",
            [
                "replay",
                "--config",
                str(config_path),
                "--dataset",
                str(dataset),
                "--endpoint-file",
                str(run_dir / "hub.endpoint"),
            ],
            threads=1,
        )
        endpoint = wait_for_file(run_dir / "hub.endpoint", hub, timeout_s=60)
        actor_names = [f"actor-{i}" for i in range(cfg.run.num_actors)]
        for i, name in enumerate(actor_names):
            procs.start(
                name,
                [
                    "actor",
                    "--config",
                    str(config_path),
                    "--hub",
                    endpoint,
                    "--actor-id",
                    name,
                    "--index",
                    str(i),
                    "--status-file",
                    str(run_dir / f"{name}.json"),
                ],
                threads=actor_threads,
            )
        learner_args = [
            "learner",
            "--config",
            str(config_path),
            "--hub",
            endpoint,
            "--run-dir",
            str(run_dir),
        ]
        learner = procs.start(
            "learner", learner_args + (["--resume"] if resume else []), threads=learner_threads
        )
        next_print = 0.0
        tail = MetricsTail(run_dir / "metrics.jsonl")
        while learner.poll() is None:
            elapsed = time.monotonic() - start
            if cfg.run.max_wall_s and elapsed > cfg.run.max_wall_s:
                print(
                    f"wall-clock budget of {cfg.run.max_wall_s:.0f} s reached: stopping the learner",
                    flush=True,
                )
                procs.stop(["learner"], grace_s=cfg.weights.timeout_s + 30)
                break
            if procs.failed():
                raise RuntimeError(
                    f"{', '.join(procs.failed())} exited with an error; see the logs in {run_dir}"
                )
            if not quiet and elapsed >= next_print:
                print(progress_line(tail.poll(), elapsed), flush=True)
                next_print = elapsed + cfg.run.progress_every_s
            time.sleep(0.1)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: stopping the learner, actors and hub", flush=True)
    finally:
        procs.stop(["learner"], grace_s=cfg.weights.timeout_s + 30)
        procs.stop([n for n in procs.procs if n.startswith("actor-")], grace_s=30)
        procs.stop(["hub"], grace_s=10)
    rows = read_metrics(run_dir / "metrics.jsonl")
    summary = summarize(rows)
    summary["exit_codes"] = {n: p.returncode for n, p in procs.procs.items()}
    summary["interrupted"] = interrupted
    if rows:
        plot_reward(
            rows,
            run_dir / "reward.png",
            f"{cfg.task.name}: {cfg.loss.name}, η = {cfg.replay.max_staleness}",
        )
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl run", description="Run hub, actors and learner here.")
    p.add_argument("config", help="run config TOML, e.g. configs/tiny_cpu.toml")
    p.add_argument("--run-dir", default="", help="overrides run.run_dir")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, e.g. learner.max_steps=50",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument(
        "--resume", action="store_true", help="continue the run directory's latest checkpoint"
    )
    return p.parse_args(list(argv))


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    overrides = list(args.set) + (
        [f"run.run_dir={json.dumps(args.run_dir)}"] if args.run_dir else []
    )
    cfg = load_config(args.config, overrides)
    run_dir = Path(cfg.run.run_dir)
    signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's stop: the Ctrl-C path, by pid
    summary = run(cfg, run_dir, quiet=args.quiet, resume=args.resume)
    if summary.get("steps"):
        print(
            f"done: {summary['steps']} steps in {summary['time_s']:.0f} s; reward {summary['reward_first_tenth']:.3f} "
            f"(first tenth) -> {summary['reward_last_tenth']:.3f} (last tenth); max staleness "
            f"{summary['staleness_max']}; {summary['samples_per_s']:.1f} samples/s. Plot: {run_dir / 'reward.png'}",
            flush=True,
        )
    bad = {n: c for n, c in summary["exit_codes"].items() if c not in (0, None)}
    if bad and not summary["interrupted"]:
        print(f"processes exited with errors: {bad}; logs in {run_dir}", file=sys.stderr)
        return 1
    return 130 if summary["interrupted"] else 0
