"""The prompts file: one schema for the hub that reads it and the actors that write it.

The hub's dataset is a JSONL file with one prompt record a line:

```
{"info": {"answer": "1134", "digits": "3141"}, "prompt": "3141:", "prompt_id": "sort-4-0-000000"}
```

- `prompt_id` and `prompt` (strings) are required; `info` (a JSON object) is optional and
  defaults to {}; other keys are ignored. Prompt ids are unique.
- Blank lines are skipped; every bad line is a `ValueError` naming the file and line.

```
  task rows --to_record (actors/envs/data.py)--> Prompt --write_records--> prompts.jsonl
  prompts.jsonl --load_dataset (replay/prompts.py: read_jsonl + parse_record)--> [Prompt]
     --a credit (prompt_id, prompt, info)--> actor --from_credit (actors/envs/data.py)--> row
```

A task row's `answer`, `tests` and chat `messages` ride inside `info` under those names
(`CARRIED`); `prompt` holds the row's text, or the last user message of a chat row (what the
hub's logs and evals show). Task row files (`task.data`, actors/envs/data.py) carry more
fields, but are read line by line the same way (`read_jsonl`): blank lines skipped, one JSON
object a line, errors at file:line, unique prompt ids.

Torch-free: the hub imports this module.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from asyncrl.files import replace_text

CARRIED = ("answer", "tests", "messages")
"""Task-row fields that travel inside a record's `info` under their own names."""


@dataclass(frozen=True)
class Prompt:
    """One prompt record: what the hub hands out in a credit."""

    prompt_id: str
    """Stable id (the hub re-issues prompts by it; seeds derive from it)."""
    prompt: str
    """The prompt text (a chat row's last user message)."""
    info: dict[str, Any] = field(default_factory=dict)
    """What scoring needs (JSON-able), the task row's CARRIED fields included."""


class _Identified(Protocol):
    @property
    def prompt_id(self) -> str: ...


Item = TypeVar("Item", bound=_Identified)


def read_jsonl(
    path: str | Path,
    parse: Callable[[dict[str, Any], str, int], Item],
    *,
    what: str,
    noun: str,
) -> list[Item]:
    """`parse(obj, where, line_no)` of every non-blank line of a JSONL file, in order.

    `ValueError` for a missing file (naming the config key `what`), a line that is not a JSON
    object, a prompt id used twice and a file with no `noun` in it; `where` ("file:line")
    prefixes every error, `parse`'s own included.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"{what}: file not found: {str(path)!r}")
    items: list[Item] = []
    first_line: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: must be a JSON object, got {type(obj).__name__}")
            item = parse(obj, where, line_no)
            if item.prompt_id in first_line:
                raise ValueError(
                    f"{where}: duplicate prompt_id {item.prompt_id!r} "
                    f"(already used on line {first_line[item.prompt_id]})"
                )
            first_line[item.prompt_id] = line_no
            items.append(item)
    if not items:
        raise ValueError(f"{path}: no {noun}")
    return items


def parse_record(obj: dict[str, Any], where: str, line_no: int = 0) -> Prompt:
    """One prompt record from its JSON object (`where` prefixes every error)."""
    for key in ("prompt_id", "prompt"):
        if not isinstance(obj.get(key), str):
            raise ValueError(f"{where}: {key} must be a string")
    info = obj.get("info", {})
    if not isinstance(info, dict):
        raise ValueError(f"{where}: info must be an object")
    return Prompt(obj["prompt_id"], obj["prompt"], info)


def record_line(record: Prompt) -> str:
    """A record as its line of the prompts file (keys sorted, newline included)."""
    obj = {"prompt_id": record.prompt_id, "prompt": record.prompt, "info": record.info}
    return json.dumps(obj, sort_keys=True) + "\n"


def write_records(path: str | Path, records: Iterable[Prompt]) -> Path:
    """Write a prompts file (atomically: readers see the old file or the new) and return its
    path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_text(path, "".join(record_line(r) for r in records))
    return path
