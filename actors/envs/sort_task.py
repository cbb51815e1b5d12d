"""The `sort` task: write the prompt's digits in ascending order.

A prompt is `num_digits` random decimal digits followed by a colon, e.g. ``"3141:"``; the
expected completion is the same digits sorted ascending, ``"1134"``, then the end-of-sequence
token. Every character is a single token of the tiny model's tokenizer
(`asyncrl.models.tiny.ALPHABET`), so a completion needs `num_digits + 1` tokens.

The dataset is a pure function of `TaskConfig` (`seed`, `num_digits`, `num_prompts`): the same
config always yields the same prompts with the same ids. Rows have the shape of the hub's prompt
records (asyncrl/prompt_records.py),
``{"prompt_id": str, "prompt": str, "info": {"digits": str, "answer": str}}``.

As an environment (`SortEnv`, registered as `sort`) it is one turn: the prompt is shown as raw
text and the model's answer is scored by the sort verifier (`SortVerifier`, below),
on the actor's main thread (`inline_steps`: a verifier is quicker than a hand-off to a thread).

The verifier: the programmatic verifier of the `sort` task, with partial credit.

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

import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.envs.base import Observation, Row, Step
from actors.rewards.pipeline import RewardResult, Verifier, safe_score
from asyncrl.config import TaskConfig
from asyncrl.prompt_records import Prompt, write_records

PROMPT_SUFFIX = ":"
"""Ends every prompt; the answer starts right after it."""
END_MARKERS = ("<eos>", "</s>", "<|endoftext|>")
"""End-of-sequence spellings that cut a decoded completion (the answer is what precedes them)."""


def render_prompt(digits: str) -> str:
    """Prompt text for these digits, e.g. ``"3141"`` -> ``"3141:"``."""
    if not digits.isdigit():
        raise ValueError(f"digits: must be decimal digits, got {digits!r}")
    return digits + PROMPT_SUFFIX


def answer_for(digits: str) -> str:
    """The correct answer: the digits sorted ascending."""
    return "".join(sorted(digits))


def parse_completion(completion: str) -> str:
    """The answer a completion gives: its text before the first end marker, spaces stripped.

    Nothing else is removed: a stray symbol or letter stays and costs the positions it takes.
    """
    for marker in END_MARKERS:
        completion = completion.split(marker, 1)[0]
    return completion.strip()


def make_prompts(task: TaskConfig) -> list[dict]:
    """The task's prompt dataset, deterministic in `task.seed`."""
    if task.name != "sort":
        raise ValueError(f"task.name: the sort generator cannot make {task.name!r}")
    rng = random.Random(task.seed)
    rows = []
    for index in range(task.num_prompts):
        digits = "".join(str(rng.randrange(10)) for _ in range(task.num_digits))
        rows.append(
            {
                "prompt_id": f"sort-{task.num_digits}-{task.seed}-{index:06d}",
                "prompt": render_prompt(digits),
                "info": {"digits": digits, "answer": answer_for(digits)},
            }
        )
    return rows


def write_dataset(path: str | Path, task: TaskConfig) -> Path:
    """Write `make_prompts(task)` as the hub's prompts file at `path` (atomically) and return
    the path."""
    return write_records(path, [Prompt(**row) for row in make_prompts(task)])


class SortEnv:
    """One turn: show the prompt, score the answer (a failing verifier scores 0 and says why)."""

    inline_steps = True

    def __init__(self, verifier: Verifier) -> None:
        self.verifier = verifier
        self.row: Row | None = None

    def reset(self, row: Row, seed: int) -> Observation:
        """The prompt text as is (`seed` is not needed: the episode is deterministic)."""
        if row.prompt is None:
            raise ValueError(f"prompt {row.prompt_id}: the sort task needs a text prompt")
        self.row = row
        return Observation(text=row.prompt)

    def step(self, model_text: str) -> Step:
        """Score the answer; the episode ends."""
        assert self.row is not None, "step before reset"
        result = safe_score(self.verifier, self.row.prompt or "", model_text, self.row.info)
        info = {"reward_failed": result.failed, **result.details}
        return Step(reward=result.reward, done=True, finish_reason="stop", info=info)


def make_env(task: TaskConfig) -> SortEnv:
    """The registry's factory of `sort` episodes."""
    return SortEnv(SortVerifier())


def make_rows(task: TaskConfig) -> list[Row]:
    """`make_prompts(task)` as rows."""
    return [
        Row(prompt_id=r["prompt_id"], prompt=r["prompt"], info=r["info"])
        for r in make_prompts(task)
    ]


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
