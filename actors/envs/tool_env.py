"""Multi-turn tool use: the model calls tools until it answers; the answer is scored.

```
  reset(row)  -> prompt: the row's messages (or its prompt as a user message) + tool schemas,
                 or raw text for a raw-text task
  step(turn)  -> calls in the turn (tool_calls.py)?
                   no  -> the turn is the answer: scorer(row, answer, history), done (stop)
                   yes -> run each (toolbox.py), within the episode's tool budget;
                          the results are the next observation (loss_mask 0 in the trajectory)
                          too many failed calls -> done (tool_error)
```

Registered as `tools`: chat models with the `<tool_call>` JSON syntax and any of the built-in
tools (`task.tools`, default calculator, lookup, python) over rows from `task.data`; the
reward is 1 when the row's `answer` appears in the final answer. Every step reports the
reward so far, so an episode cut short (turn or token limit, tool_error) still has one. Each
step's info counts its tool calls, failed and malformed calls and the seconds spent in tools.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from actors.envs.base import Observation, Row, Step
from actors.envs.tool_calls import CallSyntax, JsonCalls, ToolCall, ToolResult
from actors.envs.toolbox import Toolbox
from asyncrl.config import TaskConfig

History = Sequence[tuple[ToolCall, ToolResult]]
Scorer = Callable[[Row, str, History], tuple[float, dict[str, Any]]]
"""(row, final answer ("" if none yet), calls made and their results) -> (reward, details)."""
DEFAULT_TOOLS = ("calculator", "lookup", "python")


class ToolEnv:
    """One tool-use episode (see the module docstring)."""

    def __init__(
        self,
        toolbox: Toolbox,
        syntax: CallSyntax,
        scorer: Scorer,
        *,
        max_tool_calls: int,
        max_tool_errors: int,
        raw_text: bool = False,
    ) -> None:
        self.toolbox, self.syntax, self.scorer = toolbox, syntax, scorer
        self.max_tool_calls, self.max_tool_errors = max_tool_calls, max_tool_errors
        self.raw_text = raw_text
        self.inline_steps = toolbox.quick  # quick tools: no hand-off to a worker thread
        self.row: Row | None = None
        self.history: list[tuple[ToolCall, ToolResult]] = []
        self.num_calls = self.num_errors = 0

    def reset(self, row: Row, seed: int) -> Observation:
        """The prompt (the tools' schemas with it, for the chat template)."""
        self.row, self.history, self.num_calls, self.num_errors = row, [], 0, 0
        if self.raw_text:
            if row.prompt is None:
                raise ValueError(f"prompt {row.prompt_id}: a raw-text task needs a text prompt")
            return Observation(text=row.prompt)
        messages = row.messages or ({"role": "user", "content": row.prompt or ""},)
        return Observation(messages=messages, tools=self.toolbox.schemas())

    def step(self, model_text: str) -> Step:
        """Answer the turn's calls, or score its answer."""
        assert self.row is not None, "step before reset"
        parsed = self.syntax.parse(model_text)
        if not parsed.calls:
            reward, details = self.scorer(self.row, parsed.answer, self.history)
            return Step(reward=reward, done=True, finish_reason="stop", info=details)
        errors_before = self.num_errors
        results = [self.run(call) for call in parsed.calls]
        info = {
            "tool_calls": sum(1 for c in parsed.calls if isinstance(c, ToolCall)),
            "tool_errors": self.num_errors - errors_before,
            "malformed_calls": parsed.num_malformed,
            "tool_s": sum(r.seconds for r in results),
        }
        reward, details = self.scorer(self.row, "", self.history)
        info.update(details)
        if self.num_errors >= self.max_tool_errors:
            return Step(reward=reward, done=True, finish_reason="tool_error", info=info)
        return Step(observation=self.syntax.observation(results), reward=reward, info=info)

    def run(self, call: ToolCall | str) -> ToolResult:
        """One call within the budget; a malformed one is its own error result."""
        if isinstance(call, str):
            result = ToolResult(False, call)
        elif self.num_calls >= self.max_tool_calls:
            result = ToolResult(False, f"tool budget of {self.max_tool_calls} calls spent")
        else:
            self.num_calls += 1
            assert self.row is not None
            result = self.toolbox.call(call, self.row)
            self.history.append((call, result))
        self.num_errors += not result.ok
        return result


def answer_match(row: Row, answer: str, history: History) -> tuple[float, dict[str, Any]]:
    """1 when the row's answer appears in the final answer (whitespace-insensitive), else 0."""
    if row.answer is None:
        return 0.0, {"reward_failed": f"prompt {row.prompt_id} has no answer to check against"}
    expected = "".join(str(row.answer).split())
    got = "".join(answer.split())
    return float(bool(expected) and expected in got), {"answer": answer[-200:]}


def make_env(task: TaskConfig) -> ToolEnv:
    """The registry's factory of `tools` episodes."""
    return ToolEnv(
        Toolbox(task.tools or DEFAULT_TOOLS),
        JsonCalls(),
        answer_match,
        max_tool_calls=task.max_tool_calls,
        max_tool_errors=task.max_tool_errors,
    )
