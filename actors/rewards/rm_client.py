"""The reward-model client: asynchronous scoring against `asyncrl reward-server`, and the
`reward_model` reward component built on it.

```
  any thread: submit(prompts, completions) -> Future   (returns at once)
        |  SimpleQueue + inproc wake
        v
  I/O thread (owns the DEALER)
     waiting --(in flight < max_in_flight)--> ScoreRequest ---------> server
     in flight <----------------------------- Scores  -> future.set_result
               <----------------------------- Error(overloaded|timeout) -> retry after backoff
               <----------------------------- Error(bad_request|...)    -> future fails, named
     attempt past timeout_s, or the server restarted (its reply never comes)
               -> retry after min(backoff_s * 2^k, max_backoff_s), `retries` times at most,
                  then RewardModelError(code="timeout")
```

Many requests are in flight from one process, so an actor submits a round's completions and
goes on (verifier scoring, the next generation) while the server scores them; `result()` waits
only for what is not back yet. A reply for an earlier attempt of a request that is being retried
is accepted; a reply for a request already answered is counted (`late_replies`) and ignored.
Retries keep the request id: the server keeps no state between attempts, so a retry scores
again and only the first reply counts. Backoff doubles per retry up to `max_backoff_s`.

The API other code uses (everything else is internal):

    client = RewardModelClient(endpoint, timeout_s=30.0, max_in_flight=64, retries=3,
                               auth_dir="")          # or RewardModelClient.from_config(cfg, id)
    client.score(texts) -> list[float]               # blocking, internally pipelined
    client.score_async(texts) -> Future[list[float]] # returns at once
    client.submit(prompts, completions) -> Future[ScoreResult]  # scores + checkpoint + attempts
    client.server_stats() -> dict                    # the server's counters (batch sizes...)
    client.close()

A text is scored whole (the server reads the score at its last token); `submit` scores
`prompts[i] + completions[i]`. Failures raise `RewardModelError` with `code` (`bad_request`,
`model_error`, `timeout`, `overloaded`, `closed`...), `field` and `detail`: a refused request at
once, a retryable one (`timeout`, `overloaded`, no reply) once its retries are spent.

The `reward_model` component (`RewardModelComponent`, built by `make_reward_model` from
`[reward_model]`) scores a batch of the pipeline's items through one client:

```
  submit(items) / submit_tokens(ids, decode)    requests of <= chunk items, all in flight
        |                                       at once (the client pipelines them)
        v
  Future[list[ComponentResult]]                 one per item, in order, resolved on the
                                                client's I/O thread when the last reply is in
  provenance(): reward_model_dir, reward_model_hash (the checkpoint that scored)
```

Items carry `prompt` and `completion` texts (the pipeline's ScoreItem does), or come as token
ids with the policy tokenizer's `decode`: the reward model tokenizes text with its own
tokenizer. A request that fails after its retries marks its items `failed` with the reason
(value 0.0 alongside, never a silent 0); the pipeline's failure policy decides what follows.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import zmq

from actors.rewards.pipeline import ComponentResult
from asyncrl.config import RewardModelConfig, RunConfig
from asyncrl.protocol.codec import decode, encode
from asyncrl.protocol.messages import (
    SCORE_ERROR_CODES,
    Error,
    ProtocolError,
    ScoreRequest,
    Scores,
    Stats,
    StatsRequest,
)
from asyncrl.transport.sockets import NOBLOCK, connect_dealer, recv_parts, send_parts

RETRYABLE = frozenset({"overloaded", "timeout"})
assert RETRYABLE <= set(SCORE_ERROR_CODES)
MAX_MESSAGE_BYTES = 64 << 20


class RewardModelError(Exception):
    """A request the server refused for good, or one that ran out of retries (`code` says
    which: the server's Error.code, or `timeout` when no reply came in time)."""

    def __init__(self, code: str, field: str, detail: str) -> None:
        super().__init__(f"reward model {code}: {field}: {detail}")
        self.code, self.field, self.detail = code, field, detail


@dataclass(frozen=True)
class ScoreResult:
    """The scores of one request and the checkpoint that made them."""

    scores: np.ndarray  # float32 [n]
    model_dir: str
    model_hash: str
    attempts: int
    latency_s: float


@dataclass(eq=False)
class _Call:
    request: ScoreRequest | StatsRequest
    future: Future
    submitted_s: float
    attempts: int = 0
    deadline_s: float = 0.0  # of the attempt in flight
    retry_at_s: float = 0.0  # when waiting for a retry


@dataclass
class _State:
    waiting: deque[_Call] = field(default_factory=deque)  # not sent yet, or due for a retry
    in_flight: dict[int, _Call] = field(default_factory=dict)
    backoff: list[_Call] = field(default_factory=list)
    stats_calls: deque[_Call] = field(default_factory=deque)


class RewardModelClient:
    """Scores texts with a served reward model; thread-safe `submit`, one I/O thread."""

    def __init__(
        self,
        endpoint: str,
        *,
        client_id: str = "rm-client",
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        max_backoff_s: float = 2.0,
        max_in_flight: int = 64,
        auth_dir: str = "",
    ) -> None:
        if not endpoint:
            raise ValueError("reward_model.endpoint: empty (start `asyncrl reward-server` first)")
        if timeout_s <= 0 or retries < 0 or backoff_s < 0 or max_in_flight < 1:
            raise ValueError(
                "reward_model: timeout_s > 0, retries >= 0, backoff_s >= 0 and "
                "max_in_flight >= 1 are required"
            )
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.max_backoff_s = max(max_backoff_s, backoff_s)
        self.max_in_flight = max_in_flight
        self.ctx = zmq.Context()
        self.dealer = connect_dealer(
            self.ctx,
            endpoint,
            client_id,
            hwm=10000,
            heartbeat_s=1.0,
            max_message_bytes=MAX_MESSAGE_BYTES,
            auth_dir=auth_dir,
        )
        self.wake_addr = f"inproc://rm-client-{id(self)}"
        self.wake_push = self.ctx.socket(zmq.PUSH)
        self.wake_pull = self.ctx.socket(zmq.PULL)
        self.wake_pull.bind(self.wake_addr)
        self.wake_push.connect(self.wake_addr)
        self.wake_lock = threading.Lock()
        self.inbox: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self.ids = itertools.count(1)
        self.state = _State()
        self.closing = threading.Event()
        self.stats = {
            "requests": 0,
            "retries": 0,
            "timeouts": 0,
            "late_replies": 0,
            "failures": 0,
            "samples": 0,
        }
        self.thread = threading.Thread(target=self.io_loop, name="rm-client-io", daemon=True)
        self.thread.start()

    @classmethod
    def from_config(cls, cfg: RewardModelConfig, client_id: str) -> RewardModelClient:
        return cls(
            cfg.endpoint,
            client_id=client_id,
            timeout_s=cfg.timeout_s,
            retries=cfg.retries,
            backoff_s=cfg.backoff_s,
            max_in_flight=cfg.max_in_flight,
            auth_dir=cfg.auth_dir,
        )

    # --- any thread -----------------------------------------------------------------------------

    def submit(self, prompts: Sequence[str], completions: Sequence[str]) -> Future:
        """Start scoring prompts[i] + completions[i]; the future gives a ScoreResult or raises
        RewardModelError."""
        if len(prompts) != len(completions):
            raise ValueError(f"completions: {len(completions)} items for {len(prompts)} prompts")
        request = ScoreRequest(
            request_id=next(self.ids),
            prompts=list(prompts),
            completions=list(completions),
            timeout_s=self.timeout_s,
        )
        return self._enqueue(request)

    def score_async(self, texts: Sequence[str]) -> Future:
        """Start scoring whole texts; the future gives list[float] or raises RewardModelError."""
        future: Future = Future()
        inner = self.submit([""] * len(texts), texts)

        def done(f: Future) -> None:
            error = f.exception()
            _settle(future, None if error else f.result().scores.tolist(), error)

        inner.add_done_callback(done)
        return future

    def score(self, texts: Sequence[str]) -> list[float]:
        """One float per text (score_async(texts).result()): blocking."""
        return self.score_async(texts).result()

    def server_stats(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The server's counters (StatsRequest), without retries."""
        return self._enqueue(StatsRequest()).result(timeout=timeout_s)

    def _enqueue(self, request: ScoreRequest | StatsRequest) -> Future:
        if self.closing.is_set():
            raise RuntimeError("the reward-model client is closed")
        call = _Call(request, Future(), time.monotonic())
        self.inbox.put(call)
        with self.wake_lock:
            self.wake_push.send(b"")
        return call.future

    def close(self) -> None:
        """Stop the I/O thread; requests not answered yet fail."""
        self.closing.set()
        with self.wake_lock:
            self.wake_push.send(b"")
        self.thread.join(timeout=10)
        for sock in (self.dealer, self.wake_push, self.wake_pull):
            sock.close(linger=0)
        self.ctx.term()

    # --- the I/O thread -------------------------------------------------------------------------

    def io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.dealer, zmq.POLLIN)
        poller.register(self.wake_pull, zmq.POLLIN)
        st = self.state
        while not self.closing.is_set():
            events = dict(poller.poll(timeout=self._poll_ms()))
            if self.wake_pull in events:
                while self.wake_pull.poll(0):
                    self.wake_pull.recv()
            while not self.inbox.empty():
                st.waiting.append(self.inbox.get())
            if self.dealer in events:
                self.receive_all()
            self.check_deadlines(time.monotonic())
            self.send_waiting()
        self.fail_all(RewardModelError("closed", "client", "the client was closed"))

    def _poll_ms(self) -> int:
        now, st = time.monotonic(), self.state
        times = [c.deadline_s for c in st.in_flight.values()] + [c.retry_at_s for c in st.backoff]
        times += [c.deadline_s for c in st.stats_calls]
        return max(1, min(50, int(1000 * (min(times, default=now + 1) - now)) + 1))

    def send_waiting(self) -> None:
        st = self.state
        while st.waiting and len(st.in_flight) < self.max_in_flight:
            call = st.waiting.popleft()
            call.attempts += 1
            call.deadline_s = time.monotonic() + self.timeout_s
            if isinstance(call.request, StatsRequest):
                st.stats_calls.append(call)
            else:
                st.in_flight[call.request.request_id] = call
                self.stats["requests"] += call.attempts == 1
                self.stats["samples"] += len(call.request.prompts) * (call.attempts == 1)
            try:
                send_parts(self.dealer, encode(call.request), NOBLOCK)
            except zmq.Again:
                pass  # the pipe is full: the attempt times out and is retried

    def receive_all(self) -> None:
        while True:
            try:
                frames = recv_parts(self.dealer, NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frames, MAX_MESSAGE_BYTES)
            except ProtocolError as exc:  # a broken reply: its request times out and retries
                self.stats["late_replies"] += 1
                print(f"reward-model client: undecodable reply ({exc})", flush=True)
                continue
            self.on_reply(msg)

    def on_reply(self, msg: Any) -> None:
        st = self.state
        if isinstance(msg, Stats):
            if st.stats_calls:
                _settle(st.stats_calls.popleft().future, msg.stats)
            return
        request_id = getattr(msg, "request_id", -1)
        call = st.in_flight.pop(request_id, None)
        if call is None:
            call = next((c for c in st.backoff if c.request.request_id == request_id), None)
            if call is None:
                self.stats["late_replies"] += 1
                return
            st.backoff.remove(call)
        if isinstance(msg, Scores):
            self.resolve(call, msg)
        elif isinstance(msg, Error) and msg.code in RETRYABLE:
            self.retry_or_fail(call, RewardModelError(msg.code, msg.field, msg.detail))
        elif isinstance(msg, Error):
            self.stats["failures"] += 1
            _settle(call.future, error=RewardModelError(msg.code, msg.field, msg.detail))
        else:
            self.retry_or_fail(call, RewardModelError("bad_message", "type", msg.TYPE))

    def resolve(self, call: _Call, msg: Scores) -> None:
        n = len(call.request.prompts)
        if msg.scores.shape != (n,) or not np.all(np.isfinite(msg.scores)):
            self.stats["failures"] += 1
            _settle(
                call.future,
                error=RewardModelError(
                    "bad_message", "scores", f"expected {n} finite scores, got {msg.scores!r}"
                ),
            )
            return
        _settle(
            call.future,
            ScoreResult(
                np.array(msg.scores),
                msg.model_dir,
                msg.model_hash,
                call.attempts,
                time.monotonic() - call.submitted_s,
            ),
        )

    def retry_or_fail(self, call: _Call, why: Exception) -> None:
        if call.attempts > self.retries:
            self.stats["failures"] += 1
            _settle(call.future, error=why)
            return
        self.stats["retries"] += 1
        wait = min(self.backoff_s * 2 ** min(call.attempts - 1, 30), self.max_backoff_s)
        call.retry_at_s = time.monotonic() + wait
        self.state.backoff.append(call)

    def check_deadlines(self, now: float) -> None:
        st = self.state
        for request_id, call in list(st.in_flight.items()):
            if call.deadline_s <= now:
                del st.in_flight[request_id]
                self.stats["timeouts"] += 1
                msg = f"no reply within {self.timeout_s} s (attempt {call.attempts})"
                self.retry_or_fail(call, RewardModelError("timeout", "timeout_s", msg))
        due = [c for c in st.backoff if c.retry_at_s <= now]
        st.backoff = [c for c in st.backoff if c.retry_at_s > now]
        st.waiting.extendleft(reversed(due))  # retries go before new requests
        while st.stats_calls and st.stats_calls[0].deadline_s <= now:
            why = RewardModelError("timeout", "timeout_s", "no Stats reply")
            _settle(st.stats_calls.popleft().future, error=why)

    def fail_all(self, why: Exception) -> None:
        st = self.state
        calls = [*st.waiting, *st.in_flight.values(), *st.backoff, *st.stats_calls]
        while not self.inbox.empty():
            calls.append(self.inbox.get())
        for call in calls:
            _settle(call.future, error=why)


def _settle(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Complete a future unless its caller already cancelled it."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


# --- the `reward_model` reward component --------------------------------------------------------


class ScoredText(Protocol):
    """What the component reads of a pipeline item (the pipeline's ScoreItem has both)."""

    prompt: str
    completion: str


@dataclass(frozen=True)
class _Text:
    prompt: str
    completion: str


class RewardModelComponent:
    """The `reward_model` reward component: the served model's score of each item.

    `submit(items)` starts scoring at once (requests of at most `chunk` items, all in flight
    together) and returns a future of one `ComponentResult` per item; `score(items)` is
    submit(...).result(). A request that fails after its retries marks its items `failed`
    with the reason. `provenance()` names the checkpoint that scored (directory and
    config+weights hash, from the replies).
    """

    name = "reward_model"

    def __init__(self, client: RewardModelClient, chunk: int = 64) -> None:
        assert chunk >= 1
        self.client, self.chunk = client, chunk
        self.checkpoint: dict[str, str] = {}

    @classmethod
    def from_config(cls, cfg: RewardModelConfig, client_id: str) -> RewardModelComponent:
        return cls(RewardModelClient.from_config(cfg, client_id), chunk=cfg.max_batch)

    def submit(self, items: Sequence[ScoredText]) -> Future[list[ComponentResult]]:
        parts: list[tuple[int, Future]] = []
        for lo in range(0, len(items), self.chunk):
            part = items[lo : lo + self.chunk]
            future = self.client.submit([i.prompt for i in part], [i.completion for i in part])
            parts.append((len(part), future))
        combined: Future[list[ComponentResult]] = Future()
        if not parts:
            combined.set_result([])
            return combined
        remaining = [len(parts)]
        lock = threading.Lock()

        def part_done(_: Future) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            self._gather(parts, len(items), combined)

        for _, future in parts:
            future.add_done_callback(part_done)
        return combined

    def _gather(self, parts: list[tuple[int, Future]], num_items: int, combined: Future) -> None:
        """Every part is back: their results, in order, into `combined`."""
        out: list[ComponentResult] = []
        try:
            for count, future in parts:
                try:
                    res: ScoreResult = future.result()
                except RewardModelError as exc:
                    out += [ComponentResult(value=0.0, failed=f"reward_model: {exc}")] * count
                    continue
                self.checkpoint = {
                    "reward_model_dir": res.model_dir,
                    "reward_model_hash": res.model_hash,
                }
                out += [ComponentResult(value=float(s)) for s in res.scores]
            assert len(out) == num_items
        except Exception as exc:  # reported through the future, with its reason
            _settle(combined, error=exc)
            return
        _settle(combined, out)

    def submit_tokens(
        self,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        decode: Callable[[Sequence[int]], str],
    ) -> Future[list[ComponentResult]]:
        """submit() for token ids of a group: `decode` is the policy tokenizer's (the reward
        model tokenizes the text with its own tokenizer)."""
        items = [
            _Text(decode(p), decode(c)) for p, c in zip(prompt_ids, completion_ids, strict=True)
        ]
        return self.submit(items)

    def score(self, items: Sequence[ScoredText]) -> list[ComponentResult]:
        return self.submit(items).result()

    def provenance(self) -> dict[str, str]:
        return dict(self.checkpoint)

    def close(self) -> None:
        self.client.close()


def make_reward_model(cfg: RunConfig) -> RewardModelComponent:
    """The `reward_model` component: a client of `reward_model.endpoint`."""
    if not cfg.reward_model.endpoint:
        raise ValueError(
            "reward_model.endpoint: the reward_model component needs a server "
            "(set it, or reward_model.serve = true under asyncrl run)"
        )
    return RewardModelComponent.from_config(cfg.reward_model, f"rm-{os.getpid()}")
