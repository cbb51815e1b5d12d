"""Per-step reward metrics and the run-level reward alarms, from the groups of each batch.

```
  batch.groups --> reward/<component>   mean over the step's trajectories (metrics.jsonl, TB)
                   reward/failed        trajectories whose reward failed (with a reason)
                   reward/flag/<name>   defences that fired (hedged, gate:format, ...)
                   reward/canary_alarms known-wrong canaries that earned reward (actors)
       |
       v  history of the last 2 x reward.alarm_window_steps steps
  alarms (`Alarm` records named reward:<kind>, with evidence; the learner's observer raises
  them like its stability alarms: a log line, run_dir/alarms.jsonl, the hub's status, and the
  action alarms.stop_on / pause_on give the name):
    reward:reward_jump_collapse  the reward mean rose by > alarm_reward_jump between the two
                                 windows while response length or entropy fell by
                                 > alarm_collapse_ratio
    reward:saturated:<name>      a component with one value and no spread for
                                 alarm_saturate_steps
    reward:canary                an actor's canary alarm, repeated here with its evidence
  provenance: each new reward provenance seen (rule hash, reward-model checkpoint, rubric hash)
  is appended to run_dir/reward_provenance.jsonl with the step it first appeared at
```

A sudden reward gain that comes with shorter or less varied answers is the usual signature of
a policy that found a hole in the reward; a component stuck at one value no longer tells the
samples of a group apart (it only shifts the reward), so it carries no signal.
"""

from __future__ import annotations

import json
import math
from collections import Counter, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.config import RewardConfig
from asyncrl.protocol.messages import Group
from learner.alarms import Alarm


class RewardMonitor:
    """Turns each step's groups into reward metrics and raises the run-level alarms."""

    def __init__(self, cfg: RewardConfig, run_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.history: deque[dict[str, float]] = deque(maxlen=2 * cfg.alarm_window_steps)
        self.flat: dict[str, int] = Counter()
        self.version = 0  # the policy version of the step being checked
        self.alarms: list[Alarm] = []
        """Every alarm raised so far."""
        self.fresh: list[Alarm] = []
        """Alarms not yet taken by the caller (`take_alarms`)."""
        self.raised: set[str] = set()
        self.provenances: set[str] = set()

    def step(self, step: int, groups: Sequence[Group], row: dict[str, Any]) -> dict[str, float]:
        """The reward metrics of this step (merged into its metrics row by the caller)."""
        self.version = int(row.get("policy_version", step))
        out = component_means(groups)
        flags: Counter[str] = Counter()
        failed = canaries = 0
        for g in groups:
            failed += sum(1 for f in g.reward_failed if f)
            meta = g.metadata.get("reward", {}) if isinstance(g.metadata, dict) else {}
            flags.update(meta.get("flags", {}))
            self.note_provenance(step, meta.get("provenance"))
            for alarm in (meta.get("canary") or {}).get("alarms", []):
                canaries += 1
                self.alarm(step, "canary", {"actor": g.actor_id, **alarm})
        out["reward/failed"] = float(failed)
        out["reward/canary_alarms"] = float(canaries)
        out.update({f"reward/flag/{k}": float(v) for k, v in flags.items()})
        self.check_saturation(step, groups)
        self.history.append(
            {
                "reward": float(row.get("reward_mean", 0.0)),
                "length": float(row.get("response_len_mean", 0.0)),
                "entropy": float(row.get("entropy", math.nan)),
            }
        )
        self.check_jump(step)
        out["reward/alarms"] = float(len(self.alarms))
        return out

    def check_jump(self, step: int) -> None:
        """Reward jump with a length or entropy collapse between the two windows."""
        k = self.cfg.alarm_window_steps
        if len(self.history) < 2 * k:
            return
        rows = list(self.history)
        before, after = _means(rows[:k]), _means(rows[k:])
        jump = after["reward"] - before["reward"]
        if jump <= self.cfg.alarm_reward_jump:
            return
        keep = 1.0 - self.cfg.alarm_collapse_ratio
        collapsed = [
            m for m in ("length", "entropy") if before[m] > 0 and after[m] < keep * before[m]
        ]
        if collapsed:
            self.alarm(
                step,
                "reward_jump_collapse",
                {
                    "reward_before": before["reward"],
                    "reward_after": after["reward"],
                    **{f"{m}_before": before[m] for m in collapsed},
                    **{f"{m}_after": after[m] for m in collapsed},
                    "window_steps": k,
                },
            )
            self.history.clear()  # one alarm per episode of collapse

    def check_saturation(self, step: int, groups: Sequence[Group]) -> None:
        """A component with one value across every trajectory for many steps in a row."""
        need = self.cfg.alarm_saturate_steps
        if not need:
            return
        values: dict[str, list[float]] = {}
        for g in groups:
            for name, vs in g.reward_components.items():
                values.setdefault(name, []).extend(vs)
        for name, vs in values.items():
            flat = len(vs) > 1 and max(vs) == min(vs)
            self.flat[name] = self.flat[name] + 1 if flat else 0
            if self.flat[name] >= need and name not in self.raised:
                self.raised.add(name)
                self.alarm(step, f"saturated:{name}", {"value": vs[0], "steps": self.flat[name]})

    def note_provenance(self, step: int, provenance: Any) -> None:
        """Record a provenance not seen before (a new checkpoint, rubric or rule)."""
        if not provenance:
            return
        key = json.dumps(provenance, sort_keys=True)
        if key in self.provenances:
            return
        self.provenances.add(key)
        if self.run_dir is not None:
            with (self.run_dir / "reward_provenance.jsonl").open("a") as f:
                f.write(json.dumps({"step": step, "provenance": provenance}) + "\n")

    def alarm(self, step: int, kind: str, evidence: dict[str, Any]) -> None:
        message = f"reward alarm {kind}: " + json.dumps(evidence, default=str)[:300]
        alarm = Alarm(
            name=f"reward:{kind}",
            step=step,
            policy_version=self.version,
            message=message,
            evidence=evidence,
        )
        self.alarms.append(alarm)
        self.fresh.append(alarm)

    def take_alarms(self) -> list[Alarm]:
        """The alarms raised since the last call (for the learner's observer to raise)."""
        fresh, self.fresh = self.fresh, []
        return fresh


def component_means(groups: Sequence[Group]) -> dict[str, float]:
    """reward/<component>: the mean over the trajectories that carry the component."""
    sums: dict[str, float] = {}
    counts: Counter[str] = Counter()
    for g in groups:
        for name, values in g.reward_components.items():
            sums[name] = sums.get(name, 0.0) + math.fsum(values)
            counts[name] += len(values)
    return {f"reward/{name}": sums[name] / counts[name] for name in sums if counts[name]}


def _means(rows: list[dict[str, float]]) -> dict[str, float]:
    out = {}
    for key in rows[0]:
        finite = [r[key] for r in rows if math.isfinite(r[key])]
        out[key] = sum(finite) / len(finite) if finite else math.nan
    return out
