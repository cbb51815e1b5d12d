"""`asyncrl reward-server --model DIR [--bind EP] [--auth DIR]`: a reward model served over
asyncrl's own transport (ZeroMQ ROUTER, msgpack header + raw array frames, optional CURVE).

```
  clients (DEALER)               I/O thread (owns the ROUTER)             model thread
  ----------------               ----------------------------             ------------
  ScoreRequest -----------------> decode, check, tokenize
        <------------------------ Error(bad_message | bad_request, field)
        <------------------------ Error(overloaded)  <- queue bound reached
                                  ScoreQueue.add ---------------------->  take(): batch due at
                                                                          max_batch samples or
                                                                          max_wait_ms, bucketed
                                                                          by length
                                  expire(): past deadline                 forward pass
        <------------------------ Error(timeout)                          complete() / fail()
        <------------------------ Scores (float32 frame)  <-- wake ------ (inproc PUSH)
  StatsRequest -----------------> Stats (counters)
```

Back-pressure: the queue holds at most reward_model.max_queue_samples samples; a request that
does not fit is answered at once with `Error(code="overloaded")` (the client retries after a
backoff) instead of waiting unboundedly, and the ROUTER's high-water mark bounds what waits
in ZeroMQ. Every bad request gets an `Error` carrying its `request_id` and naming the field;
the server keeps serving everyone else. Replies go out without blocking: one to a peer whose
pipe is full or that vanished is counted (`replies_dropped`) and logged; its client times out
and retries. SIGTERM ends the loop; `--stats-file` receives the counters at exit.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from actors.rewards.rm_model import RewardModel
from actors.rewards.score_queue import Overloaded, PendingRequest, Sample, ScoreQueue
from asyncrl.config import ReplayConfig, RewardModelConfig, load_config
from asyncrl.files import replace_text
from asyncrl.protocol.codec import decode, encode
from asyncrl.protocol.messages import (
    Error,
    Message,
    ProtocolError,
    ScoreRequest,
    Scores,
    Stats,
    StatsRequest,
)
from asyncrl.transport import auth
from asyncrl.transport.sockets import (
    NOBLOCK,
    bind_router,
    is_local_endpoint,
    recv_parts,
    send_parts,
)

log = logging.getLogger("asyncrl.reward_server")
MAX_MESSAGE_BYTES = 64 << 20
HWM = 10000
BURST = 256  # messages read per wake-up before replies and deadlines get their turn


class RewardServer:
    """One served reward model: a ROUTER, a bounded batching queue, a model thread."""

    def __init__(
        self, cfg: RewardModelConfig, model: RewardModel, *, allow_insecure: bool = False
    ) -> None:
        self.cfg, self.model = cfg, model
        self.ctx = zmq.Context()
        self.authenticator = (
            auth.start_authenticator(self.ctx, cfg.auth_dir) if cfg.auth_dir else None
        )
        self.router, self.endpoint = bind_score_router(self.ctx, cfg, allow_insecure)
        self.wake_pull = self.ctx.socket(zmq.PULL)
        self.wake_pull.bind(f"inproc://rm-wake-{id(self)}")
        self.queue = ScoreQueue(
            max_batch=cfg.max_batch,
            max_wait_s=cfg.max_wait_ms / 1000,
            max_samples=cfg.max_queue_samples,
        )
        self.failures: deque[tuple[PendingRequest, str, str]] = deque()  # from the model thread
        self.stopping = threading.Event()
        self.started_s = time.monotonic()
        self.stats: dict[str, Any] = {
            "requests": 0,
            "samples_received": 0,
            "samples_scored": 0,
            "batches": 0,
            "real_tokens": 0,
            "padded_tokens": 0,
            "largest_batch": 0,
            "compute_s": 0.0,
            "replies_dropped": 0,
            "errors": {},
            "batch_sizes": {},
        }
        self.log_times: dict[bytes, float] = {}
        self.model_thread = threading.Thread(target=self.model_loop, name="rm-model", daemon=True)

    # --- the I/O loop ---------------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Until stop(): requests in, replies out (see the module docstring's picture)."""
        self.model_thread.start()
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.wake_pull, zmq.POLLIN)
        try:
            while not self.stopping.is_set():
                events = dict(poller.poll(timeout=20))
                if self.router in events:
                    self.receive_burst()
                if self.wake_pull in events:
                    while self.wake_pull.poll(0):
                        self.wake_pull.recv()
                self.reply_finished()
                self.expire_late()
        finally:
            self.queue.close()
            self.model_thread.join(timeout=30)
            self.close()

    def stop(self) -> None:
        """Ask the loop to finish (safe from signal handlers and other threads)."""
        self.stopping.set()

    def close(self) -> None:
        for sock in (self.router, self.wake_pull):
            sock.close(linger=0)
        if self.authenticator is not None:
            self.authenticator.stop()
        self.ctx.term()

    def receive_burst(self) -> None:
        for _ in range(BURST):
            try:
                peer, *frames = recv_parts(self.router, NOBLOCK)
            except zmq.Again:
                return
            self.handle(peer.bytes, frames)

    def handle(self, peer: bytes, frames: Sequence[Any]) -> None:
        """One message from a client: answered now (Error, Stats) or queued (ScoreRequest)."""
        try:
            msg = decode(frames, MAX_MESSAGE_BYTES)
        except ProtocolError as exc:
            self.refuse(peer, peek_request_id(frames), exc.code, exc.field, exc.detail)
            return
        if isinstance(msg, ScoreRequest):
            self.admit(peer, msg)
        elif isinstance(msg, StatsRequest):
            self.send(peer, Stats(stats=self.snapshot()))
        else:
            self.refuse(
                peer,
                -1,
                "bad_request",
                "type",
                f"this server answers ScoreRequest and StatsRequest, not {msg.TYPE}",
            )

    def admit(self, peer: bytes, msg: ScoreRequest) -> None:
        problem = check_request(msg, self.cfg)
        if problem:
            self.refuse(peer, msg.request_id, "bad_request", *problem)
            return
        tokens = self.model.tokenize(msg.prompts, msg.completions)
        empty = next((i for i, t in enumerate(tokens) if not t), -1)
        if empty >= 0:
            self.refuse(
                peer,
                msg.request_id,
                "bad_request",
                f"prompts[{empty}]",
                "prompt and completion tokenize to nothing",
            )
            return
        now = time.monotonic()
        timeout_s = msg.timeout_s or self.cfg.timeout_s
        request = PendingRequest(peer, msg.request_id, len(tokens), now, now + timeout_s)
        try:
            self.queue.add(request, tokens)
        except Overloaded as exc:
            self.refuse(peer, msg.request_id, "overloaded", "prompts", f"{exc}; retry later")
            return
        self.stats["requests"] += 1
        self.stats["samples_received"] += len(tokens)

    def reply_finished(self) -> None:
        for req in self.queue.finished():
            bad = np.flatnonzero(~np.isfinite(req.scores))
            if bad.size:
                self.refuse(
                    req.peer,
                    req.request_id,
                    "model_error",
                    f"scores[{bad[0]}]",
                    "the model gave a non-finite score",
                )
                continue
            self.send(
                req.peer,
                Scores(
                    request_id=req.request_id,
                    scores=req.scores,
                    model_dir=self.model.model_dir,
                    model_hash=self.model.model_hash,
                    queue_s=req.queue_s,
                    compute_s=req.compute_s,
                ),
            )
        while self.failures:
            req, field, detail = self.failures.popleft()
            self.refuse(req.peer, req.request_id, "model_error", field, detail)

    def expire_late(self) -> None:
        for req in self.queue.expire(time.monotonic()):
            waited = time.monotonic() - req.arrival_s
            self.refuse(
                req.peer,
                req.request_id,
                "timeout",
                "timeout_s",
                f"not scored within {req.deadline_s - req.arrival_s:.3f} s "
                f"(waited {waited:.3f} s in a queue of {self.queue.depth()})",
            )

    def refuse(self, peer: bytes, request_id: int, code: str, field: str, detail: str) -> None:
        errors = self.stats["errors"]
        errors[code] = errors.get(code, 0) + 1
        now = time.monotonic()
        if now - self.log_times.get(peer, -60.0) >= 60.0:  # at most once a minute per client
            self.log_times[peer] = now
            log.warning("refused a request of %r: %s %s: %s", peer, code, field, detail)
        self.send(peer, Error(code=code, field=field, detail=detail, request_id=request_id))

    def send(self, peer: bytes, msg: Message) -> None:
        try:
            send_parts(self.router, [peer, *encode(msg)], NOBLOCK)
        except zmq.ZMQError as exc:  # pipe full (EAGAIN) or peer gone (EHOSTUNREACH)
            self.stats["replies_dropped"] += 1
            log.warning("could not reply %s to %r (%s); its client will retry", msg.TYPE, peer, exc)

    def snapshot(self) -> dict[str, Any]:
        """The counters, plus gauges and the checkpoint served."""
        return {
            **self.stats,
            "errors": dict(self.stats["errors"]),
            "batch_sizes": dict(self.stats["batch_sizes"]),
            "queue_depth": self.queue.depth(),
            "model_dir": self.model.model_dir,
            "model_hash": self.model.model_hash,
            "uptime_s": time.monotonic() - self.started_s,
        }

    # --- the model thread -----------------------------------------------------------------------

    def model_loop(self) -> None:
        """Batches out of the queue, through the model; wakes the I/O thread after each."""
        wake = self.ctx.socket(zmq.PUSH)
        wake.connect(f"inproc://rm-wake-{id(self)}")
        try:
            while not self.stopping.is_set():
                batch = self.queue.take(timeout_s=0.1)
                if batch:
                    self.run_batch(batch)
                    wake.send(b"")
        finally:
            wake.close(linger=0)

    def run_batch(self, batch: list[Sample]) -> None:
        start = time.perf_counter()
        try:
            scores = self.model.score_tokens([s.tokens for s in batch])
        except Exception as exc:  # the model's failure fails these requests, not the server
            log.exception("scoring a batch of %d failed", len(batch))
            for req in self.queue.fail(batch):
                self.failures.append((req, "model", f"{type(exc).__name__}: {exc}"))
            return
        compute_s = time.perf_counter() - start
        self.queue.complete(batch, scores, compute_s)
        lengths = [len(s.tokens) for s in batch]
        st = self.stats
        st["batches"] += 1
        st["samples_scored"] += len(batch)
        st["real_tokens"] += sum(lengths)
        st["padded_tokens"] += max(lengths) * len(batch)
        st["largest_batch"] = max(st["largest_batch"], len(batch))
        sizes = st["batch_sizes"]  # "size" -> batches of that many samples
        sizes[str(len(batch))] = sizes.get(str(len(batch)), 0) + 1
        st["compute_s"] += compute_s


