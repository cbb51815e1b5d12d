"""Reward components: what one named part of a reward is given, what it returns, how it runs.

A component scores a batch of finished episodes (`ScoreItem`s) and answers one
`ComponentResult` per item, in order. `submit` only STARTS the work and returns a
`concurrent.futures.Future`: the pipeline submits to every component before it waits on any,
so a remote, batched scorer (the reward-model client) overlaps with local ones and with each
other. A component that computes inline returns a finished future (`InlineComponent` does
this for a per-item `score_one`).

Rules a component keeps (the pipeline enforces them and records a breach as a failure):
- one result per item, in the items' order; `value` a finite float (any range);
- a failure is a result with `failed` set to the reason (never a silent 0); an exception
  raised by `submit` or by the future fails every item of the batch with that reason;
- `provenance()` names what produced the values (checkpoint hash, rubric hash, model URL);
  a result's own `provenance` (e.g. the checkpoint that answered this item) overrides it.

Components are looked up by name (`COMPONENTS`: name -> "module:function", imported lazily);
the factory is `make_component(cfg: RunConfig) -> RewardComponent`. A user's own component
is configured as `[reward.modules] name = "pkg.mod:make_component"`.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from actors.envs.base import Row, Step
from asyncrl.config import RunConfig


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
    "task": "actors.rewards.components:make_task",
    "format": "actors.rewards.guards:make_format",
    "overlong": "actors.rewards.guards:make_overlong",
    "repetition": "actors.rewards.guards:make_repetition",
    "judge": "actors.rewards.judge:make_component",
    "reward_model": "actors.rewards.components:make_reward_model",
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
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"reward: component {name!r}: cannot import {module_name} ({exc})"
        ) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"reward: component {name!r}: {target} is not a callable")
    return factory


def build_component(name: str, cfg: RunConfig) -> RewardComponent:
    """Component `name`, built from the run config; its `name` must match."""
    component = component_factory(name, cfg)(cfg)
    if getattr(component, "name", None) != name:
        component.name = name  # a user factory may serve several names
    return component


def item_from_episode(row: Row, episode: Any) -> ScoreItem:
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


def resolve_later(pending: Any, convert: Callable[[Any], list[ComponentResult]]) -> Future:
    """A Future of `convert(pending.result())`, resolved on a daemon thread (an adapter for
    scorers that hand back their own pending objects, such as the reward-model client's)."""
    future: Future[list[ComponentResult]] = Future()

    def wait() -> None:
        try:
            future.set_result(convert(pending.result()))
        except Exception as exc:  # reported through the future, with its reason
            future.set_exception(exc)

    threading.Thread(target=wait, name="reward-wait", daemon=True).start()
    return future


class RewardModelAdapter:
    """The served reward model (actors/rewards/rm_component.py `RewardModelComponent`) as a
    pipeline component: its per-item failures become failed results with their reason."""

    name = "reward_model"

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def submit(self, items: Sequence[ScoreItem]) -> Future[list[ComponentResult]]:
        return resolve_later(self.inner.submit(items), _from_rm_scores)

    def provenance(self) -> dict[str, str]:
        return dict(self.inner.provenance())

    def close(self) -> None:
        self.inner.close()


def _from_rm_scores(scores: list[Any]) -> list[ComponentResult]:
    return [ComponentResult(value=s.value, failed=s.failed) for s in scores]


def make_reward_model(cfg: RunConfig) -> RewardComponent:
    """The `reward_model` component: a client of `reward_model.endpoint`."""
    from actors.rewards.rm_component import RewardModelComponent

    if not cfg.reward_model.endpoint:
        raise ValueError(
            "reward_model.endpoint: the reward_model component needs a server "
            "(set it, or reward_model.serve = true under asyncrl run)"
        )
    inner = RewardModelComponent.from_config(cfg.reward_model, f"rm-{os.getpid()}")
    return RewardModelAdapter(inner)
