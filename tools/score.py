"""`asyncrl score --task NAME --row ROW.json --completion FILE`: score one completion by hand.

Uses exactly the actor's path for single-turn tasks: the task module's `make_env`, then
`reset(row, seed=0)` and `step(completion)` (the sandbox included for code tasks). The row is
read by the task module's `row_from_json` (for humaneval: the package's own problem object).
Prints one JSON object: `reward` at the top level, then `done`, `finish_reason` and the
environment's details (`info`, with `reward_failed` when the verifier itself failed).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

from actors.envs.base import Row
from asyncrl.config import TaskConfig


def load_task(name: str) -> Any:
    """The task's module (`actors.envs.<name>`); it must offer make_env and row_from_json."""
    if not name.isidentifier():
        raise ValueError(f"--task: not a task name: {name!r}")
    try:
        module = importlib.import_module(f"actors.envs.{name}")
    except ModuleNotFoundError as exc:
        raise ValueError(f"--task: no task module actors.envs.{name}") from exc
    if not hasattr(module, "make_env"):
        raise ValueError(f"--task: actors.envs.{name} has no make_env")
    return module


def row_from(module: Any, obj: Any) -> Row:
    """A Row from JSON: the task's own parser, else the generic row fields."""
    if not isinstance(obj, dict):
        raise ValueError("--row: must hold one JSON object")
    if hasattr(module, "row_from_json"):
        return module.row_from_json(obj)
    unknown = set(obj) - {"prompt_id", "prompt", "answer", "tests", "info"}
    if unknown or "prompt" not in obj:
        raise ValueError(f"--row: expected prompt/answer/tests/info, got {sorted(obj)}")
    return Row(
        prompt_id=str(obj.get("prompt_id", "row")),
        **{k: v for k, v in obj.items() if k != "prompt_id"},
    )


def score(task: str, row_obj: dict[str, Any], completion: str) -> dict[str, Any]:
    """Reset the task's environment on the row, step it with the completion, report."""
    module = load_task(task)
    env = module.make_env(TaskConfig())
    env.reset(row_from(module, row_obj), seed=0)
    step = env.step(completion)
    if not step.done:
        raise ValueError(f"--task: {task} is multi-turn; score scores single-turn tasks only")
    return {
        "reward": step.reward,
        "task": task,
        "done": step.done,
        "finish_reason": step.finish_reason,
        "info": step.info,
    }


def main(argv: list[str]) -> int:
    """Entry point of `asyncrl score`."""
    parser = argparse.ArgumentParser(prog="asyncrl score", description=__doc__)
    parser.add_argument("--task", required=True, help="task name (a module in actors/envs/)")
    parser.add_argument("--row", required=True, type=Path, help="JSON file: one dataset row")
    parser.add_argument("--completion", required=True, type=Path, help="file: the model's text")
    args = parser.parse_args(argv)
    try:
        row_obj = json.loads(args.row.read_text())
        completion = args.completion.read_text()
        report = score(args.task, row_obj, completion)
    except (ValueError, OSError) as exc:
        print(f"asyncrl score: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 0
