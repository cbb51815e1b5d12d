"""`asyncrl run CONFIG`: hub, actors and learner as processes on this machine, with progress.

```
  asyncrl run ──starts──> asyncrl reward-server, when [reward_model] serve = true (its endpoint
              (first)      goes into run_dir/config.toml for the actors' reward_model component)
              ──starts──> asyncrl replay  (writes its bound endpoint to run_dir/hub.endpoint)
              ──starts──> asyncrl actor × run.num_actors   (--hub <endpoint>)
              ──starts──> asyncrl learner                  (--hub <endpoint>)
              <──tails─── run_dir/metrics.jsonl  -> one progress line per run.progress_every_s
  stop: the learner exits after learner.max_steps (or run.max_wall_s / Ctrl-C sends it SIGTERM;
  it checkpoints and hands its final weights to the actors), then actors, then the hub get
  SIGTERM (the reward server last), each by pid; anything still alive after a grace period is killed, by pid.
  Each child runs in its own process group: a terminal's Ctrl-C reaches `asyncrl run` alone,
  which stops them in this order (SIGTERM and SIGHUP to it do the same); a child gets SIGTERM
  if `asyncrl run` itself dies.
  crash: a child that exits with an error is restarted (launch/supervise.py), bounded and
  with backoff; a run that cannot go on ends with one line saying why.
```

The run directory receives: config.toml (resolved), prompts.jsonl, metrics.jsonl, tb/
(TensorBoard), checkpoints/, actor-*.json (each actor's final version and weights digest),
learner_summary.json, hub.log / actor-*.log / learner.log, reward.png and summary.json;
trained_groups.jsonl (the groups of each learner step) and, for a durable hub, replay/ (its
write-ahead log and snapshot).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from asyncrl.config import RunConfig, load_config, to_toml
from launch.processes import Processes
from launch.supervise import Supervisor
from learner.metrics_log import MetricsTail, read_metrics


def prepare(cfg: RunConfig, run_dir: Path) -> tuple[Path, Path]:
    """Resolved config, the hub's prompts (from the task registry) and the model, before any
    process starts."""
    from actors.envs.registry import write_prompts
    from asyncrl.models.tiny import ensure_model

    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.toml"
    config_path.write_text(to_toml(cfg))
    dataset = write_prompts(cfg.task, run_dir / "prompts.jsonl")
    ensure_model(cfg.model, cfg.task)  # built once here, so children never race to build it
    return config_path, dataset


def start_reward_server(cfg: RunConfig, procs: Processes, config_path: Path) -> RunConfig:
    """[reward_model] serve: start `asyncrl reward-server` as a child (the tiny sort reward
    model when no model is named), wait for its endpoint and write it into the run's config,
    so the actors' reward_model component connects to it."""
    model = cfg.reward_model.model
    if not model:
        from actors.rewards.tiny_reward_model import ensure_reward_model

        model = str(ensure_reward_model(cfg.model.cache_dir, num_digits=cfg.task.num_digits))
    endpoint_file = procs.run_dir / "reward_server.endpoint"
    server = procs.start(
        "reward-server",
        [
            "reward-server",
            "--config",
            str(config_path),
            "--model",
            model,
            "--endpoint-file",
            str(endpoint_file),
            "--stats-file",
            str(procs.run_dir / "reward_server.json"),
        ],
        threads=1,
    )
    endpoint = wait_for_file(endpoint_file, server, timeout_s=120, name="reward-server")
    rm = dataclasses.replace(cfg.reward_model, model=model, endpoint=endpoint)
    cfg = dataclasses.replace(cfg, reward_model=rm)
    config_path.write_text(to_toml(cfg))
    return cfg


def wait_for_file(
    path: Path, proc: subprocess.Popen[bytes], timeout_s: float, name: str = "hub"
) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        if proc.poll() is not None:
            raise RuntimeError(
                f"the {name} exited with code {proc.returncode} before binding; see {path.parent / f'{name}.log'}"
            )
        time.sleep(0.05)
    raise TimeoutError(f"the {name} did not report its endpoint within {timeout_s} s")


