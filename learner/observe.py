"""The learner's observability (rank 0): the reward monitor, alarms and their actions (the one
writer of alarms.jsonl), the trajectory store, evaluation results, and optional Weights & Biases
logging.

```
  Learner.train, each step:
    before_step(batch)  ── a sampled step? one group's learner logprobs (π at the step's start)
    optimize(batch)
    reward_metrics(batch, row) ── RewardMonitor.step: reward/<...> into the row (metrics.jsonl)
    after_step(batch, row)
       ├─ AlarmMonitor.observe(row), the reward monitor's alarms (learner/alarms.py)
       │      ──> raise_alarm: warning + alarms.jsonl + AlarmRaised to the hub
       │                                          action: warn | pause (hub) | stop (checkpoint)
       ├─ outliers (reward or length far from recent steps) and an alarm's batch ──> flagged shard
       ├─ the sampled group ──> sample shard (learner/trajectory_store.py)
       └─ W&B (when configured): the row, and evaluations received since the last step
  hub ──EvalResult──> [connection thread] on_eval_result: eval.jsonl + TensorBoard (tb/eval)
```

A kept trajectory's learner logprobs are the learner's per-token log-probabilities (under
logits / actor.temperature, as in training): for the regular sample, under the parameters the
step starts from (π_prox with one minibatch), computed for that one group only; for an
outlier or an alarm's batch, after the step (`learner_version` = the new version says which).
With several learner ranks a forward pass needs every rank, so learner logprobs are left NaN.
"""

from __future__ import annotations

import collections
import json
import queue
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from asyncrl.config import RunConfig
from asyncrl.evaluation import EvalLog, summarize
from asyncrl.metrics import LiveMetrics
from asyncrl.protocol.messages import AlarmRaised, Batch, EvalResult, Group
from asyncrl.transport.connection import HubConnection
from learner.alarms import ALARMS_FILE, Alarm, AlarmMonitor, RewardMonitor, json_safe
from learner.parallel import Ranks
from learner.step import StepRunner, collate, group_advantages
from learner.trajectory_store import Kept, TrajectoryWriter, build_table

OUTLIER_STEPS = 50  # recent steps whose trajectories define "normal" reward and length
FLUSH_EVERY_STEPS = 100  # flagged trajectories reach the disk at least this often


class ObservedLearner(Protocol):
    """What the observer reads of the learner (learner/loop.py's `Learner`)."""

    cfg: RunConfig
    run_dir: Path
    model_dir: Path
    conn: HubConnection | None
    step: int
    policy_version: int
    live: LiveMetrics | None
    stop_event: threading.Event
    ranks: Ranks
    pad_id: int
    runner: StepRunner


