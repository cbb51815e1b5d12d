"""Chaos: `asyncrl run` (durable hub) while a seeded schedule SIGKILLs hub, actors and learner.

```
  asyncrl run (supervises) ──> hub (replay.durability = durable), actor-i, learner
        ^                            ^ SIGKILL at seeded random times, role drawn at random
        └── restarts each crashed one (run.max_restarts, backoff)
  after the run: the hub's state is recovered offline from <run_dir>/replay (counters, what is
  still stored or lent), the learner's trained_groups.jsonl gives what it trained, step by step
```

Delivery figures (group = (actor_id, seq)):
- `produced`: distinct groups the actors' pushes brought to the hub (resends counted once; a
  group still being generated when its actor was killed never existed for anyone);
- `acked`: of those, the groups the hub acknowledged (stored, or stale on arrival: dropped,
  prompt re-issued); a push refused for capacity is pushed again until it is acknowledged, so
  the two are equal when nothing is lost on the way in;
- `consumed`: distinct groups the learner trained on (any learner process);
- `lost` (must be 0): acknowledged groups that went nowhere = stored - (acknowledged as trained
  by the learner + dropped stale after storing + still stored or lent), plus groups the hub was
  told were trained that no learner process trained;
- `redelivered`: groups a learner trained whose `BatchAck` never reached the hub (it was killed
  first): given back, then trained again or dropped as stale, as at-least-once delivery does;
- `duplicated`: groups trained in two steps of the surviving learner lineage (must be 0). A
  learner killed after its last checkpoint loses its later steps (resume): their batches were
  acknowledged when trained, so they are not trained again; counted as `lost_with_learner_steps`.
Also the kills per role, restarts, and the reward curve (mean reward per step against time).

    python bench/chaos.py [--duration-s 360] [--interval-s 20] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import REPO, RESULTS, command_line, environment, write_json
from learner.metrics_log import read_metrics

ROLES = ("hub", "actor", "learner")


def start_run(args: argparse.Namespace, run_dir: Path, out: Path) -> subprocess.Popen[str]:
    """`asyncrl run` with its output in `out` (a pipe nobody reads until the end would fill up
    and block the run's supervision loop on its progress lines)."""
    overrides = {
        "replay.durability": '"durable"',
        "run.max_wall_s": str(args.duration_s),
        "run.max_restarts": "1000",
        "run.restart_backoff_s": "0.5",
        "run.num_actors": str(args.actors),
        "learner.max_steps": "100000",
        "learner.checkpoint_every": "5",
        "weights.timeout_s": "10.0",
        "replay.heartbeat_timeout_s": "5.0",
        "model.cache_dir": json.dumps(args.model_cache),
    }
    cmd = [sys.executable, "-m", "asyncrl", "run", args.config, "--run-dir", str(run_dir)]
    for key, value in overrides.items():
        cmd += ["--set", f"{key}={value}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with out.open("w") as f:
        return subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, text=True
        )


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def kill_schedule(args: argparse.Namespace, run: subprocess.Popen[str], run_dir: Path) -> Counter:
    """SIGKILL a random role at seeded random times until `duration_s - quiet_s`, each kill
    after the run has made `min_steps` learner steps since the previous one (so every kill
    tests a recovery, not a process still starting); returns the kills per role (only
    processes seen alive are killed, each pid once)."""
    rng = random.Random(args.seed)
    kills: Counter[str] = Counter()
    killed: set[int] = set()
    while steps_done(run_dir) < 1:  # the clock starts with training
        if run.poll() is not None:
            return kills
        time.sleep(0.2)
    end = time.monotonic() + args.duration_s - args.quiet_s
    next_kill = time.monotonic() + rng.uniform(0.5, 1.5) * args.interval_s
    last_step = 0
    while time.monotonic() < end and run.poll() is None:
        time.sleep(0.2)
        if time.monotonic() < next_kill or steps_done(run_dir) < last_step + args.min_steps:
            continue
        role = rng.choice(ROLES)
        pids = json.loads((run_dir / "pids.json").read_text())
        names = [n for n in pids if n == role or n.startswith(f"{role}-")]
        name = rng.choice(names)
        pid = pids[name]
        if pid in killed or not alive(pid):
            continue  # still restarting: try again at the next tick
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)
        kills[role] += 1
        last_step = steps_done(run_dir)
        print(f"chaos: killed {name} (pid {pid}) after {last_step} steps", flush=True)
        next_kill = time.monotonic() + rng.uniform(0.5, 1.5) * args.interval_s
    return kills


def alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def hub_state(run_dir: Path) -> Any:
    """The hub's state as a restarted hub would recover it from <run_dir>/replay."""
    from asyncrl.config import load_config
    from replay.core import HubState
    from replay.durability import WriteAheadLog
    from replay.prompts import PromptSource, load_dataset

    cfg = load_config(str(run_dir / "config.toml"), [])
    state = HubState(cfg, PromptSource(load_dataset(run_dir / "prompts.jsonl")), incarnation=1)
    wal = WriteAheadLog(cfg.replay.state_dir, fsync=False, snapshot_log_bytes=1 << 40)
    wal.recover(state)
    wal.close()
    return state


def lineage(run_dir: Path) -> tuple[dict[int, list[str]], set[str]]:
    """(the surviving learner's groups by step, every group any learner process trained)."""
    steps: dict[int, list[str]] = {}
    every: set[str] = set()
    path = run_dir / "trained_groups.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # torn by a kill
        ids = [f"{a}/{s}" for a, s in row["groups"]]
        every.update(ids)
        for later in [s for s in steps if s >= row["step"]]:  # a resume: these steps were lost
            del steps[later]
        steps[row["step"]] = ids
    return steps, every


def audit(run_dir: Path) -> dict[str, Any]:
    """Delivery figures (see the module docstring) from the hub's state and the learner's log."""
    state = hub_state(run_dir)
    c = state.counters
    steps, every = lineage(run_dir)
    survived = Counter(g for ids in steps.values() for g in ids)
    remaining = len(state.buffer) + sum(map(len, state.lent.values()))
    dropped_after = c["groups_dropped_stale"] - c["groups_stale_on_arrival"]
    return {
        "produced": c["groups_stored"] + c["groups_stale_on_arrival"],
        "acked": c["groups_stored"] + c["groups_stale_on_arrival"],
        "consumed": len(every),
        "lost": c["groups_stored"]
        - c["groups_trained"]
        - dropped_after
        - remaining
        + max(0, c["groups_trained"] - len(every)),
        "redelivered": max(0, len(every) - c["groups_trained"]),
        "acknowledged_trained": c["groups_trained"],
        "duplicated": sum(1 for n in survived.values() if n > 1),
        "lost_with_learner_steps": len(every - set(survived)),
        "resends_deduplicated": c["groups_duplicate"],
        "stale_on_arrival": c["groups_stale_on_arrival"],
        "dropped_stale_after_store": dropped_after,
        "still_stored_or_lent": remaining,
        "groups_returned_to_replay": c["groups_returned"],
        "surviving_steps": len(steps),
    }


def reward_curve(run_dir: Path, points: int = 60) -> list[list[float]]:
    rows = read_metrics(run_dir / "metrics.jsonl")  # a line torn by a learner's SIGKILL is skipped
    every = max(1, len(rows) // points)
    return [[round(r["time_s"], 1), r["step"], round(r["reward_mean"], 4)] for r in rows[::every]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "tiny_cpu.toml"))
    p.add_argument("--duration-s", type=float, default=360.0)
    p.add_argument("--interval-s", type=float, default=20.0, help="mean time between kills")
    p.add_argument("--min-steps", type=int, default=3, help="learner steps between kills")
    p.add_argument("--quiet-s", type=float, default=20.0, help="no kills in the last seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--actors", type=int, default=1)
    p.add_argument("--run-dir", default="")
    p.add_argument("--model-cache", default=str(Path(tempfile.gettempdir()) / "asyncrl-models"))
    p.add_argument("--out", default=str(RESULTS / "chaos.json"))
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="asyncrl-chaos-")) / "run"
    env = environment()  # the commit measured, before anything else moves
    run_dir.mkdir(parents=True, exist_ok=True)
    out_path = run_dir.parent / "run.out"
    run = start_run(args, run_dir, out_path)
    try:
        kills = kill_schedule(args, run, run_dir)
        run.wait(timeout=args.duration_s + 600)
        out = out_path.read_text()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    summary = json.loads((run_dir / "summary.json").read_text())
    result = {
        "benchmark": "chaos",
        "command": command_line(__file__, argv),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        **env,
        "run_exit_code": run.returncode,
        "run_ended": out.strip().splitlines()[-1] if out.strip() else "",
        "kills": dict(kills),
        "kills_total": sum(kills.values()),
        "restarts": summary.get("restarts", {}),
        **audit(run_dir),
        "reward_first_tenth": summary.get("reward_first_tenth"),
        "reward_last_tenth": summary.get("reward_last_tenth"),
        "reward_curve": {
            "columns": ["time_s", "step", "reward_mean"],
            "rows": reward_curve(run_dir),
        },
    }
    write_json(args.out, result)
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "kills",
                    "restarts",
                    "produced",
                    "acked",
                    "consumed",
                    "lost",
                    "duplicated",
                    "run_ended",
                )
            }
        )
    )
    return 0 if result["lost"] == 0 and result["duplicated"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