def thread_split(cfg: RunConfig) -> tuple[int, int]:
    """(learner threads, threads per actor) on this machine."""
    cores = os.cpu_count() or 2
    learner = cfg.run.learner_threads or max(1, cores // 2)
    actor = cfg.run.actor_threads or max(1, (cores - learner) // cfg.run.num_actors)
    return learner, actor


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
    """Start everything, supervise it, show progress until the learner finishes, a process
    cannot go on (launch/supervise.py) or the budget runs out; `summary["reason"]` says which.

    With `resume`, the learner continues from the run directory's latest checkpoint (its
    policy_version included) and metrics.jsonl is appended to.
    """
    cfg = with_state_dir(cfg, run_dir)
    config_path, dataset = prepare(cfg, run_dir)
    (run_dir / "hub.endpoint").unlink(missing_ok=True)
    (run_dir / "reward_server.endpoint").unlink(missing_ok=True)
    if not resume:
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    procs = Processes(run_dir)
    start = time.monotonic()
    interrupted, reason, restarts = False, "", {}
    try:
        if cfg.reward_model.serve:
            cfg = start_reward_server(cfg, procs, config_path)
        hub_args = [
            "replay",
            "--config",
            str(config_path),
            "--dataset",
            str(dataset),
            "--endpoint-file",
            str(run_dir / "hub.endpoint"),
        ]
        hub = procs.start("hub", hub_args, threads=1)
        endpoint = wait_for_file(run_dir / "hub.endpoint", hub, timeout_s=60)
        commands = child_commands(cfg, config_path, run_dir, endpoint, hub_args, resume)
        for name, command in commands.items():
            if name != "hub":
                procs.start(name, *command())
        supervisor = Supervisor(
            procs, commands, max_restarts=cfg.run.max_restarts, backoff_s=cfg.run.restart_backoff_s
        )
        reason = supervise(cfg, procs, supervisor, run_dir, start, quiet)
        restarts = supervisor.summary()
    except KeyboardInterrupt:
        interrupted, reason = True, "interrupted"
        print("interrupted: stopping the learner, actors and hub", flush=True)
    except (RuntimeError, TimeoutError) as exc:  # the hub could not start
        reason = str(exc)
    finally:
        procs.stop(["learner"], grace_s=cfg.weights.timeout_s + 30)
        procs.stop([n for n in procs.procs if n.startswith("actor-")], grace_s=30)
        procs.stop(["hub"], grace_s=10)
        procs.stop(["reward-server"], grace_s=10)
    rows = read_metrics(run_dir / "metrics.jsonl")
    summary = summarize(rows)
    summary["exit_codes"] = {n: p.returncode for n, p in procs.procs.items()}
    summary.update(interrupted=interrupted, reason=reason, restarts=restarts)
    if rows:
        plot_reward(
            rows,
            run_dir / "reward.png",
            f"{cfg.task.name}: {cfg.loss.name}, η = {cfg.replay.max_staleness}",
        )
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def with_state_dir(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """A durable hub without `replay.state_dir` keeps its state under <run_dir>/replay."""
    if cfg.replay.durability != "durable" or cfg.replay.state_dir:
        return cfg
    replay = dataclasses.replace(cfg.replay, state_dir=str(run_dir / "replay"))
    return dataclasses.replace(cfg, replay=replay)


def child_commands(
    cfg: RunConfig,
    config_path: Path,
    run_dir: Path,
    endpoint: str,
    hub_args: list[str],
    resume: bool,
) -> dict[str, Callable[[], tuple[list[str], int]]]:
    """How to (re)start each child: name -> () -> (asyncrl arguments, threads). A restarted hub
    binds the endpoint everyone dials; a restarted learner resumes once a checkpoint exists."""
    learner_threads, actor_threads = thread_split(cfg)
    common = ["--config", str(config_path), "--hub", endpoint]
    commands: dict[str, Callable[[], tuple[list[str], int]]] = {
        "hub": lambda: ([*hub_args, "--bind", endpoint], 1)
    }
    for i in range(cfg.run.num_actors):
        name = f"actor-{i}"
        args = [
            "actor",
            *common,
            "--actor-id",
            name,
            "--index",
            str(i),
            "--status-file",
            str(run_dir / f"{name}.json"),
        ]
        commands[name] = lambda args=args: (args, actor_threads)
    first = [resume]

    def learner() -> tuple[list[str], int]:
        again = first.pop() if first else latest_checkpoint_exists(run_dir)
        args = ["learner", *common, "--run-dir", str(run_dir)]
        return args + (["--resume"] if again else []), learner_threads

    commands["learner"] = learner
    return commands


def latest_checkpoint_exists(run_dir: Path) -> bool:
    ckpts = run_dir / "checkpoints"
    return ckpts.is_dir() and any(ckpts.iterdir())


def supervise(
    cfg: RunConfig,
    procs: Processes,
    supervisor: Supervisor,
    run_dir: Path,
    start: float,
    quiet: bool,
) -> str:
    """The run's loop: restarts, budget, progress lines; returns why it ended."""
    next_print = 0.0
    tail = MetricsTail(run_dir / "metrics.jsonl")
    while True:
        elapsed = time.monotonic() - start
        if cfg.run.max_wall_s and elapsed > cfg.run.max_wall_s:
            print(
                f"wall-clock budget of {cfg.run.max_wall_s:.0f} s reached: stopping the learner",
                flush=True,
            )
            procs.stop(["learner"], grace_s=cfg.weights.timeout_s + 30)
            return f"wall-clock budget of {cfg.run.max_wall_s:.0f} s reached"
        reason = supervisor.check(time.monotonic())
        if reason:
            return reason
        if not quiet and elapsed >= next_print:
            print(progress_line(tail.poll(), elapsed), flush=True)
            next_print = elapsed + cfg.run.progress_every_s
        time.sleep(0.1)


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
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # nohup keeps it ignored
        signal.signal(signal.SIGHUP, _interrupt)  # the terminal closed: the same ordered stop
    try:
        summary = run(cfg, run_dir, quiet=args.quiet, resume=args.resume)
    except ValueError as exc:  # a setting that cannot work (the model, the task, the state)
        print(f"run ended: {exc}", file=sys.stderr, flush=True)
        return 2
    if summary.get("steps"):
        print(
            f"done: {summary['steps']} steps in {summary['time_s']:.0f} s; reward {summary['reward_first_tenth']:.3f} "
            f"(first tenth) -> {summary['reward_last_tenth']:.3f} (last tenth); max staleness "
            f"{summary['staleness_max']}; {summary['samples_per_s']:.1f} samples/s. Plot: {run_dir / 'reward.png'}",
            flush=True,
        )
    if summary["interrupted"]:
        return 130
    reason = summary["reason"]
    ok = reason == "the learner finished" or reason.startswith("wall-clock budget")
    print(
        f"run ended: {reason}" + ("" if ok else f"; logs in {run_dir}"),
        flush=True,
        file=sys.stdout if ok else sys.stderr,
    )
    return 0 if ok else 1
