"""The reward seam: what a verifier returns, and the guard that keeps a bad verifier harmless.

A verifier scores one completion of one prompt with a reward, any finite float (the built-in
ones answer in [0, 1]). Verifiers are user code and may fail; `safe_score` is what calls them:
it never raises, and it turns an exception, a non-number or a non-finite reward into reward
0.0 with `failed` naming the reason (so the failure is visible in metrics instead of silently
skewing the advantages). A verifier is the `task` component of a composed reward
(actors/rewards/pipeline.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class RewardResult:
    """The score of one completion."""

    reward: float
    """Scalar reward: any finite float."""
    details: dict[str, Any] = field(default_factory=dict)
    """JSON-able breakdown of the reward (components, parsed answer)."""
    failed: str = ""
    """Empty when scoring worked; otherwise why the reward was forced to 0."""


class Verifier(Protocol):
    """Scores a completion against the prompt and its environment info."""

    def score(self, prompt: str, completion: str, info: dict[str, Any]) -> RewardResult:
        """Reward of `completion` for `prompt`; `info` is the dataset row's `info`."""
        ...


def safe_score(
    verifier: Verifier, prompt: str, completion: str, info: dict[str, Any]
) -> RewardResult:
    """`verifier.score(...)`, with every failure mapped to reward 0.0 and a reason; never raises."""
    try:
        result = verifier.score(prompt, completion, info)
    except Exception as exc:  # a verifier's bug must not kill the actor
        return RewardResult(0.0, {}, failed=f"verifier raised {type(exc).__name__}: {exc}")
    if not isinstance(result, RewardResult):
        return RewardResult(0.0, {}, failed=f"verifier returned {type(result).__name__}")
    reward = result.reward
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        return RewardResult(0.0, result.details, failed=f"reward is not a number: {reward!r}")
    if not math.isfinite(reward):
        return RewardResult(0.0, result.details, failed=f"reward is not finite: {reward!r}")
    return RewardResult(float(reward), result.details, result.failed)
