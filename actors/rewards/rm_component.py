"""The `reward_model` reward component: a group's items scored by the served reward model
(`asyncrl reward-server`) through `RewardModelClient` (rm_client.py).

```
  submit(items) / submit_tokens(ids, decode)    requests of <= chunk items, all in flight
        |                                       at once (the client pipelines them)
        v
  PendingScores.result() -> [ComponentScore(value, failed)]   one per item, in order
                            provenance(): reward_model_dir, reward_model_hash (checkpoint id)
```

Items carry `prompt` and `completion` texts (the pipeline's ScoreItem does), or come as token
ids with the policy tokenizer's `decode`: the reward model tokenizes text with its own
tokenizer. A request that fails after its retries marks its items `failed` with the reason
(value 0.0 alongside, never a silent 0); the pipeline's failure policy decides what follows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from actors.rewards.rm_client import RewardModelClient, RewardModelError, ScoreResult
from asyncrl.config import RewardModelConfig


class ScoredText(Protocol):
    """What the component reads of a pipeline item (the pipeline's ScoreItem has both)."""

    prompt: str
    completion: str


@dataclass(frozen=True)
class _Text:
    prompt: str
    completion: str


@dataclass(frozen=True)
class ComponentScore:
    """One item's reward-model score, or why it has none (never a silent 0)."""

    value: float
    failed: str = ""


class PendingScores:
    """Scores on their way: `result()` waits for the requests not back yet."""

    def __init__(
        self, futures: list[tuple[int, Future]], num_items: int, owner: RewardModelComponent
    ) -> None:
        self.futures, self.num_items, self.owner = futures, num_items, owner

    def result(self) -> list[ComponentScore]:
        out: list[ComponentScore] = []
        for count, future in self.futures:
            try:
                res: ScoreResult = future.result()
            except RewardModelError as exc:
                out += [ComponentScore(0.0, failed=f"reward_model: {exc}")] * count
                continue
            self.owner.checkpoint = {
                "reward_model_dir": res.model_dir,
                "reward_model_hash": res.model_hash,
            }
            out += [ComponentScore(float(s)) for s in res.scores]
        assert len(out) == self.num_items
        return out


class RewardModelComponent:
    """The `reward_model` reward component: the served model's score of each item.

    `submit(items)` starts scoring at once (requests of at most `chunk` items, all in flight
    together) and returns `PendingScores`; `score(items)` is submit(...).result(). A request
    that fails after its retries marks its items `failed` with the reason. `provenance()` names
    the checkpoint that scored (directory and config+weights hash, from the replies).
    """

    name = "reward_model"

    def __init__(self, client: RewardModelClient, chunk: int = 64) -> None:
        assert chunk >= 1
        self.client, self.chunk = client, chunk
        self.checkpoint: dict[str, str] = {}

    @classmethod
    def from_config(cls, cfg: RewardModelConfig, client_id: str) -> RewardModelComponent:
        return cls(RewardModelClient.from_config(cfg, client_id), chunk=cfg.max_batch)

    def submit(self, items: Sequence[ScoredText]) -> PendingScores:
        futures = []
        for lo in range(0, len(items), self.chunk):
            part = items[lo : lo + self.chunk]
            future = self.client.submit([i.prompt for i in part], [i.completion for i in part])
            futures.append((len(part), future))
        return PendingScores(futures, len(items), self)

    def submit_tokens(
        self,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        decode: Callable[[Sequence[int]], str],
    ) -> PendingScores:
        """submit() for token ids of a group: `decode` is the policy tokenizer's (the reward
        model tokenizes the text with its own tokenizer)."""
        items = [
            _Text(decode(p), decode(c)) for p, c in zip(prompt_ids, completion_ids, strict=True)
        ]
        return self.submit(items)

    def score(self, items: Sequence[ScoredText]) -> list[ComponentScore]:
        return self.submit(items).result()

    def provenance(self) -> dict[str, str]:
        return dict(self.checkpoint)

    def close(self) -> None:
        self.client.close()
