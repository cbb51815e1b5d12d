"""The environment seam: one interface for single-turn and multi-turn episodes.

An episode is a conversation between the model and an environment:

```
  row, seed --> env.reset() --> Observation (the prompt: chat messages, or raw text)
                                   |
           +-----------------------+
           v
   model turn (engine tokens, loss_mask 1)  --text-->  env.step(text) --> Step
           ^                                                               |
           +---- Step.observation (tool output / user text, loss_mask 0) --+  until Step.done
```

The episode runner owns tokens: it appends the engine's own token ids for every model turn and
the environment's text tokenized on its own (never a re-render of the whole chat), so the
trajectory is exactly what the engine produced. Environments see and return text only.

An environment instance runs one episode at a time; the runner makes one per episode from the
task's factory. `reset` with the same row and seed, followed by the same model texts, must give
the same episode (environments keep any randomness in a `random.Random(seed)` of their own).
`step` gets the decoded text of the model's turn without its stop token (a turn cut by the
token limit is passed as it is: a truncated tool call is the environment's to report).

The runner calls `step` on a worker thread (a tool may take seconds) unless the environment
sets `inline_steps = True`: for a step that is a quick computation (a verifier), the hand-off to
a thread costs more than the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

FinishReason = Literal["stop", "length", "turn_limit", "tool_error", "timeout"]
"""Why an episode ended: the model stopped (and the environment ended the episode), a token
limit was hit, the turn limit was hit, a tool failed for good, or a wall-clock limit fired."""


@dataclass(frozen=True, kw_only=True)
class Row:
    """One dataset row: the prompt (plain text or chat messages) and what scoring needs."""

    prompt_id: str
    """Stable id of the row (the hub re-issues prompts by it)."""
    prompt: str | None = None
    """Plain prompt text (used as is, or as one user message when the model has a chat
    template and the task asks for chat)."""
    messages: tuple[dict[str, str], ...] | None = None
    """Chat messages ({"role", "content"}) instead of `prompt`."""
    answer: Any = None
    """Reference answer, if the task has one."""
    tests: Any = None
    """Unit tests or other checks, if the task has them."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything else the task needs (free form, JSON-able)."""


@dataclass(frozen=True, kw_only=True)
class Observation:
    """What the environment shows the model before its next turn."""

    messages: tuple[dict[str, str], ...] = ()
    """New chat messages to append, rendered with the model's chat template (first observation:
    the prompt; later: `tool` or `user` messages)."""
    text: str | None = None
    """Raw text to append as is instead of messages (tasks without a chat template)."""
    tools: tuple[dict[str, Any], ...] = ()
    """JSON schemas of the tools offered (first observation only): the chat template renders
    them into the prompt (its `tools` argument), the usual way."""


@dataclass(frozen=True, kw_only=True)
class Step:
    """The environment's answer to one model turn."""

    observation: Observation | None = None
    """Shown to the model before its next turn; None when the episode is done."""
    reward: float = 0.0
    """Reward of the episode so far (the final step's value is the episode's task reward)."""
    done: bool = False
    """True when the episode is over."""
    finish_reason: FinishReason | None = None
    """Set when done: why the episode ended."""
    info: dict[str, Any] = field(default_factory=dict)
    """JSON-able details (parsed answer, tool calls, verifier details). Keys the runner reads:
    `reward_failed` (why the reward could not be computed), `tool_s` (seconds this step spent
    in tools), `tool_calls`, `tool_errors` and `malformed_calls` (counts for this step)."""


class Env(Protocol):
    """One episode of a task at a time (optionally `inline_steps: bool`, see the module doc)."""

    def reset(self, row: Row, seed: int) -> Observation:
        """Start an episode on `row`; the first observation is the prompt."""
        ...

    def step(self, model_text: str) -> Step:
        """React to the model's turn (decoded text of the engine's tokens)."""
        ...
