"""The reward-model server's queue: dynamic batching with length buckets, a bound, deadlines.

```
  I/O thread                          ScoreQueue (one lock)                  model thread
  ----------                          ---------------------                  ------------
  add(request, token lists) ------->  pending samples (bounded: Overloaded)
                                      batch due when max_batch are pending,  <--- take()
                                      or the oldest waited max_wait_s  ------->  batch
  expire(now) <--- requests past      their pending samples removed              forward pass
                   their deadline                                        complete(batch, scores)
  finished() <---------------------- requests whose every sample is scored <---
```

A batch always holds the oldest pending sample (no request starves) and, of the pending samples
sorted by length, the `max_batch` consecutive ones around it with the smallest length spread:
samples of similar length ride together, so little of a forward pass is spent on padding.
A request that passes its deadline with samples still pending fails as a whole (`expire`);
scores that arrive for a failed request are discarded.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


class Overloaded(Exception):
    """The queue cannot take the request now (its bound is reached): retry later."""


@dataclass(eq=False)
class PendingRequest:
    """One ScoreRequest in the server: where its reply goes and the scores so far."""

    peer: bytes  # ROUTER routing id of the client
    request_id: int
    num_samples: int
    arrival_s: float
    deadline_s: float
    scores: np.ndarray = field(init=False)
    remaining: int = field(init=False)
    queue_s: float = 0.0  # longest wait of one of its samples before its batch ran
    compute_s: float = 0.0  # model time of the batches that carried its samples
    failed: bool = False

    def __post_init__(self) -> None:
        self.scores = np.zeros(self.num_samples, np.float32)
        self.remaining = self.num_samples


@dataclass(eq=False)
class Sample:
    """One text of a request, tokenized."""

    request: PendingRequest
    index: int
    tokens: list[int]


class ScoreQueue:
    """Thread-safe pending samples of every request, handed out in length-bucketed batches."""

    def __init__(self, *, max_batch: int, max_wait_s: float, max_samples: int) -> None:
        assert max_batch >= 1 and max_samples >= max_batch and max_wait_s >= 0
        self.max_batch, self.max_wait_s, self.max_samples = max_batch, max_wait_s, max_samples
        self.pending: list[Sample] = []  # in arrival order
        self.done: deque[PendingRequest] = deque()
        self.lock = threading.Lock()
        self.ready = threading.Condition(self.lock)
        self.closed = False

    def add(self, request: PendingRequest, tokens: Sequence[list[int]]) -> None:
        """Queue every sample of `request`, or raise Overloaded (nothing queued)."""
        assert len(tokens) == request.num_samples
        with self.lock:
            if len(self.pending) + len(tokens) > self.max_samples:
                raise Overloaded(
                    f"the queue holds {len(self.pending)} of {self.max_samples} samples"
                )
            self.pending.extend(Sample(request, i, t) for i, t in enumerate(tokens))
            self.ready.notify()

    def depth(self) -> int:
        with self.lock:
            return len(self.pending)

    def take(self, timeout_s: float) -> list[Sample]:
        """The next due batch, waiting up to timeout_s for one ([] if none came or closed)."""
        end = time.monotonic() + timeout_s
        with self.lock:
            while not self.closed:
                now = time.monotonic()
                wait = self._due_in(now)
                if wait <= 0:
                    return self._form_batch(now)
                if now >= end:
                    return []
                self.ready.wait(min(wait, end - now))
            return []

    def _due_in(self, now: float) -> float:
        if not self.pending:
            return float("inf")
        if len(self.pending) >= self.max_batch:
            return 0.0
        return self.pending[0].request.arrival_s + self.max_wait_s - now

    def _form_batch(self, now: float) -> list[Sample]:
        oldest = self.pending[0]
        if len(self.pending) <= self.max_batch:
            batch, self.pending = self.pending, []
        else:
            batch = bucket_around(self.pending, oldest, self.max_batch)
            chosen = set(map(id, batch))
            self.pending = [s for s in self.pending if id(s) not in chosen]
        for s in batch:
            s.request.queue_s = max(s.request.queue_s, now - s.request.arrival_s)
        return batch

    def complete(self, batch: Sequence[Sample], scores: np.ndarray, compute_s: float) -> None:
        """Scores of a batch (model thread); requests now complete go to `finished()`."""
        with self.lock:
            touched = set()
            for sample, score in zip(batch, scores, strict=True):
                req = sample.request
                req.scores[sample.index] = score
                req.remaining -= 1
                if id(req) not in touched:
                    touched.add(id(req))
                    req.compute_s += compute_s
                if req.remaining == 0 and not req.failed:
                    self.done.append(req)

    def fail(self, batch: Sequence[Sample]) -> list[PendingRequest]:
        """The batch could not be scored: its requests fail, their other samples are dropped."""
        with self.lock:
            failed = {id(s.request): s.request for s in batch if not s.request.failed}
            return self._drop(failed)

    def expire(self, now: float) -> list[PendingRequest]:
        """Requests past their deadline with samples still pending: removed, failed."""
        with self.lock:
            late = {id(s.request): s.request for s in self.pending if s.request.deadline_s < now}
            return self._drop(late)

    def _drop(self, requests: dict[int, PendingRequest]) -> list[PendingRequest]:
        if requests:
            self.pending = [s for s in self.pending if id(s.request) not in requests]
        for req in requests.values():
            req.failed = True
        return list(requests.values())

    def finished(self) -> list[PendingRequest]:
        """Requests whose every sample is scored, since the last call."""
        with self.lock:
            out = list(self.done)
            self.done.clear()
            return out

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.ready.notify_all()


def bucket_around(pending: Sequence[Sample], anchor: Sample, size: int) -> list[Sample]:
    """`size` samples including `anchor`: the run of the length-sorted pending samples that
    contains it with the smallest spread of lengths (least padding)."""
    ordered = sorted(pending, key=lambda s: len(s.tokens))  # stable: arrival order within a length
    at = next(i for i, s in enumerate(ordered) if s is anchor)
    lo_first, lo_last = max(0, at - size + 1), min(at, len(ordered) - size)
    best = min(
        range(lo_first, lo_last + 1),
        key=lambda lo: len(ordered[lo + size - 1].tokens) - len(ordered[lo].tokens),
    )
    return ordered[best : best + size]
