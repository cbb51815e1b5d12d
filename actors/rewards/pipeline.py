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
     |  4. compose each item (`ComposeRule`: gates, weighted sum, clip), count task-vs-judge
     |     disagreements, collect guard flags and provenance
     |  5. every reward.canary_every versions: score the canary set through steps 1-4
     v     (actors/rewards/canaries.py); a known-wrong response that earns reward -> alarm
  [RewardOutcome(reward, components, failed, provenance, drop_group, flags, details)]
     |  group_fields(outcomes of one group) -> Group fields: rewards, reward_failed,
     v  reward_components {name: [value per trajectory]}, metadata["reward"] (counts, canary)
```

This module owns the two seams of a reward and the rule that joins them:

The verifier seam. A verifier (`Verifier`) scores one completion of one prompt with a
`RewardResult`, any finite float (the built-in ones answer in [0, 1]). Verifiers are user code
and may fail; `safe_score` is what calls them: it never raises, and it turns an exception, a
non-number or a non-finite reward into reward 0.0 with `failed` naming the reason (so the
failure is visible in metrics instead of silently skewing the advantages). A task's verifier
runs inside its environment; its verdict (the final `Step`'s reward) is the `task` component.

The component seam. A component (`RewardComponent`) is `name`, `submit(items) ->
Future[list[ComponentResult]]`, `provenance()`, `close()`. It scores a batch of finished
episodes (`ScoreItem`s: the row, the prompt and completion text, the environment's final
`Step`, `task_failed`, the completion's token count and its finish reason) and answers one
`ComponentResult` (value: any finite float, failed: reason or "", details, provenance) per
item, in order. `submit` only STARTS the work: the pipeline submits to every component before
it waits on any, so a remote, batched scorer (the reward-model client) overlaps with local
ones and with each other. A component that computes inline returns a finished future
(`InlineComponent` does this for a per-item `score_one`). A remote scorer returns its future
before the reply arrives and resolves it from its own I/O thread; it should batch the items
it is given (one request per `submit`) and may keep several submits in flight. The pipeline
never calls a component from two threads at once. Rules a component keeps (the pipeline
enforces them and records a breach as a failure):
- one result per item, in the items' order; `value` a finite float (any range);
- a failure is a result with `failed` set to the reason (never a silent 0); an exception
  raised by `submit` or by the future fails every item of the batch with that reason;
- `provenance()` names what produced the values (checkpoint hash, rubric hash, model URL);
  a result's own `provenance` (e.g. the checkpoint that answered this item) overrides it.

Components are looked up by name: `COMPONENTS` maps a name to "module:function" (imported
lazily, asyncrl/plugins.py), the factory is `make_component(cfg: RunConfig) ->
RewardComponent`; a user's own component is configured as
`[reward.modules] name = "pkg.mod:make_component"`.

The composition rule (`ComposeRule`, from `[reward]` in the run config: `RewardConfig`,
asyncrl/config.py):

```
  values {task: 1.0, format: 1.0, overlong: -0.25, judge: 0.7}
     |  gates ("format", "judge>=0.5"): any gate failing -> reward = gate_reward, stop
     v
  weighted sum  sum_i weights[i] * values[i]     (components at weight 0 are only logged)
     |  clip to [clip_min, clip_max]             (when clip_max > clip_min)
     v
  reward (any finite float)