class LearnerObserver:
    """Everything the learner watches and keeps beyond the loss."""

    def __init__(self, learner: ObservedLearner) -> None:
        cfg, run_dir = learner.cfg, Path(learner.run_dir)
        self.learner, self.cfg, self.run_dir = learner, cfg, run_dir
        self.rewards = RewardMonitor(cfg.reward, run_dir)
        self.monitor = AlarmMonitor(cfg.alarms) if cfg.alarms.enabled else None
        self.actions = {name: "stop" for name in cfg.alarms.names("stop_on")}
        self.actions.update(
            {n: "pause" for n in cfg.alarms.names("pause_on") if n not in self.actions}
        )
        meta = {
            "tokenizer_dir": str(learner.model_dir),
            "task": cfg.task.name,
            "max_staleness": cfg.replay.max_staleness,
            "group_size": cfg.actor.group_size,
        }
        self.store = TrajectoryWriter(run_dir, cfg.trajectories, meta)
        self.recent: collections.deque[tuple[list[float], list[int]]] = collections.deque(
            maxlen=OUTLIER_STEPS
        )
        self.sample: tuple[list[Group], list[np.ndarray]] | None = None
        self.evals = EvalLog(run_dir)
        self.eval_rows: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self.num_alarms = 0
        self.last_eval: dict[str, Any] = {}
        self.first_version = learner.policy_version  # after a resume: where this process began
        self.wandb = start_wandb(learner.cfg, run_dir)
        if learner.conn is not None:
            learner.conn.on(EvalResult, self.on_eval_result)

    # --- the step hooks -----------------------------------------------------------------------

    def before_step(self, batch: Batch) -> None:
        """On a sampled step, one group's learner logprobs under the step's starting weights."""
        step = self.learner.step + 1
        if not self.store.sample_due(step) or not batch.groups:
            return
        group = batch.groups[(step // self.cfg.trajectories.sample_every_steps) % len(batch.groups)]
        self.sample = ([group], self.learner_logprobs([group]))

    def reward_metrics(self, batch: Batch, row: dict[str, Any]) -> dict[str, float]:
        """The step's reward metrics (reward/<...>), for its row; any reward alarm they raise
        is raised by `after_step`."""
        return self.rewards.step(self.learner.step, batch.groups, row)

    def after_step(self, batch: Batch, row: dict[str, Any]) -> None:
        """Alarms (the stability detectors' and the reward monitor's) and their actions, the
        store's shards, W&B."""
        step = self.learner.step
        alarms = self.monitor.observe({"step": step, **row}) if self.monitor else []
        alarms += self.rewards.take_alarms()
        for alarm in alarms:
            self.raise_alarm(alarm)
        self.keep(batch, alarms)
        if self.learner.live is not None:  # the /metrics endpoint: alarms and the latest eval
            last = {
                f"eval_{k}".replace("@", "_at_"): v
                for k, v in self.last_eval.items()
                if isinstance(v, int | float)
            }
            self.learner.live.publish(
                {**row, "step": step, "alarms_total": self.num_alarms, **last}
            )
        if self.wandb is not None:
            self.log_wandb(step, row)

    # --- alarms -------------------------------------------------------------------------------

    def raise_alarm(self, alarm: Alarm) -> None:
        """Warn with the evidence, record it, tell the hub, and act as configured."""
        action = self.actions.get(alarm.name, "warn")
        record = alarm.record(action)
        self.num_alarms += 1
        evidence = json.dumps(record["evidence"])
        print(
            f"learner: ALARM {alarm.name} at step {alarm.step} (policy version "
            f"{alarm.policy_version}): {alarm.message}; action: {action}; evidence: {evidence}",
            flush=True,
        )
        with (self.run_dir / ALARMS_FILE).open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        conn = self.learner.conn
        if conn is not None:
            conn.send(
                AlarmRaised(
                    name=alarm.name,
                    step=alarm.step,
                    policy_version=alarm.policy_version,
                    message=alarm.message,
                    action=action,
                    evidence=json_safe(alarm.evidence),
                )
            )
        if action == "stop":
            print(
                f"learner: stopping the run on alarm {alarm.name} (alarms.stop_on); "
                "a checkpoint follows",
                flush=True,
            )
            self.learner.stop_event.set()

    # --- the trajectory store -----------------------------------------------------------------

    def keep(self, batch: Batch, alarms: list[Alarm]) -> None:
        trained_at = self.learner.policy_version - 1  # the batch trained at this version
        if self.sample is not None:
            groups, logprobs = self.sample
            kept = [Kept(0, i, "sample") for i in range(groups[0].size)]
            self.write("sample", groups, kept, logprobs, trained_at, trained_at)
            self.sample = None
        flagged = self.outliers(batch)
        if alarms and self.cfg.trajectories.on_alarm:
            reason = "alarm:" + ",".join(a.name for a in alarms)
            flagged = [
                Kept(g, i, reason)
                for g, group in enumerate(batch.groups)
                for i in range(group.size)
            ]
        flagged = flagged[: self.store.room(len(flagged))]  # the rest is counted, not kept
        if flagged:
            groups = list(batch.groups)
            logprobs = self.flagged_logprobs(groups, flagged)
            self.write("flagged", groups, flagged, logprobs, trained_at, trained_at + 1)
        if alarms or self.learner.step % FLUSH_EVERY_STEPS == 0:
            self.store.flush()  # an alarm's batch is on disk at once; the rest now and then

    def flagged_logprobs(self, groups: list[Group], kept: list[Kept]) -> list[np.ndarray]:
        """Learner logprobs of the kept trajectories (one forward over their groups)."""
        chosen = sorted({k.group for k in kept})
        rows = self.learner_logprobs([groups[g] for g in chosen])
        starts = np.cumsum([0] + [groups[g].size for g in chosen])
        where = {g: int(s) for g, s in zip(chosen, starts, strict=False)}
        return [rows[where[k.group] + k.index] for k in kept]

    def write(
        self,
        kind: str,
        groups: list[Group],
        kept: list[Kept],
        logprobs: list[np.ndarray],
        trained_at: int,
        learner_version: int,
    ) -> None:
        advantages = {}
        for g in sorted({k.group for k in kept}):
            rewards = torch.tensor(groups[g].rewards, dtype=torch.float32)[None, :]
            advantages[g] = group_advantages(rewards, self.cfg.loss.adv_std_norm)[0].tolist()
        minimum = [groups[k.group].min_policy_versions[k.index] for k in kept]
        columns = {
            "learner_logprobs": logprobs,
            "train_version": np.full(len(kept), trained_at, np.int64),
            "learner_version": np.full(len(kept), learner_version, np.int64),
            "staleness": np.array([trained_at - m for m in minimum], np.int64),
            "advantage": np.array([advantages[k.group][k.index] for k in kept], np.float64),
            "task": [str(groups[k.group].metadata.get("task", self.cfg.task.name)) for k in kept],
        }
        table = build_table(self.learner.step, groups, kept, columns)
        if kind == "sample":
            self.store.write_sample(self.learner.step, table)
        else:
            self.store.add_flagged(table)

    def outliers(self, batch: Batch) -> list[Kept]:
        """Trajectories whose reward is `outlier_z` standard deviations from the recent steps'
        mean, or whose length is that far above it (judged before this step joins them)."""
        z = self.cfg.trajectories.outlier_z
        rewards = [r for g in batch.groups for r in g.rewards]
        lengths = [
            s - p for g in batch.groups for s, p in zip(g.seq_lens, g.prompt_lens, strict=True)
        ]
        found: list[Kept] = []
        if z > 0 and len(self.recent) >= 5:
            reward_mean, reward_std = _mean_std([r for rs, _ in self.recent for r in rs])
            length_mean, length_std = _mean_std([n for _, ls in self.recent for n in ls])
            reward_bound, length_bound = z * max(reward_std, 1e-3), z * max(length_std, 1.0)
            flat = [(g, i) for g, group in enumerate(batch.groups) for i in range(group.size)]
            for (g, i), r, n in zip(flat, rewards, lengths, strict=True):
                if abs(r - reward_mean) > reward_bound:
                    found.append(Kept(g, i, "outlier:reward"))
                elif n - length_mean > length_bound:  # long only: learning to stop early is
                    found.append(Kept(g, i, "outlier:length"))  # the common case
        self.recent.append((rewards, lengths))
        return found

    def learner_logprobs(self, groups: list[Group]) -> list[np.ndarray]:
        """Per-trajectory learner logprobs of these groups' completions (NaN with several ranks)."""
        lengths = [s - p for g in groups for s, p in zip(g.seq_lens, g.prompt_lens, strict=True)]
        if self.learner.ranks.distributed:
            return [np.full(n, np.nan, np.float32) for n in lengths]
        with torch.no_grad():
            data = collate(groups, self.learner.pad_id)
            logprobs = self.learner.runner.score(data)[0].float().cpu().numpy()
        return [logprobs[i, :n] for i, n in enumerate(lengths)]

    # --- evaluations, W&B -----------------------------------------------------------------

    def on_eval_result(self, msg: EvalResult) -> None:
        """On the connection's thread: log an evaluation the hub forwarded."""
        row = self.last_eval = self.evals.write(summarize(msg))
        print(
            f"learner: eval at policy version {row['policy_version']}: reward "
            f"{row['reward_mean']:.3f}, pass@1 {row['pass@1']:.3f}, length "
            f"{row['length_mean']:.1f} ({row['num_prompts']} prompts x {row['num_samples']})",
            flush=True,
        )
        if self.wandb is not None:
            self.eval_rows.put(row)

    def wait_final_eval(self, policy_version: int, timeout_s: float) -> bool:
        """Wait (up to timeout_s) for the evaluation of the last version due at or before
        `policy_version`: the hub asks for it once the run's final version is reached, so the
        curve's last point is logged before the connection closes. True once it is in."""
        cfg = self.learner.cfg.eval
        final = policy_version - policy_version % cfg.every_versions if cfg.every_versions else -1
        crossed = self.first_version < final or final == self.first_version == 0 and cfg.at_start
        if not crossed:  # none due, or due before this process began (another one asked)
            return True
        deadline = time.monotonic() + timeout_s
        while self.last_eval.get("requested_version", -1) < final:  # set on the connection thread
            if time.monotonic() >= deadline or self.learner.stop_event.is_set():
                print(
                    f"learner: no evaluation of version {final} within {timeout_s:.0f} s; "
                    "closing without it",
                    flush=True,
                )
                return False
            time.sleep(0.1)
        return True

    def log_wandb(self, step: int, row: dict[str, Any]) -> None:
        numbers = {k: v for k, v in row.items() if isinstance(v, int | float)}
        numbers["alarms"] = self.num_alarms
        while not self.eval_rows.empty():
            ev = self.eval_rows.get()
            numbers.update({f"eval/{k}": v for k, v in ev.items() if isinstance(v, int | float)})
        self.wandb.log(numbers, step=step)

    def close(self) -> None:
        self.store.flush()
        self.evals.close()
        if self.wandb is not None:
            self.wandb.finish()


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and (population) standard deviation, computed once per step."""
    array = np.asarray(values, dtype=np.float64)
    return float(array.mean()), float(array.std())


def start_wandb(cfg: Any, run_dir: Path) -> Any | None:
    """A W&B run when metrics.wandb_project is set, else None (wandb is not even imported).
    Configured without the wandb package installed: `ValueError` saying how to get it."""
    if not cfg.metrics.wandb_project:
        return None
    try:
        import wandb
    except ImportError as exc:
        raise ValueError(
            f"metrics.wandb_project: set to {cfg.metrics.wandb_project!r} but the wandb package "
            "is not installed (pip install 'asyncrl[wandb]', or leave metrics.wandb_project empty)"
        ) from exc
    return wandb.init(
        project=cfg.metrics.wandb_project,
        mode=cfg.metrics.wandb_mode,
        dir=str(run_dir),
        name=run_dir.name,
        config=cfg.to_dict(),
    )
