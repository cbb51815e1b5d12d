"""The reward pipeline: finished episodes in, composed and explained rewards out.

```
  actor, once per round:  pipeline.score(items, policy_version=v)  -> [RewardOutcome]
     |
     |  1. submit(items) to EVERY component (task, format, overlong, repetition, judge,
     |     reward_model, yours): each returns a Future at once, so remote and local scorers
     |     run side by side (the reward-model client sends its batch and returns)
     |  2. wait on each future until reward.component_timeout_s after submission; a timeout,
     |     an exception, a wrong count or a non-finite value fails the item with its reason
     |  3. on_failure = retry: resubmit only the failed items (max_retries rounds)
     |  4. compose each item (actors/rewards/compose.py: gates, weighted sum, clip), count
     |     task-vs-judge disagreements, collect guard flags and provenance
     |  5. every reward.canary_every versions: score the canary set through steps 1-4
     v     (actors/rewards/canaries.py); a known-wrong response that earns reward -> alarm
  [RewardOutcome(reward, components, failed, provenance, drop_group, flags, details)]
     |  group_fields(outcomes of one group) -> Group fields: rewards, reward_failed,
     v  reward_components {name: [value per trajectory]}, metadata["reward"] (counts, canary)
```

The component seam. A component (actors/rewards/components.py) is
`name`, `submit(items) -> Future[list[ComponentResult]]`, `provenance()`, `close()`, built
by a factory `make_component(cfg: RunConfig)` registered by name in `COMPONENTS` (the reward
model is `reward_model` -> "actors.rewards.components:make_reward_model"). A `ScoreItem` carries
the row, the prompt and completion text, the environment's final `Step` (its reward is the
`task` component), `task_failed`, the completion's token count and its finish reason. A
`ComponentResult` is (value: any finite float, failed: reason or "", details, provenance).
A remote scorer returns its future before the reply arrives and resolves it from its own
I/O thread; it should batch the items it is given (one request per `submit`) and may keep
several submits in flight. The pipeline never calls a component from two threads at once.

Failure policy (`reward.on_failure`): a failed component is never a silent 0. Its value is
recorded as 0.0, the trajectory's `failed` names the component and the reason, and then:
`zero` scores the trajectory 0.0; `retry` scores the failed items again (up to
`reward.max_retries` times) and scores 0.0 only if they still fail; `drop_group` marks the
outcome so the actor does not push its group (the prompt is re-issued).
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from actors.rewards.components import (
    ComponentResult,
    RewardComponent,
    ScoreItem,
    build_component,
)
from actors.rewards.compose import TASK, ComposeRule
from asyncrl.config import RunConfig

JUDGE = "judge"
DISAGREEMENT = "disagreement"
"""Derived component: 1.0 where the task verifier and the judge disagree (weight 0)."""
LOG_EVERY_S = 10.0
"""At most one disagreement line per this many seconds in the log (all are counted)."""


@dataclass(frozen=True, kw_only=True)
class RewardOutcome:
    """The composed reward of one trajectory, with everything that explains it."""

    reward: float
    """The composed reward (0.0 when a component failed)."""
    components: dict[str, float]
    """Every component's value (0.0 where it failed), plus `disagreement` when both the task
    and the judge ran."""
    failed: str = ""
    """"name: reason; ..." for the components that failed ("" = none)."""
    failed_components: tuple[str, ...] = ()
    """The names of the components that failed."""
    provenance: dict[str, Any] = field(default_factory=dict)
    """{"rule": hash, "components": {name: {checkpoint, rubric, ...}}}."""
    drop_group: bool = False
    """True under on_failure = drop_group when a component failed: do not push the group."""
    flags: tuple[str, ...] = ()
    """Defences that fired (hedged, master_key, judge_injection, gate:format, disagreement...)."""
    details: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each component's evidence (extracted answer, parsed grade, ...)."""


