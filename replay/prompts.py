"""The prompt source of the hub: a JSONL dataset, a cursor over epochs, and a re-issue queue.

Dataset: one JSON object per line, ``{"prompt_id": str, "prompt": str, "info": {...}?}``; blank
lines are skipped; errors name the file and line number; prompt ids must be unique.

`next_prompt()` takes from the re-issue queue first (prompts whose group was dropped as stale,
whose credit expired with a dead actor, or that an actor handed back), then from the cursor,
which cycles through the dataset in order, epoch after epoch.

Seeds are deterministic per credit: a function of the run seed, the prompt id and how many
times that prompt has been issued before, so re-running a hub hands out the same seeds for the
same prompt attempts regardless of timing.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    prompt: str
    info: dict[str, Any] = field(default_factory=dict)


def load_dataset(path: str | Path) -> list[Prompt]:
    """Read and validate a JSONL prompt dataset."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset {path}: file not found")
    prompts: list[Prompt] = []
    seen: set[str] = set()
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                prompt = _parse_line(path, line_no, line)
                if prompt.prompt_id in seen:
                    raise ValueError(f"{path}:{line_no}: duplicate prompt_id {prompt.prompt_id!r}")
                seen.add(prompt.prompt_id)
                prompts.append(prompt)
    if not prompts:
        raise ValueError(f"dataset {path}: no prompts")
    return prompts


def _parse_line(path: Path, line_no: int, line: str) -> Prompt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{line_no}: must be a JSON object")
    for key in ("prompt_id", "prompt"):
        if not isinstance(row.get(key), str):
            raise ValueError(f"{path}:{line_no}: {key} must be a string")
    info = row.get("info", {})
    if not isinstance(info, dict):
        raise ValueError(f"{path}:{line_no}: info must be an object")
    return Prompt(row["prompt_id"], row["prompt"], info)


class PromptSource:
    """Cursor + re-issue queue over a dataset, with deterministic per-attempt seeds."""

    def __init__(self, prompts: list[Prompt], seed: int = 0) -> None:
        if not prompts:
            raise ValueError("dataset: no prompts")
        self.prompts = prompts
        self.seed = seed
        self._by_id = {p.prompt_id: p for p in prompts}
        self._cursor = 0
        self.epoch = 0
        self._reissue: deque[str] = deque()
        self._attempts: dict[str, int] = {}
        self.num_reissued = 0

    def next_prompt(self) -> tuple[Prompt, int]:
        """(prompt, seed) for the next credit: re-issues first, then the cursor."""
        if self._reissue:
            prompt = self._by_id[self._reissue.popleft()]
        else:
            prompt = self.prompts[self._cursor]
            self._cursor += 1
            if self._cursor == len(self.prompts):
                self._cursor = 0
                self.epoch += 1
        attempt = self._attempts.get(prompt.prompt_id, 0)
        self._attempts[prompt.prompt_id] = attempt + 1
        return prompt, credit_seed(self.seed, prompt.prompt_id, attempt)

    def reissue(self, prompt_id: str) -> None:
        """Queue a prompt to be handed out again before the cursor moves on."""
        if prompt_id in self._by_id:  # groups pushed for unknown prompts have nothing to redo
            self._reissue.append(prompt_id)
            self.num_reissued += 1

    @property
    def reissue_pending(self) -> int:
        return len(self._reissue)

    def export(self) -> dict[str, Any]:
        """The cursor, the re-issue queue and the attempt counts (`restore` takes it back)."""
        return {
            "cursor": self._cursor,
            "epoch": self.epoch,
            "reissue": list(self._reissue),
            "attempts": list(self._attempts.items()),
            "reissued": self.num_reissued,
        }

    def restore(self, state: dict[str, Any]) -> None:
        if not 0 <= state["cursor"] < len(self.prompts):
            raise ValueError("replay state: its dataset cursor is beyond this dataset")
        self._cursor, self.epoch = state["cursor"], state["epoch"]
        self._reissue = deque(state["reissue"])
        self._attempts = dict(map(tuple, state["attempts"]))
        self.num_reissued = state["reissued"]

    def fingerprint(self) -> str:
        """A hash of the prompt ids in order: a recovered state belongs to this dataset only."""
        digest = hashlib.blake2b(digest_size=8)
        for prompt in self.prompts:
            digest.update(prompt.prompt_id.encode() + b"\0")
        return digest.hexdigest()


def credit_seed(run_seed: int, prompt_id: str, attempt: int) -> int:
    """A 31-bit seed, a pure function of (run seed, prompt id, attempt number)."""
    digest = hashlib.blake2b(f"{run_seed}\0{prompt_id}\0{attempt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF
