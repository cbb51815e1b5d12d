"""Evaluation during a run, the hub's side: the held-out prompts and when to ask which actor.

```
  dataset rows ──held_out_split──> training rows (PromptSource)  +  held-out rows (never credited)
  hub loop tick ──EvalSchedule.due(policy_version)──> EvalRequest to the actor holding the newest
                                                     weights (at most one evaluation in flight)
  EvalResult from that actor ──accept()──> forwarded to the learner, which logs it (eval.jsonl)
```

The held-out set is `eval.dataset` when given, else `eval.num_prompts` rows of the training
dataset chosen by a hash of their ids (the same rows every time, whatever the file order);
either way, every training row whose prompt text is also held out leaves the training set, so
evaluation prompts never enter the training stream. Versions to evaluate: 0 (with
`eval.at_start`), then every multiple of `eval.every_versions`; when the learner moves past
several while one evaluation runs, only the newest is asked for. An evaluation whose actor leaves
or stays silent for `eval.timeout_s` goes to another actor.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from asyncrl.config import EvalConfig, RunConfig
from asyncrl.prompt_records import Prompt
from asyncrl.protocol.messages import CreditItem, EvalRequest, EvalResult
from replay.prompts import credit_seed, load_dataset


def held_out_split(rows: Sequence[Prompt], cfg: EvalConfig) -> tuple[list[Prompt], list[Prompt]]:
    """(training rows, held-out rows); with evaluation off, all rows train."""
    if cfg.every_versions == 0:
        return list(rows), []
    if cfg.dataset:
        held = load_dataset(cfg.dataset)[: cfg.num_prompts]
    else:

        def rank(p: Prompt) -> bytes:
            return hashlib.blake2b(f"{cfg.seed}\0{p.prompt_id}".encode(), digest_size=8).digest()

        held = sorted(rows, key=rank)[: cfg.num_prompts]
    texts = {p.prompt for p in held}
    train = [p for p in rows if p.prompt not in texts]
    if not train:
        raise ValueError("eval.num_prompts: the held-out set leaves no training prompts")
    return train, held


def eval_items(held: Iterable[Prompt], seed: int) -> tuple[CreditItem, ...]:
    """The held-out rows as the items of an EvalRequest (fixed seeds: the same samples for the
    same weights)."""
    return tuple(
        CreditItem(
            credit_id=-1,
            prompt_id=p.prompt_id,
            prompt=p.prompt,
            seed=credit_seed(seed, p.prompt_id, 0),
            info=p.info,
        )
        for p in held
    )


@dataclass
class InFlight:
    """The evaluation the hub is waiting for."""

    request: EvalRequest
    actor: bytes
    sent_at: float


class EvalSchedule:
    """Which version to evaluate next, which actor is asked, and what came back."""

    def __init__(self, cfg: RunConfig, held: Sequence[Prompt]) -> None:
        self.cfg = cfg.eval
        self.every = cfg.eval.every_versions if held else 0
        self.items = eval_items(held, cfg.eval.seed)
        self.max_new_tokens = cfg.eval.max_new_tokens or cfg.actor.max_new_tokens
        self.next_version = 0 if cfg.eval.at_start else self.every
        self.in_flight: InFlight | None = None
        self.waiting: EvalRequest | None = None  # due, but no actor to send it to yet
        self.ids = itertools.count(1)
        self.num_requested = self.num_results = self.num_resent = self.num_unexpected = 0
        self.last: dict[str, object] = {}

    def ready(self, policy_version: int, now: float, alive: set[bytes]) -> EvalRequest | None:
        """The request to send now: a new one when a version to evaluate has been reached, or
        the one in flight again when its actor left or timed out; None while one is running."""
        flight = self.in_flight
        if flight is not None:
            if flight.actor in alive and now - flight.sent_at < self.cfg.timeout_s:
                return None
            self.in_flight, self.waiting = None, flight.request
            self.num_resent += 1
        if self.waiting is None and self.every and policy_version >= self.next_version:
            target = policy_version - policy_version % self.every
            self.next_version = target + self.every
            self.num_requested += 1
            self.waiting = EvalRequest(
                eval_id=next(self.ids),
                policy_version=target,
                items=self.items,
                num_samples=self.cfg.num_samples,
                temperature=self.cfg.temperature,
                max_new_tokens=self.max_new_tokens,
                pass_threshold=self.cfg.pass_threshold,
            )
        return self.waiting

    def sent(self, request: EvalRequest, actor: bytes, now: float) -> None:
        self.in_flight, self.waiting = InFlight(request, actor, now), None

    def accept(self, result: EvalResult, summary: dict[str, object]) -> bool:
        """Is this the result in flight? (A late answer to a re-sent request is not.)"""
        flight = self.in_flight
        if flight is None or flight.request.eval_id != result.eval_id:
            self.num_unexpected += 1
            return False
        self.in_flight = None
        self.num_results += 1
        self.last = summary
        return True