def check_request(msg: ScoreRequest, cfg: RewardModelConfig) -> tuple[str, str] | None:
    """(field, detail) of what is wrong with a request, or None."""
    if not msg.prompts:
        return "prompts", "must not be empty"
    if len(msg.completions) != len(msg.prompts):
        return "completions", f"has {len(msg.completions)} items, prompts has {len(msg.prompts)}"
    if len(msg.prompts) > cfg.max_queue_samples:
        return "prompts", (
            f"{len(msg.prompts)} samples can never fit the queue "
            f"(reward_model.max_queue_samples={cfg.max_queue_samples})"
        )
    if msg.timeout_s < 0:
        return "timeout_s", f"must be >= 0, got {msg.timeout_s}"
    return None


def peek_request_id(frames: Sequence[Any]) -> int:
    """The request_id of an undecodable message when its header still shows one, else -1."""
    try:
        header = msgpack.unpackb(memoryview(frames[0]), raw=False)
    except Exception:  # any garbage: msgpack raises several unrelated types
        return -1
    rid = header.get("request_id") if isinstance(header, dict) else None
    return rid if type(rid) is int and -(2**63) <= rid < 2**63 else -1


def bind_score_router(
    ctx: zmq.Context, cfg: RewardModelConfig, allow_insecure: bool
) -> tuple[zmq.Socket, str]:
    """The server's ROUTER on cfg.bind (CURVE with cfg.auth_dir); refuses an open non-loopback
    bind without auth unless allow_insecure."""
    try:
        local = is_local_endpoint(cfg.bind)
    except ValueError:
        raise ValueError(
            f"reward_model.bind / --bind: {cfg.bind!r} is not tcp://host:port or ipc://path"
        ) from None
    if not (local or cfg.auth_dir or allow_insecure):
        raise ValueError(
            f"reward_model.bind / --bind: {cfg.bind!r} is not a loopback address; set "
            "reward_model.auth_dir (--auth DIR) or pass --allow-insecure"
        )
    sockets = ReplayConfig(hwm=HWM, max_message_bytes=MAX_MESSAGE_BYTES, auth_dir=cfg.auth_dir)
    try:
        return bind_router(ctx, cfg.bind, sockets, allow_insecure=True)
    except ValueError as exc:
        raise ValueError(str(exc).replace("replay.bind", "reward_model.bind")) from None


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl reward-server", description="Serve a reward model.")
    p.add_argument(
        "--model", default=None, help="HF sequence-classification dir (reward_model.model)"
    )
    p.add_argument(
        "--bind", default=None, help="endpoint, e.g. tcp://127.0.0.1:0 (reward_model.bind)"
    )
    p.add_argument(
        "--auth", default=None, metavar="DIR", help="CURVE key dir (reward_model.auth_dir)"
    )
    p.add_argument("--device", default=None, help="auto, cpu or cuda (reward_model.device)")
    p.add_argument(
        "--dtype", default=None, help="float32, bfloat16 or float16 (reward_model.dtype)"
    )
    p.add_argument("--config", default=None, help="run config TOML ([reward_model] section)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    p.add_argument("--endpoint-file", default=None, help="write the bound endpoint here")
    p.add_argument("--stats-file", default=None, help="write the counters here at exit (JSON)")
    p.add_argument("--allow-insecure", action="store_true", help="non-loopback bind without auth")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(list(argv))


def _overrides(args: argparse.Namespace) -> list[str]:
    flags = {
        "model": args.model,
        "bind": args.bind,
        "auth_dir": args.auth,
        "device": args.device,
        "dtype": args.dtype,
    }
    return list(args.set) + [f"reward_model.{k}={json.dumps(v)}" for k, v in flags.items() if v]


def main(argv: Sequence[str]) -> int:
    """`asyncrl reward-server`: load the model, bind, serve until SIGTERM."""
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:  # a bad flag, key or model directory: its message, no traceback
        cfg = load_config(args.config, _overrides(args)).reward_model
        if not cfg.model:
            raise ValueError("give --model DIR or set reward_model.model")
        model = RewardModel(
            cfg.model, device=cfg.device, dtype=cfg.dtype, max_length_tokens=cfg.max_length_tokens
        )
        server = RewardServer(cfg, model, allow_insecure=args.allow_insecure)
    except ValueError as exc:
        print(f"asyncrl reward-server: {exc}", file=sys.stderr)
        return 2
    if args.endpoint_file:
        replace_text(Path(args.endpoint_file), server.endpoint + "\n")
    print(
        f"asyncrl reward-server: serving {model.model_dir} ({model.model_hash}) on "
        f"{server.endpoint}, device {model.device}",
        flush=True,
    )
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    server.serve_forever()
    if args.stats_file:
        replace_text(Path(args.stats_file), json.dumps(server.snapshot(), indent=1))
    return 0
