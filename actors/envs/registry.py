"""The task registry: a task name -> the "module:function" that makes its environments.

```
  [task] name = "lookup"                 -> TASKS["lookup"] = "actors.envs.lookup:make_env"
  [task] module = "my_pkg.my_env:make_env"  (a task of your own; overrides name)
        |  imported lazily, on first use (asyncrl/plugins.py: errors name the key)
        v
  make_env(task: TaskConfig) -> Env        called once per episode (keep it cheap)
  make_rows(task: TaskConfig) -> [Row]     optional, same module: generated default rows
```

Rows come from `task.data` (a JSONL file, actors/envs/data.py) when set, else from the task
module's `make_rows`. `write_prompts` turns them into the hub's prompts file; that is all
`asyncrl run` needs to know about a task, so the core imports no task by name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from actors.envs.base import Env, Row
from actors.envs.data import read_rows, write_rows
from asyncrl.config import TaskConfig
from asyncrl.plugins import load_attr, load_module

TASKS: dict[str, str] = {
    "sort": "actors.envs.sort_task:make_env",
    "lookup": "actors.envs.lookup:make_env",
    "tools": "actors.envs.tool_env:make_env",
    "humaneval": "actors.envs.humaneval:make_env",
    "math": "actors.envs.math_task:make_env",
}
"""Built-in tasks. Add yours here, or name it in config with `[task] module = "pkg.mod:fn"`."""

EnvFactory = Callable[[TaskConfig], Env]


def task_target(task: TaskConfig) -> str:
    """The "module:function" that makes `task`'s environments."""
    if task.module:
        return task.module
    if task.name not in TASKS:
        known = ", ".join(sorted(TASKS))
        raise ValueError(
            f"task.name: unknown task {task.name!r} (known: {known}; or set task.module)"
        )
    return TASKS[task.name]


def task_key(task: TaskConfig) -> str:
    """The config key errors about the task's module name: the one the user set."""
    return "task.module" if task.module else "task.name"


def task_module(task: TaskConfig) -> ModuleType:
    """The module of the task's `make_env` (it may also hold `make_rows`, `make_canaries` and
    `row_from_json`)."""
    return load_module(task_target(task), what=task_key(task))


def env_factory(task: TaskConfig) -> EnvFactory:
    """The task's `make_env` (imported now, so a bad name fails before any episode)."""
    return load_attr(task_target(task), what=task_key(task))


def task_rows(task: TaskConfig) -> list[Row]:
    """The task's rows: `task.data` if set, else the task module's generated `make_rows`."""
    if task.data:
        return read_rows(task.data)
    make_rows = getattr(task_module(task), "make_rows", None)
    if make_rows is None:
        raise ValueError(f"task.data: task {task.name!r} generates no rows; give a JSONL file")
    return list(make_rows(task))


def write_prompts(task: TaskConfig, path: str | Path) -> Path:
    """The hub's prompts file for `task` at `path` (`task.dataset` itself when that is set)."""
    if task.dataset:
        return Path(task.dataset)
    env_factory(task)  # an unknown task fails here, before any process starts
    return write_rows(path, task_rows(task))
