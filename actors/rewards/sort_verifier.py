"""The programmatic verifier of the `sort` task, with partial credit.

Let `answer` be the sorted digits (length n) and `pred` the parsed completion (text before the
end-of-sequence token, spaces stripped), and `L = max(len(pred), n)`:

- `position` = (number of i with pred[i] == answer[i]) / L: right characters in right places;
- `multiset` = (size of the multiset intersection of pred and answer) / L: the right digits,
  in any order (a completion that copies the prompt unsorted scores 1 here);
- reward = `position_weight` * position + (1 - `position_weight`) * multiset.

Dividing by L makes extra characters cost as much as missing ones, so padding never pays, and
the reward is 1 exactly when `pred == answer`. The multiset term gives a smooth start: a model
that merely learns to emit the prompt's digits and stop earns about half the reward, then
ordering earns the rest, so a randomly initialised model's reward rises visibly within
seconds of RL. The prompt itself is not read: the answer comes from `info["answer"]` (or is
recomputed from `info["digits"]`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from actors.envs.sort_task import answer_for, parse_completion
from actors.rewards.base import RewardResult, Verifier
from asyncrl.config import TaskConfig


@dataclass(frozen=True)
class SortVerifier:
    """Partial-credit reward for the sort task (see the module docstring for the rule)."""

    position_weight: float = 0.5
    """Share of the reward from right-character-in-right-place; the rest is the multiset term."""

    def score(self, prompt: str, completion: str, info: dict[str, Any]) -> RewardResult:
        """Reward in [0, 1] of `completion`; `info` carries `answer` or `digits`."""
        answer = _expected(info)
        pred = parse_completion(completion)
        length = max(len(pred), len(answer), 1)
        position = sum(p == a for p, a in zip(pred, answer, strict=False)) / length
        multiset = sum((Counter(pred) & Counter(answer)).values()) / length
        reward = self.position_weight * position + (1.0 - self.position_weight) * multiset
        details = {"pred": pred, "answer": answer, "position": position, "multiset": multiset}
        return RewardResult(reward, details)


def _expected(info: dict[str, Any]) -> str:
    if isinstance(info.get("answer"), str):
        return info["answer"]
    if isinstance(info.get("digits"), str):
        return answer_for(info["digits"])
    raise ValueError("info: needs a string 'answer' or 'digits' for the sort verifier")


def make_verifier(task: TaskConfig) -> Verifier:
    """The verifier of `task.name`."""
    if task.name == "sort":
        return SortVerifier()
    raise ValueError(f"task.name: no verifier for {task.name!r}")
