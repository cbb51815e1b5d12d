"""`HubConnection`: an actor's or a learner's connection to the hub, and its `Ledger`.

One I/O thread owns the DEALER socket, because ZeroMQ sockets are not thread-safe:

    caller threads                          I/O thread                         hub
    send(msg) --encode--> outbox --wake-->  send frames (copy=False) -------> ROUTER
    recv()    <---------- inbox  <--------  decode, track credits/acks <----- Credits, Acks, ...
    on(T, fn)                   fn(msg) <-- handlers run here (e.g. WeightsAnnounce)
                                            Heartbeat every heartbeat_interval_s

Back-pressure: a full send pipe (SNDHWM) keeps frames in the I/O thread until the socket can
take them; the hub's credits bound how many groups an actor can have in flight at all.

Delivery of groups (at-least-once, deduplicated by the hub on (actor_id, seq)); what it has to
remember (credits, unacked groups, the latest Version, BatchAck and SampleRequest) is the
connection's `Ledger` (below):
- A `Group` stays in `unacked` until the hub acknowledges its seq (`Ack.seq`, or one of
  `Ack.seqs`: the connection asks for batched acks in its Hello). A client may send a group
  only for a credit it holds; the credit is spent on send.
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
- Each connection object says a random `Hello.session`: the hub keeps an actor id's dedup window
  across connections of one session (a resend after a reconnect is recognised) and starts a new
  window for a new session (a restarted process), whose `Welcome.next_seq` says where the
  actor's numbering goes on (`next_seq()`), so a restarted actor's groups are never mistaken for
  resends.
- A learner that says `acks_batches` sends `BatchAck(request_id)` once it trained a batch: until
  then the hub lends the batch's groups, and a new learner session (the process died) gets them
  back in replay. After a hub restart its last `BatchAck` is sent again with its `Version`.

Trust: the hub checked every group in full (array values, the rules between fields) when the
group arrived, and a `Batch` forwards those very bytes, so messages from the hub are decoded
with `check_values=False`: only types, list lengths and array sizes are checked again.

`Ledger`: what a hub client owes the hub and holds from it, kept across hub restarts. A
`HubConnection` sends and receives; its ledger remembers what delivery needs:

- credits: those the current hub granted and this client has not used (`held`), and those of a
  previous hub incarnation (`retired`), each usable once for a group already being generated;
- groups sent and not yet acknowledged (`unacked`, seq -> group, in send order): re-sent after
  a reconnect or a `capacity` refusal, deduplicated by the hub on (actor_id, seq);
- the latest `Version`, `BatchAck` and unanswered `SampleRequest`: said again to a restarted hub;
- the highest policy version this client has spoken of (its heartbeats carry it).

Thread-safe: the caller's thread records what it sends (`record`), the connection's I/O thread
what the hub answers; one lock guards it all.
"""

from __future__ import annotations

import itertools
import logging
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from asyncrl.protocol.codec import decode, encode
from asyncrl.protocol.messages import (
    DEFAULT_MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Ack,
    Batch,
    BatchAck,
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
)
from asyncrl.transport.sockets import NOBLOCK, connect_dealer, recv_parts, send_parts