```

Its hash goes into every trajectory's provenance, so a reward can be traced to the rule that
made it.

Failure policy (`reward.on_failure`): a failed component is never a silent 0. Its value is
recorded as 0.0, the trajectory's `failed` names the component and the reason, and then:
`zero` scores the trajectory 0.0; `retry` scores the failed items again (up to
`reward.max_retries` times) and scores 0.0 only if they still fail; `drop_group` marks the
outcome so the actor does not push its group (the prompt is re-issued).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from actors.envs.base import Row, Step
from asyncrl.config import RewardConfig, RunConfig
from asyncrl.plugins import load_attr

if TYPE_CHECKING:
    from actors.episodes import Episode

# --- the verifier seam ---------------------------------------------------------------------------


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


# --- the component seam --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ScoreItem:
    """One finished episode, as every component sees it."""

    row: Row
    """The dataset row (answer, tests, info)."""
    prompt: str
    """The prompt text the model saw (rendered)."""
    completion: str
    """Everything the model wrote (all its turns, decoded; the end token cut off)."""
    step: Step | None = None
    """The environment's final step: its `reward` is the `task` component (None: no env ran)."""
    task_failed: str = ""
    """Why the environment could not score the episode ("" = it could)."""
    num_completion_tokens: int = 0
    """Tokens the model generated in the episode."""
    finish_reason: str = "stop"
    """Why the episode ended (stop, length, turn_limit, tool_error, timeout)."""


@dataclass(frozen=True, kw_only=True)
class ComponentResult:
    """One component's value for one item."""

    value: float = 0.0
    """The component's value: any finite float (0.0 when it failed)."""
    failed: str = ""
    """Why the value could not be computed ("" = it was)."""
    details: dict[str, Any] = field(default_factory=dict)
    """JSON-able evidence (parsed grade, extracted answer, flags)."""
    provenance: dict[str, str] = field(default_factory=dict)
    """What produced this value, overriding the component's `provenance()` for this item."""


class RewardComponent(Protocol):
    """A named part of the reward."""

    name: str

    def submit(self, items: Sequence[ScoreItem]) -> Future[list[ComponentResult]]:
        """Start scoring `items`; the future resolves to one result per item, in order."""
        ...

    def provenance(self) -> dict[str, str]:
        """What produces this component's values (checkpoint, rubric hash, model), JSON-able."""
        ...

    def close(self) -> None:
        """Release threads, processes and connections."""
        ...


class InlineComponent:
    """Base of components that score one item at a time, inline, in the caller's thread."""

    name = "inline"

    def score_one(self, item: ScoreItem) -> ComponentResult:
        """The value of one item (an exception fails that item only)."""
        raise NotImplementedError

    def submit(self, items: Sequence[ScoreItem]) -> Future[list[ComponentResult]]:
        """Every item scored now; a finished future."""
        results = []
        for item in items:
            try:
                results.append(self.score_one(item))
            except Exception as exc:  # one bad item must not fail the others
                results.append(ComponentResult(failed=f"raised {type(exc).__name__}: {exc}"))
        return done(results)

    def provenance(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        return None


def done(results: list[ComponentResult]) -> Future[list[ComponentResult]]:
    """A future that already holds `results`."""
    future: Future[list[ComponentResult]] = Future()
    future.set_result(results)
    return future


class TaskComponent(InlineComponent):
    """The task verifier: the environment's own reward (its final step's `reward`)."""

    name = "task"

    def score_one(self, item: ScoreItem) -> ComponentResult:
        if item.task_failed:
            return ComponentResult(failed=item.task_failed)
        if item.step is None:  # ended (timeout, token budget) before any verdict: reward 0
            return ComponentResult(value=0.0, details={"no_step": item.finish_reason})
        return ComponentResult(value=float(item.step.reward), details=dict(item.step.info))


COMPONENTS: dict[str, str] = {
    "task": "actors.rewards.pipeline:make_task",
    "format": "actors.rewards.guards:make_format",
    "overlong": "actors.rewards.guards:make_overlong",
    "repetition": "actors.rewards.guards:make_repetition",
    "judge": "actors.rewards.judge:make_component",
    "reward_model": "actors.rewards.rm_client:make_reward_model",
}
"""Built-in components by name. Add yours with `[reward.modules] name = "pkg.mod:fn"`."""

ComponentFactory = Callable[[RunConfig], RewardComponent]


def make_task(cfg: RunConfig) -> RewardComponent:
    """The `task` component (needs no settings)."""
    return TaskComponent()


def component_factory(name: str, cfg: RunConfig) -> ComponentFactory:
    """The factory of component `name`: a user module from `reward.modules`, else built-in."""
    target = cfg.reward.modules.get(name) or COMPONENTS.get(name)
    if target is None:
        known = ", ".join(sorted(COMPONENTS))
        raise ValueError(
            f"reward.weights: unknown component {name!r} (known: {known}; "
            'or add it under [reward.modules] as name = "pkg.mod:make_component")'
        )
    return load_attr(target, what=f"reward: component {name!r}")


def build_component(name: str, cfg: RunConfig) -> RewardComponent:
    """Component `name`, built from the run config; its `name` must match."""
    component = component_factory(name, cfg)(cfg)
    if getattr(component, "name", None) != name:
        component.name = name  # a user factory may serve several names
    return component


def item_from_episode(row: Row, episode: Episode) -> ScoreItem:
    """The ScoreItem of one finished episode (actors/episodes.py `Episode`): its model turns
    joined by newlines, its final step, and why the environment could not score it."""
    _, mask, _ = episode.trajectory()
    return ScoreItem(
        row=row,
        prompt=prompt_text(row),
        completion="\n".join(episode.model_texts),
        step=episode.last_step,
        task_failed=episode.reward_failed,
        num_completion_tokens=int(mask.sum()),
        finish_reason=episode.finish_reason or "stop",
    )


def prompt_text(row: Row) -> str:
    """The row's prompt as text: `prompt`, else its chat messages' contents joined."""
    if row.prompt is not None:
        return row.prompt
    return "\n".join(m.get("content", "") for m in row.messages or ())


# --- the composition rule ------------------------------------------------------------------------

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


# --- the pipeline --------------------------------------------------------------------------------

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
