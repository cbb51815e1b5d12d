"""The composition rule: named component values -> one scalar reward.

```
  values {task: 1.0, format: 1.0, overlong: -0.25, judge: 0.7}
     |  gates ("format", "judge>=0.5"): any gate failing -> reward = gate_reward, stop
     v
  weighted sum  sum_i weights[i] * values[i]     (components at weight 0 are only logged)
     |  clip to [clip_min, clip_max]             (when clip_max > clip_min)
     v
  reward (any finite float)
```

The rule comes from `[reward]` in the run config (`RewardConfig`, asyncrl/config.py);
its hash goes into every trajectory's provenance, so a reward can be traced to the rule that
made it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

from asyncrl.config import RewardConfig

TASK = "task"
"""The environment's own verifier: always computed and logged, weighted or not."""


@dataclass(frozen=True)
class ComposeRule:
    """Weighted sum with gates and clipping."""

    weights: dict[str, float]
    """Component -> weight (weight 0: computed and logged only)."""
    gates: tuple[tuple[str, str, float], ...] = ()
    """(component, ">" or ">=", threshold): all must pass, else the reward is `gate_reward`."""
    gate_reward: float = 0.0
    clip: tuple[float, float] | None = None

    @classmethod
    def from_config(cls, reward: RewardConfig) -> ComposeRule:
        clip = (reward.clip_min, reward.clip_max) if reward.clip_max > reward.clip_min else None
        return cls(
            weights={name: float(w) for name, w in reward.weights.items()},
            gates=tuple(reward.gate_list),
            gate_reward=reward.gate_reward,
            clip=clip,
        )

    @property
    def names(self) -> list[str]:
        """Every component the rule reads, `task` first, each once."""
        names = [TASK, *self.weights, *(g[0] for g in self.gates)]
        return list(dict.fromkeys(names))

    def failed_gates(self, values: dict[str, float]) -> list[str]:
        """The gates `values` do not pass (names as written in the config)."""
        failed = []
        for name, op, threshold in self.gates:
            value = values.get(name, 0.0)
            ok = value >= threshold if op == ">=" else value > threshold
            if not ok:
                failed.append(name if (op, threshold) == (">", 0.0) else f"{name}{op}{threshold}")
        return failed

    def apply(self, values: dict[str, float]) -> float:
        """The reward of one trajectory from its component values."""
        if self.failed_gates(values):
            return self.gate_reward
        reward = math.fsum(w * values.get(name, 0.0) for name, w in self.weights.items() if w)
        if self.clip is not None:
            reward = min(max(reward, self.clip[0]), self.clip[1])
        return reward

    def digest(self) -> str:
        """Short hash of the rule (provenance)."""
        blob = json.dumps(
            [self.weights, self.gates, self.gate_reward, self.clip], sort_keys=True
        ).encode()
        return hashlib.sha256(blob).hexdigest()[:12]