log = logging.getLogger("asyncrl.transport")
_wake_ids = itertools.count()
_INTERRUPT: Any = object()  # put into the inbox by interrupt(); recv() returns None for it
POLLIN, POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)


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
        acks_batches: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.hello = Hello(
            role=role,
            client_id=client_id,
            protocol_version=PROTOCOL_VERSION,
            config_hash=config_hash,
            concurrency=concurrency,
            batched_acks=True,
            session=secrets.randbits(62) + 1,
            acks_batches=acks_batches,
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
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()  # and _INTERRUPT
        self._handlers: dict[type, Callable[[Message], None]] = {}
        self._ledger = Ledger()  # credits, unacked groups, what a restarted hub must hear again
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
        dealer = connect_dealer(
            self._ctx,
            self.endpoint,
            self.hello.client_id,
            hwm=self.hwm,
            max_message_bytes=self.max_message_bytes,
            heartbeat_s=self.heartbeat_interval_s,
            auth_dir=self.auth_dir,
        )
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
        self._ledger.record(msg)
        with self._lock:
            self._outbox.append(frames)
            if not self._wake_pending:
                self._wake_pending = True
                self._wake()

    def recv(self, timeout_s: float | None = None) -> Message | None:
        """Next inbound message that no handler claimed (never Ack or Welcome); None on timeout
        or when `interrupt()` woke the wait."""
        try:
            if timeout_s is not None and timeout_s <= 0:
                msg = self._inbox.get_nowait()
            else:
                msg = self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None
        return None if msg is _INTERRUPT else msg

    def interrupt(self) -> None:
        """Wake a `recv()` that is waiting (thread-safe): it returns None at once."""
        self._inbox.put(_INTERRUPT)

    def on(self, msg_type: type, handler: Callable[[Message], None]) -> None:
        """Run `handler(msg)` on the I/O thread for every inbound message of `msg_type`."""
        self._handlers[msg_type] = handler

    def next_seq(self, seq: int) -> int:
        """The seq to number the next new group with, given the caller's own counter: never
        below what the hub (in its latest Welcome) has already taken from this client id."""
        welcome = self.welcome
        return max(seq, welcome.next_seq) if welcome is not None else seq

    def credits_held(self) -> int:
        return self._ledger.credits_held()

    def unacked(self) -> int:
        return self._ledger.unacked()

    def close(self, reason: str = "", timeout_s: float = 5.0) -> None:
        """Flush pending sends (bounded by `timeout_s`), say Bye, stop the I/O thread."""
        if self._thread is not None and self._thread.is_alive():
            self._close_reason = reason
            self._close_deadline = time.monotonic() + timeout_s
            self._stop.set()
            with self._lock:
                self._wake()
            self._thread.join(timeout_s + 2.0)
        if self._ctx is not None:
            if self._thread is not None and not self._thread.is_alive():
                self._wake_tx.close(linger=0)
                self._ctx.term()
            self._ctx = None

    def _wake(self) -> None:
        """Wake the I/O thread; never blocks (the thread may have stopped and closed its end,
        in which case there is nobody to wake: a blocking send would wait forever)."""
        try:
            self._wake_tx.send(b"", NOBLOCK)
        except zmq.Again:
            pass  # a wake-up is already pending, or the I/O thread is gone

    # --- the I/O thread -------------------------------------------------------------------------

    def _run(self, dealer: zmq.Socket, wake_rx: zmq.Socket) -> None:
        self._blocked: deque[list[Any]] = deque()  # frames the socket could not take yet
        self._resend_at = 0.0
        self._resend_after_welcome: list[int] = []
        self._registered = False
        self._lost_at = 0.0
        poller = zmq.Poller()
        poller.register(wake_rx, zmq.POLLIN)
        poller.register(dealer, zmq.POLLIN)
        self._send_frames(dealer, encode(self.hello))
        next_beat = time.monotonic() + self.heartbeat_interval_s
        pollout = False  # whether the poller also waits for room in the dealer's send pipe
        while not self._stop.is_set():
            if pollout != bool(self._blocked):
                pollout = not pollout
                poller.modify(dealer, POLLIN | POLLOUT if pollout else POLLIN)
            wait_ms = max(0, int((next_beat - time.monotonic()) * 1000))
            readable = False
            for sock, event in poller.poll(wait_ms):
                if sock is wake_rx:
                    self._drain_wake(wake_rx)
                elif event & POLLIN:
                    readable = True
            self._flush(dealer)
            if readable:
                self._receive(dealer)
            now = time.monotonic()
            if self._resend_at and now >= self._resend_at:
                self._resend_at = 0.0
                self._resend_unacked(dealer, None)
            if now >= next_beat:
                next_beat = now + self.heartbeat_interval_s
                beat = Heartbeat(
                    client_id=self.hello.client_id, policy_version=self._ledger.policy_version
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
                msg = decode(frames, self.max_message_bytes, check_values=False)
            except ProtocolError as exc:
                log.warning("%s: undecodable message from the hub: %s", self.hello.client_id, exc)
                continue
            self._dispatch(dealer, msg)

    def _dispatch(self, dealer: zmq.Socket, msg: Message) -> None:
        if isinstance(msg, Ack):
            self._ledger.acked(msg)
            return
        if isinstance(msg, Welcome):
            self._on_welcome(dealer, msg)
            return
        if isinstance(msg, Error) and self._on_error(dealer, msg):
            return
        if isinstance(msg, Credits):
            self._ledger.granted(msg)
        elif isinstance(msg, Batch):
            self._ledger.answered(msg)
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
        away = time.monotonic() - self._lost_at
        log.warning(
            "%s: registered again with the hub (%.1f s after it forgot us); re-sending "
            "%d unacknowledged groups",
            self.hello.client_id,
            away,
            len(self._resend_after_welcome),
        )
        self._resend_unacked(dealer, self._resend_after_welcome)
        for m in self._ledger.latest():
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
            self._resend_after_welcome = self._ledger.hub_forgot()
            self._lost_at = time.monotonic()
            log.warning(
                "%s: hub does not know us (restarted?); saying Hello again", self.hello.client_id
            )
            self._send_frames(dealer, encode(self.hello))
        return True

    def _resend_unacked(self, dealer: zmq.Socket, seqs: list[int] | None) -> None:
        for group in self._ledger.groups(seqs):
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


class Ledger:
    """A hub client's delivery state (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[int] = set()
        self._retired: set[int] = set()
        self._unacked: dict[int, Group] = {}
        self._last_version: Version | None = None
        self._last_batch_ack: BatchAck | None = None
        self._pending_request: SampleRequest | None = None
        self.policy_version = 0

    # --- the caller's side --------------------------------------------------------------------

    def record(self, msg: Message) -> None:
        """Note a message about to be sent. A `Group` spends its credit (ValueError if this
        client holds no such credit) and stays unacknowledged until the hub says otherwise."""
        with self._lock:
            if isinstance(msg, Group):
                self._spend(msg.credit_id)
                self._unacked[msg.seq] = msg
            elif isinstance(msg, CreditReturn):
                self._held.difference_update(msg.credit_ids)
                self._retired.difference_update(msg.credit_ids)
            elif isinstance(msg, Version):
                self._last_version = msg
            elif isinstance(msg, BatchAck):
                self._last_batch_ack = msg
            elif isinstance(msg, SampleRequest):
                self._pending_request = msg
            if isinstance(msg, (Version, SampleRequest, WeightsLoaded)):
                self.policy_version = max(self.policy_version, msg.policy_version)

    def _spend(self, credit_id: int) -> None:
        if credit_id in self._held:
            self._held.discard(credit_id)
        elif credit_id in self._retired:
            self._retired.discard(credit_id)
        else:
            raise ValueError(f"credit_id {credit_id}: this client holds no such credit")

    def credits_held(self) -> int:
        with self._lock:
            return len(self._held)

    def unacked(self) -> int:
        with self._lock:
            return len(self._unacked)

    # --- what the hub answers -------------------------------------------------------------------

    def acked(self, ack: Ack) -> None:
        with self._lock:
            unacked = self._unacked
            unacked.pop(ack.seq, None)
            for seq in ack.seqs:
                unacked.pop(seq, None)

    def granted(self, credits: Credits) -> None:
        with self._lock:
            self._held.update(item.credit_id for item in credits.items)

    def answered(self, batch: Batch) -> None:
        """A `Batch` arrived: the sample request it answers is no longer pending."""
        with self._lock:
            if self._pending_request and self._pending_request.request_id == batch.request_id:
                self._pending_request = None

    def hub_forgot(self) -> list[int]:
        """The hub lost this client (it restarted): the credits it granted become retired, and
        the seqs unacknowledged now are returned, to be re-sent once registered again."""
        with self._lock:
            self._retired |= self._held
            self._held.clear()
            return list(self._unacked)

    def groups(self, seqs: list[int] | None) -> list[Group]:
        """The groups of `seqs` still unacknowledged (all of them for None), in send order."""
        with self._lock:
            wanted = self._unacked if seqs is None else seqs
            return [self._unacked[s] for s in wanted if s in self._unacked]

    def latest(self) -> list[Message]:
        """What a restarted hub must hear again: the latest Version, BatchAck and unanswered
        SampleRequest, those that exist, in that order."""
        with self._lock:
            last = (self._last_version, self._last_batch_ack, self._pending_request)
        return [m for m in last if m is not None]
