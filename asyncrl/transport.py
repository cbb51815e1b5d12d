"""Sockets: the hub's ROUTER (`bind_router`) and every client's connection (`HubConnection`).

This is the one module that creates ZeroMQ sockets. Both sides set explicit high-water marks,
`MAXMSGSIZE`, `LINGER` and ZMTP heartbeats; with `auth_dir` both sides use CURVE
(asyncrl/auth.py). Without auth the hub refuses to bind anything but loopback or ipc.

`HubConnection` (actors and learners) has one I/O thread that owns its DEALER socket, because
ZeroMQ sockets are not thread-safe:

    caller threads                          I/O thread                         hub
    send(msg) --encode--> outbox --wake-->  send frames (copy=False) -------> ROUTER
    recv()    <---------- inbox  <--------  decode, track credits/acks <----- Credits, Acks, ...
    on(T, fn)                   fn(msg) <-- handlers run here (e.g. WeightsAnnounce)
                                            Heartbeat every heartbeat_interval_s

Back-pressure: a full send pipe (SNDHWM) keeps frames in the I/O thread until the socket can
take them; the hub's credits bound how many groups an actor can have in flight at all.

Delivery of groups (at-least-once, deduplicated by the hub on (actor_id, seq)):
- A `Group` stays in `unacked` until the hub's `Ack(seq)`. A client may send a group only for
  a credit it holds; the credit is spent on send.
- Hub restart: a new hub answers anything from an unknown routing id with
  `Error(code="not_registered")`. The connection then sends `Hello` again and, on `Welcome`,
  re-sends every group still unacked, then its latest `Version` and its unanswered
  `SampleRequest`. Credits held from the old hub are no longer counted by `credits_held()`, but
  a group already being generated for one may still be sent once: credit ids carry the hub's
  incarnation in their high bits, and a hub accepts a group for a credit of another incarnation
  as completed work (capacity permitting), deduplicated on (actor_id, seq) like any resend.
  So a completed group is never lost; it is counted twice only if the old hub handed it to the
  learner but died before its Ack (sent first) left the machine.
- `Error(code="capacity")` makes the connection re-send its unacked groups one heartbeat later.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from asyncrl import auth
from asyncrl.config import ReplayConfig
from asyncrl.protocol import (
    DEFAULT_MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Ack,
    Batch,
    Bye,
    CreditReturn,
    Credits,
    Error,
    Group,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    SampleRequest,
    Version,
    WeightsLoaded,
    Welcome,
    decode,
    encode,
)

log = logging.getLogger("asyncrl.transport")
LINGER_MS = 1000
_wake_ids = itertools.count()


# plain ints: pyzmq's flag enums cost an enum construction per `|` on the per-message path
NOBLOCK, SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)


def send_parts(sock: zmq.Socket, parts: list[Any], flags: int = 0) -> None:
    """`send_multipart(parts, copy=False)` without its per-call overhead (large parts zero-copy).

    Raises zmq.Again (NOBLOCK, pipe full) only on the first part: ZeroMQ queues the rest of a
    multipart message once its first part is accepted.
    """
    last = len(parts) - 1
    for i, part in enumerate(parts):
        sock.send(part, flags | SNDMORE if i < last else flags, copy=False)


def recv_parts(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """`recv_multipart(copy=False)` reading `Frame.more` instead of a getsockopt per part."""
    frame = sock.recv(flags, copy=False)
    parts = [frame]
    while frame.more:
        frame = sock.recv(0, copy=False)  # the rest of a multipart message is already here
        parts.append(frame)
    return parts


def is_local_endpoint(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback address."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp" or ":" not in rest:
        raise ValueError(f"replay.bind: {endpoint!r} is not tcp://host:port or ipc://path")
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # '*', an interface name or a hostname
        return False


def _set_common(sock: zmq.Socket, hwm: int, max_message_bytes: int, heartbeat_s: float) -> None:
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    ivl_ms = max(1, int(heartbeat_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10 * ivl_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, 10 * ivl_ms)


def bind_router(
    ctx: zmq.Context, endpoint: str, cfg: ReplayConfig, *, allow_insecure: bool = False
) -> tuple[zmq.Socket, str]:
    """Bind the hub's ROUTER; returns it and the actual endpoint (port 0 = OS-chosen).

    With `cfg.auth_dir` the socket is a CURVE server; start `auth.start_authenticator` on `ctx`
    first so the allow-list applies.
    """
    if not cfg.auth_dir and not allow_insecure and not is_local_endpoint(endpoint):
        raise ValueError(
            f"replay.bind / --bind: {endpoint!r} is not a loopback address; set replay.auth_dir "
            "(--auth DIR, keys from `asyncrl keygen`) or pass --allow-insecure"
        )
    sock = ctx.socket(zmq.ROUTER)
    _set_common(sock, cfg.hwm, cfg.max_message_bytes, cfg.heartbeat_interval_s)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or vanished peer raises, never drops
    if cfg.auth_dir:
        auth.make_server(sock, cfg.auth_dir)
    try:
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            address = endpoint[: -len(":0")]
            port = sock.bind_to_random_port(address)
            endpoint = f"{address}:{port}"
        else:
            sock.bind(endpoint)
            if endpoint.startswith("tcp://"):
                endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise ValueError(f"replay.bind / --bind: cannot bind {endpoint!r}: {exc}") from exc
    return sock, endpoint


class HubConnection:
    """A client of the hub (actor or learner): handshake, credits, acks, heartbeats, resends."""

    def __init__(
        self,
        endpoint: str,
        *,
        role: str,
        client_id: str,
        config_hash: str,
        concurrency: int = 0,
        heartbeat_interval_s: float = 1.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        hwm: int = 10000,
        auth_dir: str = "",
    ) -> None:
        self.endpoint = endpoint
        self.hello = Hello(
            role=role,
            client_id=client_id,
            protocol_version=PROTOCOL_VERSION,
            config_hash=config_hash,
            concurrency=concurrency,
        )
        self.heartbeat_interval_s = heartbeat_interval_s
        self.max_message_bytes = max_message_bytes
        self.hwm = hwm
        self.auth_dir = auth_dir
        self.welcome: Welcome | None = None
        self._ctx: zmq.Context | None = None
        self._lock = threading.Lock()
        self._outbox: deque[list[Any]] = deque()
        self._wake_pending = False
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._handlers: dict[type, Callable[[Message], None]] = {}
        self._held: set[int] = set()  # credits granted by the current hub, not yet used
        self._retired: set[int] = set()  # credits of a previous hub incarnation, still usable once
        self._unacked: dict[int, Group] = {}  # seq -> group, in send order
        self._last_version: Version | None = None
        self._pending_request: SampleRequest | None = None
        self._policy_version = 0
        self._welcomed = threading.Event()
        self._start_error: ProtocolError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._close_deadline = 0.0
        self._close_reason = ""

    # --- public API ---------------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> Welcome:
        """Connect, say Hello, wait for Welcome; raises ConnectionError or ProtocolError."""
        assert self._thread is None, "start() called twice"
        self._ctx = zmq.Context()
        dealer = self._ctx.socket(zmq.DEALER)
        _set_common(dealer, self.hwm, self.max_message_bytes, self.heartbeat_interval_s)
        dealer.setsockopt(zmq.ROUTING_ID, self.hello.client_id.encode())
        if self.auth_dir:
            auth.make_client(dealer, self.auth_dir, self.hello.client_id)
        dealer.connect(self.endpoint)
        wake = f"inproc://asyncrl-wake-{next(_wake_ids)}"
        wake_rx = self._ctx.socket(zmq.PAIR)
        wake_rx.bind(wake)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(wake)
        self._thread = threading.Thread(
            target=self._run,
            args=(dealer, wake_rx),
            name=f"hub-io-{self.hello.client_id}",
            daemon=True,
        )
        self._thread.start()
        if not self._welcomed.wait(timeout_s):
            self.close(timeout_s=0.0)
            raise ConnectionError(
                f"no Welcome from the hub at {self.endpoint} within {timeout_s} s"
            )
        if self._start_error is not None:
            self.close(timeout_s=0.0)
            raise self._start_error
        assert self.welcome is not None
        return self.welcome

    def send(self, msg: Message) -> None:
        """Queue a message for the hub (thread-safe). A Group needs a credit this client holds."""
        if self._thread is None or self._stop.is_set():
            raise ConnectionError("HubConnection.send: not started, or closed")
        frames = encode(msg)
        with self._lock:
            if isinstance(msg, Group):
                self._spend_credit(msg.credit_id)
                self._unacked[msg.seq] = msg
            elif isinstance(msg, CreditReturn):
                self._held.difference_update(msg.credit_ids)
                self._retired.difference_update(msg.credit_ids)
            elif isinstance(msg, Version):
                self._last_version = msg
            elif isinstance(msg, SampleRequest):
                self._pending_request = msg
            if isinstance(msg, (Version, SampleRequest, WeightsLoaded)):
                self._policy_version = max(self._policy_version, msg.policy_version)
            self._outbox.append(frames)
            if not self._wake_pending:
                self._wake_pending = True
                self._wake_tx.send(b"")

    def recv(self, timeout_s: float | None = None) -> Message | None:
        """Next inbound message that no handler claimed (never Ack or Welcome); None on timeout."""
        try:
            if timeout_s is not None and timeout_s <= 0:
                return self._inbox.get_nowait()
            return self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def on(self, msg_type: type, handler: Callable[[Message], None]) -> None:
        """Run `handler(msg)` on the I/O thread for every inbound message of `msg_type`."""
        self._handlers[msg_type] = handler

    def credits_held(self) -> int:
        with self._lock:
            return len(self._held)

    def unacked(self) -> int:
        with self._lock:
            return len(self._unacked)

    def close(self, reason: str = "", timeout_s: float = 5.0) -> None:
        """Flush pending sends (bounded by `timeout_s`), say Bye, stop the I/O thread."""
        if self._thread is not None and self._thread.is_alive():
            self._close_reason = reason
            self._close_deadline = time.monotonic() + timeout_s
            self._stop.set()
            with self._lock:
                self._wake_tx.send(b"")
            self._thread.join(timeout_s + 2.0)
        if self._ctx is not None:
            if self._thread is not None and not self._thread.is_alive():
                self._wake_tx.close(linger=0)
                self._ctx.term()
            self._ctx = None

    # --- caller-side bookkeeping ----------------------------------------------------------------

    def _spend_credit(self, credit_id: int) -> None:
        if credit_id in self._held:
            self._held.discard(credit_id)
        elif credit_id in self._retired:
            self._retired.discard(credit_id)
        else:
            raise ValueError(f"credit_id {credit_id}: this client holds no such credit")

    # --- the I/O thread -------------------------------------------------------------------------

    def _run(self, dealer: zmq.Socket, wake_rx: zmq.Socket) -> None:
        self._blocked: deque[list[Any]] = deque()  # frames the socket could not take yet
        self._resend_at = 0.0
        self._resend_after_welcome: list[int] = []
        self._registered = False
        poller = zmq.Poller()
        poller.register(wake_rx, zmq.POLLIN)
        poller.register(dealer, zmq.POLLIN)
        self._send_frames(dealer, encode(self.hello))
        next_beat = time.monotonic() + self.heartbeat_interval_s
        while not self._stop.is_set():
            flags = zmq.POLLIN | (zmq.POLLOUT if self._blocked else 0)
            poller.modify(dealer, flags)
            wait_ms = max(0, int((next_beat - time.monotonic()) * 1000))
            events = dict(poller.poll(wait_ms))
            if wake_rx in events:
                self._drain_wake(wake_rx)
            self._flush(dealer)
            if events.get(dealer, 0) & zmq.POLLIN:
                self._receive(dealer)
            now = time.monotonic()
            if self._resend_at and now >= self._resend_at:
                self._resend_at = 0.0
                self._resend_unacked(dealer, None)
            if now >= next_beat:
                next_beat = now + self.heartbeat_interval_s
                beat = Heartbeat(
                    client_id=self.hello.client_id, policy_version=self._policy_version
                )
                self._send_frames(dealer, encode(beat))
        self._shutdown(dealer, wake_rx)

    def _drain_wake(self, wake_rx: zmq.Socket) -> None:
        while True:
            try:
                wake_rx.recv(NOBLOCK)
            except zmq.Again:
                break
        with self._lock:
            self._wake_pending = False
            self._blocked.extend(self._outbox)
            self._outbox.clear()

    def _flush(self, dealer: zmq.Socket) -> None:
        while self._blocked:
            try:
                send_parts(dealer, self._blocked[0], NOBLOCK)
            except zmq.Again:
                return
            self._blocked.popleft()

    def _send_frames(self, dealer: zmq.Socket, frames: list[Any]) -> None:
        self._blocked.append(frames)
        self._flush(dealer)

    def _receive(self, dealer: zmq.Socket) -> None:
        for _ in range(1000):  # bounded, so sends and heartbeats are not starved
            try:
                frames = recv_parts(dealer, NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frames, self.max_message_bytes)
            except ProtocolError as exc:
                log.warning("%s: undecodable message from the hub: %s", self.hello.client_id, exc)
                continue
            self._dispatch(dealer, msg)

    def _dispatch(self, dealer: zmq.Socket, msg: Message) -> None:
        if isinstance(msg, Ack):
            with self._lock:
                self._unacked.pop(msg.seq, None)
            return
        if isinstance(msg, Welcome):
            self._on_welcome(dealer, msg)
            return
        if isinstance(msg, Error) and self._on_error(dealer, msg):
            return
        if isinstance(msg, Credits):
            with self._lock:
                self._held.update(item.credit_id for item in msg.items)
        elif isinstance(msg, Batch):
            with self._lock:
                if self._pending_request and self._pending_request.request_id == msg.request_id:
                    self._pending_request = None
        handler = self._handlers.get(type(msg))
        if handler is None:
            self._inbox.put(msg)
            return
        try:
            handler(msg)
        except Exception:  # a handler bug must not kill the connection
            log.exception("%s: handler for %s failed", self.hello.client_id, type(msg).__name__)

    def _on_welcome(self, dealer: zmq.Socket, msg: Welcome) -> None:
        first = self.welcome is None
        self.welcome = msg
        self._registered = True
        if first:
            self._welcomed.set()
            return
        log.info("%s: registered again with the hub", self.hello.client_id)
        self._resend_unacked(dealer, self._resend_after_welcome)
        with self._lock:
            extra = [m for m in (self._last_version, self._pending_request) if m is not None]
        for m in extra:
            self._send_frames(dealer, encode(m))

    def _on_error(self, dealer: zmq.Socket, msg: Error) -> bool:
        """Handle connection-level errors here; True when the caller need not see it."""
        if self.welcome is None and msg.code != "not_registered":
            self._start_error = ProtocolError(msg.field, msg.detail, msg.code)
            self._welcomed.set()
            return True
        if msg.code == "capacity":
            self._resend_at = time.monotonic() + self.heartbeat_interval_s
            return False
        if msg.code != "not_registered":
            return False
        if self._registered:  # the hub forgot us (restarted): register again once
            self._registered = False
            with self._lock:
                self._retired |= self._held
                self._held.clear()
                self._resend_after_welcome = list(self._unacked)
            log.info(
                "%s: hub does not know us (restarted?); saying Hello again", self.hello.client_id
            )
            self._send_frames(dealer, encode(self.hello))
        return True

    def _resend_unacked(self, dealer: zmq.Socket, seqs: list[int] | None) -> None:
        with self._lock:
            wanted = self._unacked if seqs is None else seqs
            groups = [self._unacked[s] for s in wanted if s in self._unacked]
        for group in groups:
            self._send_frames(dealer, encode(group))

    def _shutdown(self, dealer: zmq.Socket, wake_rx: zmq.Socket) -> None:
        self._drain_wake(wake_rx)
        if self.welcome is not None:
            self._blocked.append(
                encode(Bye(client_id=self.hello.client_id, reason=self._close_reason))
            )
        while self._blocked and time.monotonic() < self._close_deadline:
            self._flush(dealer)
            if self._blocked:
                dealer.poll(10, zmq.POLLOUT)
        linger_ms = max(0, int((self._close_deadline - time.monotonic()) * 1000))
        dealer.close(linger=linger_ms)
        wake_rx.close(linger=0)
