"""The prompt source of the hub: a JSONL dataset, a cursor over epochs, and a re-issue queue.

Dataset: the prompts file, one record ``{"prompt_id": str, "prompt": str, "info": {...}?}`` a
line, read with the schema the actors write it by (asyncrl/prompt_records.py): blank lines are
skipped, errors name the file and line number, prompt ids must be unique.

`next_prompt()` takes from the re-issue queue first (prompts whose group was dropped as stale,
whose credit expired with a dead actor, or that an actor handed back), then from the cursor,
which cycles through the dataset in order, epoch after epoch.

Seeds are deterministic per credit: a function of the run seed, the prompt id and how many
times that prompt has been issued before, so re-running a hub hands out the same seeds for the
same prompt attempts regardless of timing.
"""

from __future__ import annotations

import hashlib
from collections import deque
from pathlib import Path
from typing import Any

from asyncrl.prompt_records import Prompt, parse_record, read_jsonl


def load_dataset(path: str | Path) -> list[Prompt]:
    """The hub's dataset: the prompt records of a prompts file, in order (asyncrl/prompt_records.py
    says what a record holds and which errors name their file and line)."""
    return read_jsonl(path, parse_record, what="dataset", noun="prompts")


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