class RewardPipeline:
    """Runs the configured components over a batch and composes each item's reward."""

    def __init__(
        self,
        components: Sequence[RewardComponent],
        rule: ComposeRule,
        *,
        on_failure: str = "zero",
        max_retries: int = 0,
        timeout_s: float = 120.0,
        disagree_margin: float = 0.5,
        canaries: Any = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.components = list(components)
        self.rule = rule
        self.on_failure = on_failure
        self.max_retries = max_retries if on_failure == "retry" else 0
        self.timeout_s = timeout_s
        self.disagree_margin = disagree_margin
        self.canaries = canaries
        """A CanaryRunner (actors/rewards/canaries.py) or None."""
        self.log = log or _stderr
        self.stats: Counter[str] = Counter()
        """Running counts: items, failed/<name>, flag/<name>, canary alarms."""
        self.pending_canary: dict[str, Any] | None = None
        """The latest canary report, until group_fields hands it to a group."""
        self._last_log = -math.inf

    @classmethod
    def from_config(cls, cfg: RunConfig, *, canaries: Any = None) -> RewardPipeline:
        """The pipeline `[reward]` describes (components built by name)."""
        rule = ComposeRule.from_config(cfg.reward)
        components = [build_component(name, cfg) for name in rule.names]
        return cls(
            components,
            rule,
            on_failure=cfg.reward.on_failure,
            max_retries=cfg.reward.max_retries,
            timeout_s=cfg.reward.component_timeout_s,
            disagree_margin=cfg.reward.disagree_margin,
            canaries=canaries,
        )

    # --- scoring ------------------------------------------------------------------------------

    def score(
        self, items: Sequence[ScoreItem], *, policy_version: int | None = None
    ) -> list[RewardOutcome]:
        """One outcome per item, in order (never raises for a component's fault)."""
        if self.canaries is not None and policy_version is not None:
            if self.canaries.due(policy_version):
                self.pending_canary = self.canaries.run(self.score_items, policy_version)
                self.stats["canary_alarms"] += len(self.pending_canary["alarms"])
        return self.score_items(items)

    def score_items(self, items: Sequence[ScoreItem]) -> list[RewardOutcome]:
        """Steps 1-4 of the module docstring (the canaries' path too)."""
        if not items:
            return []
        results = self.run_components(items)
        provenance = {
            "rule": self.rule.digest(),
            "components": {c.name: c.provenance() for c in self.components},
        }
        outcomes = [
            self.outcome(item, {n: r[i] for n, r in results.items()}, provenance)
            for i, item in enumerate(items)
        ]
        self.stats["items"] += len(items)
        return outcomes

    def run_components(self, items: Sequence[ScoreItem]) -> dict[str, list[ComponentResult]]:
        """Every component's results for `items`, failed items retried per the policy."""
        results = self.submit_all(self.components, items)
        for _ in range(self.max_retries):
            retry = [c for c in self.components if any(r.failed for r in results[c.name])]
            for component in retry:
                todo = [i for i, r in enumerate(results[component.name]) if r.failed]
                again = self.submit_all([component], [items[i] for i in todo])[component.name]
                for i, result in zip(todo, again, strict=True):
                    self.stats[f"retried/{component.name}"] += 1
                    results[component.name][i] = result
        return results

    def submit_all(
        self, components: Sequence[RewardComponent], items: Sequence[ScoreItem]
    ) -> dict[str, list[ComponentResult]]:
        """Submit to all, then wait on each up to the deadline (all run concurrently)."""
        deadline = time.monotonic() + self.timeout_s
        futures: dict[str, Future[list[ComponentResult]] | str] = {}
        for component in components:
            try:
                futures[component.name] = component.submit(items)
            except Exception as exc:  # a component's bug fails its items, not the actor
                futures[component.name] = f"submit raised {type(exc).__name__}: {exc}"
        return {
            name: _collect(future, len(items), deadline, self.timeout_s)
            for name, future in futures.items()
        }

    def outcome(
        self, item: ScoreItem, results: dict[str, ComponentResult], provenance: dict[str, Any]
    ) -> RewardOutcome:
        """Compose one item: values, failures, gates, disagreement, flags."""
        values = {name: r.value for name, r in results.items()}
        failures = {name: r.failed for name, r in results.items() if r.failed}
        flags = [f for r in results.values() for f in r.details.get("flags", ())]
        flags += [f"gate:{g}" for g in self.rule.failed_gates(values)]
        if TASK in results and JUDGE in results and not failures.keys() & {TASK, JUDGE}:
            values[DISAGREEMENT] = float(self.disagrees(values[TASK], values[JUDGE], item))
            flags += [DISAGREEMENT] if values[DISAGREEMENT] else []
        own = {n: r.provenance for n, r in results.items() if r.provenance}
        if own:
            comps = provenance["components"]
            provenance = {
                **provenance,
                "components": {**comps, **{n: {**comps.get(n, {}), **p} for n, p in own.items()}},
            }
        for name in failures:
            self.stats[f"failed/{name}"] += 1
        for flag in flags:
            self.stats[f"flag/{flag}"] += 1
        reward = 0.0 if failures else self.rule.apply(values)
        if not math.isfinite(reward):
            failures["compose"] = f"reward is not finite: {reward!r}"
            reward = 0.0
        return RewardOutcome(
            reward=reward,
            components=values,
            failed="; ".join(f"{n}: {why}" for n, why in failures.items()),
            failed_components=tuple(failures),
            provenance=provenance,
            drop_group=bool(failures) and self.on_failure == "drop_group",
            flags=tuple(dict.fromkeys(flags)),
            details={n: r.details for n, r in results.items() if r.details},
        )

    def disagrees(self, task: float, judge: float, item: ScoreItem) -> bool:
        """Task verifier and judge on different sides of the margin (judge in [0, 1]; a
        pairwise judge's [-1, 1] is mapped onto it). Logged with evidence, rate-limited."""
        judge_01 = (judge + 1.0) / 2.0 if judge < 0 else judge
        differ = (task >= self.disagree_margin) != (judge_01 >= self.disagree_margin)
        if differ:
            self.stats["disagreements"] += 1
            now = time.monotonic()
            if now - self._last_log >= LOG_EVERY_S:
                self._last_log = now
                self.log(
                    f"reward: task={task:.3g} and judge={judge:.3g} disagree "
                    f"({self.stats['disagreements']} so far) on prompt "
                    f"{item.row.prompt_id!r}: completion {item.completion[:120]!r}"
                )
        return differ

    # --- the wire -----------------------------------------------------------------------------

    def group_fields(self, outcomes: Sequence[RewardOutcome]) -> dict[str, Any]:
        """The Group fields of one group's outcomes (the latest canary report rides along on
        the first group built after it)."""
        names = list(dict.fromkeys(n for o in outcomes for n in o.components))
        failures = Counter(n for o in outcomes for n in o.failed_components)
        meta: dict[str, Any] = {
            "provenance": outcomes[0].provenance if outcomes else {},
            "failures": dict(failures),
            "flags": dict(Counter(f for o in outcomes for f in o.flags)),
        }
        if self.pending_canary is not None:
            meta["canary"], self.pending_canary = self.pending_canary, None
        return {
            "rewards": [o.reward for o in outcomes],
            "reward_failed": [o.failed for o in outcomes],
            "reward_components": {n: [o.components.get(n, 0.0) for o in outcomes] for n in names},
            "metadata": {"reward": meta},
        }

    def close(self) -> None:
        """Close every component (threads, worker processes, connections)."""
        for component in self.components:
            component.close()


def _collect(
    future: Future[list[ComponentResult]] | str, num: int, deadline: float, timeout_s: float
) -> list[ComponentResult]:
    """The future's results, checked; every item failed with the reason when anything is off."""
    if isinstance(future, str):
        return [ComponentResult(failed=future)] * num
    try:
        results = future.result(timeout=max(0.0, deadline - time.monotonic()))
    except FutureTimeout:
        future.cancel()
        return [ComponentResult(failed=f"timeout: no answer within {timeout_s:g} s")] * num
    except Exception as exc:  # the scorer's own error, reported with its reason
        return [ComponentResult(failed=f"raised {type(exc).__name__}: {exc}")] * num
    if not isinstance(results, list) or len(results) != num:
        got = len(results) if isinstance(results, list) else type(results).__name__
        return [ComponentResult(failed=f"returned {got} results for {num} items")] * num
    return [_checked(r) for r in results]


def _checked(result: Any) -> ComponentResult:
    if not isinstance(result, ComponentResult):
        return ComponentResult(failed=f"returned a {type(result).__name__}, not a result")
    value = result.value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return ComponentResult(failed=f"value is not a number: {value!r}", details=result.details)
    if not math.isfinite(value):
        return ComponentResult(failed=f"value is not finite: {value!r}", details=result.details)
    if result.failed:
        return ComponentResult(failed=result.failed, details=result.details)  # value -> 0.0
    return result


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
