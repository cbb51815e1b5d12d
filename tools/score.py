"""`asyncrl score --task NAME --row ROW.json --completion FILE`: score one completion by hand.

Uses exactly the actor's path for single-turn tasks: the task registry's `make_env` (a built-in
name), then `reset(row, seed=0)` and `step(completion)` (the sandbox included for code tasks).
The row is read by the task module's `row_from_json` when it has one (for humaneval: the
package's own problem object), else as one row of a JSONL task file (actors/envs/data.py
`parse_row`).
Prints one JSON object: `reward` at the top level, then `done`, `finish_reason` and the
environment's details (`info`, with `reward_failed` when the verifier itself failed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from actors.envs.base import Row
from actors.envs.data import from_credit, parse_row, to_record
from actors.envs.registry import env_factory, task_module
from asyncrl.config import TaskConfig


def row_from(module: Any, obj: Any, where: str) -> Row:
    """A Row from JSON: the task's own `row_from_json`, else the generic JSONL row format."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: must hold one JSON object")
    if hasattr(module, "row_from_json"):
        return module.row_from_json(obj)
    return parse_row(obj, default_id="row", where=where)


def score(task_name: str, row_obj: Any, completion: str, where: str = "row") -> dict[str, Any]:
    """Reset the task's environment on the row, step it with the completion, report."""
    task = TaskConfig(name=task_name)
    make_env = env_factory(task)
    env = make_env(task)
    row = row_from(task_module(task), row_obj, where)
    record = to_record(row)  # the row as an actor gets it back from the hub
    env.reset(from_credit(record.prompt_id, record.prompt, record.info), seed=0)
    step = env.step(completion)
    if not step.done:
        raise ValueError(f"--task: {task_name} is multi-turn; score takes single-turn tasks only")
    return {
        "reward": step.reward,
        "task": task_name,
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
        report = score(args.task, row_obj, completion, where=str(args.row))
    except (ValueError, OSError) as exc:
        print(f"asyncrl score: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 0
