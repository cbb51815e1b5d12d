"""Plugins named "pkg.mod:attr": the one loader for every table of them.

```
  TASKS["sort"]        = "actors.envs.sort_task:make_env"      [task] module = "pkg.mod:fn"
  COMPONENTS["judge"]  = "actors.rewards.judge:make_component" [reward.modules] name = "pkg.mod:fn"
        |  load_attr(spec, what="task.module")   imported when first used, not before
        v
  the attribute (a factory), or ValueError naming `what` and the spec:
     bad spec        task.module: must look like "pkg.mod:attr", got 'no_colon'
     missing module  task.module: cannot import 'no_such_pkg' (No module named 'no_such_pkg')
     missing attr    task.module: module 'json' has no 'make_env'
```

`what` is the config key (or table entry) the spec came from, so the error says what to fix.
`load_module` does the same for a spec's module alone: a plugin module may offer optional
companions beside its attribute (a task's `make_rows`, `make_canaries`, `row_from_json`),
looked up with `getattr(module, name, None)`.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


def split_spec(spec: str, *, what: str) -> tuple[str, str]:
    """("pkg.mod", "attr") of a "pkg.mod:attr" spec; `ValueError` naming `what` otherwise."""
    module_name, colon, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not colon or not module_name or not attr or ":" in attr:
        raise ValueError(f'{what}: must look like "pkg.mod:attr", got {spec!r}')
    return module_name, attr


def load_module(spec: str, *, what: str) -> ModuleType:
    """The module a "pkg.mod:attr" spec names, imported; `ValueError` naming `what` when the
    spec is malformed or the module cannot be imported (the import error says why)."""
    module_name, _ = split_spec(spec, what=what)
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what}: cannot import {module_name!r} ({exc})") from exc


def load_attr(spec: str, *, what: str, callable_only: bool = True) -> Any:
    """The attribute a "pkg.mod:attr" spec names; `ValueError` naming `what` for a malformed
    spec, a module that cannot be imported, a missing attribute or (with `callable_only`, the
    default: specs name factories) an attribute that cannot be called."""
    module = load_module(spec, what=what)
    _, attr = split_spec(spec, what=what)
    if not hasattr(module, attr):
        raise ValueError(f"{what}: module {module.__name__!r} has no {attr!r}")
    value = getattr(module, attr)
    if callable_only and not callable(value):
        raise ValueError(f"{what}: {spec} is not callable")
    return value
