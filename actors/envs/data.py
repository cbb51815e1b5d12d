"""Task rows from JSONL files, and how a row travels through the hub and back.

A row file (`task.data`) holds one JSON object per line:

```
{"prompt": "What is 2 + 3?", "answer": "5"}
{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
 "info": {"table": {"a": "1"}}, "prompt_id": "greet-1"}
```

- `prompt` (text) or `messages` (chat messages with string `role` and `content`), exactly one;
- `answer`, `tests` (any JSON), `info` (an object), `prompt_id` (a string; default
  ``"<file stem>-<line number>"``); any other key is an error.

The file is read line by line as the hub reads its prompts file (asyncrl/prompt_records.py
`read_jsonl`): every bad row is reported with its file and line number (`ValueError`), never
skipped; a blank line is the only thing passed over; prompt ids must be unique.

The hub hands out prompt records ``{"prompt_id", "prompt", "info"}`` (asyncrl/prompt_records.py
`Prompt`), so a row travels with its `answer`, `tests` and `messages` inside `info` under those
names (`CARRIED`, `to_record`), and the actor rebuilds the row from the credit
(`from_credit`). A row whose own `info` already uses one of those names for something else is
refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from actors.envs.base import Row
from asyncrl.prompt_records import CARRIED, Prompt, read_jsonl, write_records

ROW_KEYS = frozenset({"prompt_id", "prompt", "messages", "answer", "tests", "info"})


def read_rows(path: str | Path) -> list[Row]:
    """The rows of a JSONL file; `ValueError` naming file and line for the first bad one."""
    stem = Path(path).expanduser().stem
    return read_jsonl(
        path,
        lambda obj, where, line_no: parse_row(obj, default_id=f"{stem}-{line_no}", where=where),
        what="task.data",
        noun="rows",
    )


def parse_row(obj: dict[str, Any], *, default_id: str, where: str) -> Row:
    """One row from its JSON object (`where` prefixes every error)."""
    unknown = sorted(set(obj) - ROW_KEYS)
    if unknown:
        raise ValueError(
            f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(ROW_KEYS))})"
        )
    prompt_id = obj.get("prompt_id", default_id)
    if not isinstance(prompt_id, str) or not prompt_id:
        raise ValueError(f"{where}: prompt_id must be a non-empty string")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        raise ValueError(f"{where}: a row needs exactly one of prompt and messages")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise ValueError(f"{where}: prompt must be a non-empty string")
    info = obj.get("info", {})
    if not isinstance(info, dict):
        raise ValueError(f"{where}: info must be an object")
    clash = sorted(k for k in CARRIED if k in info and obj.get(k) is not None)
    if clash:
        raise ValueError(f"{where}: info.{clash[0]} would hide the row's own {clash[0]}")
    return Row(
        prompt_id=prompt_id,
        prompt=prompt,
        messages=None if messages is None else check_messages(messages, where),
        answer=obj.get("answer"),
        tests=obj.get("tests"),
        info=info,
    )


def check_messages(messages: Any, where: str) -> tuple[dict[str, str], ...]:
    """Chat messages as a tuple of {"role", "content"} string maps; `ValueError` otherwise."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: messages must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        ok = isinstance(msg, dict) and all(isinstance(msg.get(k), str) for k in ("role", "content"))
        if not ok or not set(msg) <= {"role", "content", "name", "tool_call_id"}:
            raise ValueError(
                f"{where}: messages[{i}] must be an object with string role and content"
            )
        out.append(dict(msg))
    return tuple(out)


def to_record(row: Row) -> Prompt:
    """The hub's prompt record of a row (answer, tests, messages carried in `info`)."""
    info = dict(row.info)
    for key in CARRIED:
        value = getattr(row, key)
        if value is not None:
            info[key] = list(value) if key == "messages" else value
    prompt = row.prompt if row.prompt is not None else _last_user_text(row.messages or ())
    return Prompt(row.prompt_id, prompt, info)


def from_credit(prompt_id: str, prompt: str, info: dict[str, Any]) -> Row:
    """The row a credit stands for (inverse of `to_record`)."""
    messages = info.get("messages")
    return Row(
        prompt_id=prompt_id,
        prompt=None if messages is not None else prompt,
        messages=None if messages is None else check_messages(messages, f"prompt {prompt_id}"),
        answer=info.get("answer"),
        tests=info.get("tests"),
        info=info,
    )


def write_rows(path: str | Path, rows: Sequence[Row]) -> Path:
    """Write the hub's prompts file for `rows` (atomically) and return its path."""
    return write_records(path, [to_record(row) for row in rows])


def _last_user_text(messages: Sequence[dict[str, str]]) -> str:
    users = [m["content"] for m in messages if m["role"] == "user"]
    return users[-1] if users else messages[-1]["content"]
