"""One episode and its group, as actors/episodes.py runs them: the token context built turn by
turn (the engine's own ids with loss_mask 1 and their logprobs, observations with loss_mask 0),
the policy version of every turn, how it ended, and the trajectory it becomes; `EpisodeLimits`
holds the task's bounds on turns and tokens."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.envs.base import Env, Row, Step
from asyncrl.config import RunConfig

COUNTS = ("tool_calls", "tool_errors", "malformed_calls")
"""Per-episode tool counters (summed into the runner's stats)."""


@dataclass(frozen=True, kw_only=True)
class EpisodeLimits:
    """Sampling and the limits of one episode (from `actor` and `task` config)."""

    max_turns: int = 8
    max_new_tokens: int = 8
    max_episode_tokens: int = 0
    timeout_s: float = 0.0
    temperature: float = 1.0
    top_p: float = 1.0

    @classmethod
    def from_config(cls, cfg: RunConfig) -> EpisodeLimits:
        return cls(
            max_turns=cfg.task.max_turns,
            max_new_tokens=cfg.actor.max_new_tokens,
            max_episode_tokens=cfg.task.max_episode_tokens,
            timeout_s=cfg.task.episode_timeout_s,
            temperature=cfg.actor.temperature,
            top_p=cfg.actor.top_p,
        )


@dataclass(eq=False, kw_only=True)
class Episode:
    """One conversation between the model and its environment, and its token record."""

    group: EpisodeGroup
    index: int
    env: Env
    prompt: list[int]
    deadline: float
    chunks: list[tuple[np.ndarray, np.ndarray | None]] = field(default_factory=list)
    """(token ids, behaviour logprobs) per stretch: logprobs for model turns, None for env text."""
    versions: list[np.ndarray | None] = field(default_factory=list)
    """Per chunk: the policy version of each model token (None for environment text)."""
    num_tokens: int = 0
    model_texts: list[str] = field(default_factory=list)
    num_turns: int = 0
    min_version: int = -1
    max_version: int = -1
    truncated: bool = False
    last_step: Step | None = None
    finish_reason: str = ""
    reward_failed: str = ""
    env_s: float = 0.0
    tool_s: float = 0.0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    pending: Future[tuple[Step | Exception, float]] | None = None

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    @property
    def cache_key(self) -> str:
        """Where the engine keeps this episode's KV cache between turns."""
        return f"ep{id(self)}"

    @property
    def awaiting_model(self) -> bool:
        return not self.finish_reason and self.pending is None

    @property
    def reward(self) -> float:
        """The task reward: the last step's (0 before any, or when the environment failed)."""
        return 0.0 if self.last_step is None or self.reward_failed else self.last_step.reward

    def context(self) -> list[int]:
        return self.prompt + [int(t) for tokens, _ in self.chunks for t in tokens]

    def version_spans(self) -> tuple[int, ...]:
        """Flat (first completion token, version) pairs where the producing version changes
        (environment tokens carry the version before them); () when one version made it all."""
        spans: list[int] = []
        at, current = 0, -1
        for (tokens, _), versions in zip(self.chunks, self.versions, strict=True):
            if versions is None:
                at += len(tokens)
                continue
            for offset in np.flatnonzero(np.diff(versions, prepend=current)):
                current = int(versions[offset])
                spans += [at + int(offset), current]
            at += len(tokens)
        return tuple(spans) if len(spans) > 2 else ()

    def trajectory(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens [L], loss_mask [L - prompt_len], behaviour logprobs [L - prompt_len])."""
        prompt = np.asarray(self.prompt, dtype=np.int32)
        if len(self.chunks) == 1 and self.chunks[0][1] is not None:  # one model turn
            tokens, logprobs = self.chunks[0]
            mask = np.ones(len(tokens), dtype=np.uint8)
            return np.concatenate([prompt, tokens]), mask, logprobs
        tokens = [prompt] + [c for c, _ in self.chunks]
        masks = [np.full(len(c), lp is not None, dtype=np.uint8) for c, lp in self.chunks]
        lps = [np.zeros(len(c), np.float32) if lp is None else lp for c, lp in self.chunks]
        if not self.chunks:
            return prompt, np.zeros(0, np.uint8), np.zeros(0, np.float32)
        return np.concatenate(tokens), np.concatenate(masks), np.concatenate(lps)


@dataclass(eq=False, kw_only=True)
class EpisodeGroup:
    """The episodes of one credit (one prompt, `group_size` samples)."""

    tag: Any
    row: Row
    seed: int
    episodes: list[Episode] = field(default_factory=list)
    generate_s: float = 0.0

    @property
    def done(self) -> bool:
        return all(e.done for e in self.episodes)
