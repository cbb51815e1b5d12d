"""The hub (`asyncrl replay`): the loop that polls, decodes, sends and holds Acks and Batches
back until the durable commit; with `Outbox` (replay/clients.py), replay's only socket code.
Every decision (credits, storing a group, versions, batches, admission) is replay/core.py's.

    actors (DEALER)                       hub (one ROUTER, one thread)                learner
    ---------------                       ----------------------------                -------
    Hello ------------------------------> register, check protocol + config hash <--- Hello
          <------------------------------ Welcome / Error(protocol|config_mismatch) ---->
          <------------------------------ Credits   (admission: AReaL window, capacity,
                                                     reuse limiter, actor concurrency)
    Group ------------------------------> check credit, dedup (actor_id, seq),
          <------------------------------ Ack        store in ReplayBuffer
                                          SampleRequest parked until num_groups are <--- SampleRequest
                                          eligible (staleness <= η), then Batch ------> Batch
                                          Version: adopt, drop stale, re-issue ------> Members
          <------------------------------ WeightsAnnounce (forwarded unchanged) <---- WeightsAnnounce
    WeightsLoaded, Heartbeat, Bye ------> liveness; a dead actor's credits are re-issued

Back-pressure: actors generate only with credits, and credits are issued only while
admission allows (replay/core.py: the learner's version moves the window; an actor's share is
bounded by the window at the weights it holds, from WeightsLoaded), so a slow learner makes actors
wait instead of producing groups that would go stale; the learner waits (its request is
parked) while too few fresh groups exist. Sends never block the loop: a peer whose pipe is full
gets a backlog, flushed as it drains. Groups are forwarded to the learner without copying their
arrays (the received frames themselves go out again).

Bad input (garbage, truncated frames, wrong protocol, wrong types, NaN, oversized, a credit not
held, a message from an unregistered routing id) is answered with `Error(code, field, detail)`
to its sender only, counted by code, logged at most once per sender per minute; everyone else
keeps being served. A group for a credit of an earlier hub process (the hub restarted) is
accepted as completed work; see asyncrl/transport/connection.py for the delivery rule.

State and delivery (`HubState`, replay/core.py): dedup by (actor_id, seq) across connections
and hub processes, batches lent to the learner until `BatchAck`. With
`replay.durability = "durable"` every state change is logged (replay/durability.py); each loop
turn ends with one group commit, and the turn's Acks and Batches leave only after it, so whatever was acknowledged survives a
SIGKILL: a hub restarted on the same `replay.state_dir` recovers it and carries on, and the
credits of clients that do not come back within heartbeat_timeout_s are re-issued.

One turn of the loop (`turn`): receive up to `turn_messages` messages (each handler hands its
message to the core; the burst's Acks go out after it), flush full pipes, expire silent
clients, grant credits (`HubCore.grant`), serve parked requests (`HubCore.serve`), commit.
"""

from __future__ import annotations

import collections
import logging
import math
import secrets
import time
from pathlib import Path
from typing import Any

import zmq

from asyncrl.config import RunConfig
from asyncrl.protocol.codec import decode
from asyncrl.protocol.messages import (
    BatchAck,
    CreditReturn,
    Error,
    Group,
    Heartbeat,
    Hello,
    Members,
    Message,
    ProtocolError,
    SampleRequest,
    Stats,
    StatsRequest,
    Version,
    WeightsAnnounce,
    WeightsLoaded,
)
from asyncrl.transport import auth
from asyncrl.transport.sockets import NOBLOCK, bind_router, recv_routed
from replay import observer
from replay.buffer import ReplayBuffer
from replay.clients import Client, Outbox, Registry
from replay.core import HubCore, HubState, Parked
from replay.durability import Recovery, WriteAheadLog, open_log
from replay.evals import EvalSchedule, held_out_split
from replay.membership import Membership
from replay.prompts import PromptSource, load_dataset

log = logging.getLogger("asyncrl.replay")
ROLE_OF = {Group: "actor", WeightsLoaded: "actor", SampleRequest: "learner", Version: "learner"}
ROLE_OF[WeightsAnnounce] = ROLE_OF[BatchAck] = "learner"
ROLE_OF.update(observer.ROLE_OF)
TURN_MESSAGES_MIN, TURN_MESSAGES_MAX = 16, 2000


def turn_messages(groups_per_step: int, num_clients: int) -> int:
    """How many waiting messages one turn of the hub's loop handles before it grants credits
    and serves parked sample requests: one learner step's worth of groups, and at least one
    message per client (the work between turns grows with the clients).

    Handling a whole burst instead (up to TURN_MESSAGES_MAX) leaves the learner waiting for a
    batch whose groups are already here, and the actors for the credits those groups freed,
    while only the hub works: with 32 KB groups on two CPUs, one of them then idled a sixth of
    the time, and the hub moved 15 % fewer groups per second (bench/transport.py)."""
    return min(TURN_MESSAGES_MAX, max(TURN_MESSAGES_MIN, groups_per_step, num_clients))


class Hub:
    """Replay hub: binds on construction; `serve_forever()` runs the loop until `stop()`."""

    def __init__(
        self,
        cfg: RunConfig,
        dataset_path: str | Path,
        bind: str | None = None,
        *,
        allow_insecure: bool = False,
    ) -> None:
        self.cfg, rc = cfg, cfg.replay
        train, held_out = held_out_split(load_dataset(dataset_path), cfg.eval)
        prompts = PromptSource(train, seed=cfg.run.seed)
        self.core = HubCore(cfg, prompts, incarnation=secrets.randbelow(2**30) + 1)
        self.config_hash = cfg.config_hash()
        self.ctx = zmq.Context(rc.io_threads)
        self.authenticator = (
            auth.start_authenticator(self.ctx, rc.auth_dir) if rc.auth_dir else None
        )
        self.sock, self.endpoint = bind_router(
            self.ctx, bind or rc.bind, rc, allow_insecure=allow_insecure
        )
        self.clients = Registry()
        self.max_message_bytes = rc.max_message_bytes
        self.outbox = Outbox(self.sock, rc.pack_frames_below)  # never blocks: backlogs instead
        self.errors: collections.Counter[str] = collections.Counter()  # refusals by code
        self.durable_lsn = math.inf  # all recorded groups may go out (acks wait for commits)
        self.wal: WriteAheadLog | None = None
        # (lsn, to, msg): an Ack or Batch sent once its records are durable
        self.gated: collections.deque[tuple[int, bytes, Message]] = collections.deque()
        self.recovery = Recovery()
        orphans_at = 0.0
        if rc.durability == "durable":  # recover from rc.state_dir, then log every change
            self.wal, self.recovery = open_log(self.core.state, rc)
            if self.recovery.ops or self.recovery.snapshot_groups:  # holders may come back
                orphans_at = time.monotonic() + rc.heartbeat_timeout_s
        # Hello, Bye, silent clients, orphaned credits
        self.members = Membership(
            cfg, self.core, self.clients, self.outbox, self.config_hash, orphans_at
        )
        self.obs = observer.HubObserver(  # status, alarms, pause, evaluations
            cfg,
            self.core,
            self.clients,
            self.outbox,
            EvalSchedule(cfg, held_out),
            endpoint=self.endpoint,
            errors=self.errors,
            wal=self.wal,
            recovery=self.recovery,
        )
        self.running = True
        self.handlers = {
            Group: self.on_group,
            SampleRequest: self.on_sample_request,
            Version: self.on_version,
            WeightsAnnounce: self.on_weights_announce,
            WeightsLoaded: self.on_weights_loaded,
            Heartbeat: self.on_heartbeat,
            CreditReturn: self.on_credit_return,
            StatsRequest: self.on_stats_request,
            BatchAck: self.on_batch_ack,
        }
        self.handlers.update(self.obs.handlers)  # AlarmRaised, EvalResult
        self.handlers.update(self.members.handlers)  # Bye

    @property
    def state(self) -> HubState:
        return self.core.state

    @property
    def policy_version(self) -> int:
        return self.core.policy_version

    @property
    def buffer(self) -> ReplayBuffer:
        return self.core.state.buffer

    @property
    def counters(self) -> collections.Counter[str]:
        return self.core.state.counters

    @property
    def parked(self) -> collections.deque[Parked]:
        return self.core.parked

    # --- the main loop --------------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Receive, handle, flush, expire, grant, serve: until `stop()`."""
        tick_ms = int(min(self.cfg.replay.heartbeat_interval_s, 1.0) * 500)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        syncer = self.wal.syncer if self.wal is not None else None
        if syncer is not None:  # a finished fsync wakes the loop: its acks may go
            poller.register(syncer.wake_fd, zmq.POLLIN)
        try:
            while self.running:
                poller.poll(tick_ms)  # wait for messages, a finished fsync or the next tick
                self.turn()
        finally:
            self.close()

    def turn(self) -> None:
        """One turn of the loop: handle up to `turn_messages` waiting messages, then everything
        that follows from them (acks, credits, batches, the durable commit)."""
        syncer = self.wal.syncer if self.wal is not None else None
        if syncer is not None:
            syncer.drain()
        steps = self.cfg.learner.groups_per_step
        self.receive_all(turn_messages(steps, len(self.clients.by_identity)))  # then their acks
        self.outbox.flush()  # peers whose pipes were full
        self.members.expire_dead(time.monotonic())
        self.grant_credits()  # refill actors' credit windows, one message each
        self.serve_parked()  # answer the sample requests that can be answered now
        self.commit()  # durable: the turn's records on disk, then its acks and batches
        self.obs.tick(time.monotonic())  # rates, /metrics once a second; evaluations due

    def stop(self) -> None:
        """Ask the loop to finish (safe from signal handlers and other threads)."""
        self.running = False

    def close(self) -> None:
        if self.wal is not None:
            self.wal.close()
        self.sock.close(linger=0)
        if self.authenticator is not None:
            self.authenticator.stop()
        self.ctx.term()

    # --- receiving ------------------------------------------------------------------------------

    def receive_all(self, limit: int = TURN_MESSAGES_MAX) -> None:
        """Handle what is waiting (bounded), then send the burst's acks back to back (one per
        client that takes batched acks): a burst wakes the socket's I/O thread once."""
        sock, handle = self.sock, self.handle
        for _ in range(limit):
            try:
                identity, frames = recv_routed(sock, NOBLOCK)
            except zmq.Again:
                break
            handle(identity, frames)
        for identity, ack in self.clients.acks_due():
            self.send_committed(identity, ack)

    def handle(self, identity: bytes, frames: list[Any]) -> None:
        """Decode one message and run its handler; any refusal becomes an Error reply."""
        try:
            msg = decode(frames, self.max_message_bytes)
            kind = type(msg)
            if kind in observer.OPEN_TYPES:  # StatusRequest, Control: no Hello needed
                return self.obs.on_open(identity, msg)
            if kind is Hello:
                return self.members.on_hello(identity, msg, time.monotonic())
            client = self.clients.get(identity)
            if client is None:
                raise ProtocolError(
                    "client_id", "unknown sender: send Hello first", "not_registered"
                )
            client.last_seen = time.monotonic()
            role = ROLE_OF.get(kind)
            if role is not None and client.role != role:
                raise ProtocolError(
                    "type", f"{msg.TYPE} is for role {role}, not {client.role}", "bad_role"
                )
            handler = self.handlers.get(kind)
            if handler is None:
                raise ProtocolError("type", f"{msg.TYPE} is sent by the hub, not to it")
            handler(client, msg, frames)
        except ProtocolError as exc:
            self.refuse(identity, exc)
        except Exception as exc:  # a hub bug must not take the hub down for everyone
            log.exception("internal error handling a message from %r", identity)
            self.refuse(identity, ProtocolError("message", f"internal error: {exc!r}", "internal"))

    def refuse(self, identity: bytes, exc: ProtocolError) -> None:
        self.errors[exc.code] += 1
        if self.clients.may_log(identity, time.monotonic()):
            log.warning(
                "refused a message from %r: %s %s: %s", identity, exc.code, exc.field, exc.detail
            )
        self.send(identity, Error(code=exc.code, field=exc.field, detail=exc.detail))

    # --- handlers -------------------------------------------------------------------------------

    def on_group(self, client: Client, g: Group, frames: list[Any]) -> None:
        self.core.take_group(client.identity, client.client_id, g, frames)  # refusals raise
        self.clients.owe_ack(client, g.seq, g.credit_id)  # acked at the end of the burst

    def on_sample_request(self, client: Client, msg: SampleRequest, frames: list[Any]) -> None:
        self.core.request(client.identity, msg, time.monotonic())

    def on_version(self, client: Client, msg: Version, frames: list[Any]) -> None:
        self.core.adopt_version(msg.policy_version, rewind=True)
        newest = self.clients.newest_actors()  # an actor restarted under its id: its new session
        ids = sorted(newest)
        self.send(
            client.identity,
            Members(
                policy_version=self.policy_version,
                actor_ids=ids,
                sessions=[newest[i].session for i in ids],
            ),
        )

    def on_weights_announce(self, client: Client, msg: WeightsAnnounce, frames: list[Any]) -> None:
        self.counters["weights_announced"] += 1
        for actor in self.clients.actors():
            self.outbox.send(actor.identity, list(frames))  # forwarded as received

    def on_weights_loaded(self, client: Client, msg: WeightsLoaded, frames: list[Any]) -> None:
        client.loaded_version = max(client.loaded_version, msg.policy_version)
        self.core.weights_loaded(client.identity, client.loaded_version)

    def on_heartbeat(self, client: Client, msg: Heartbeat, frames: list[Any]) -> None:
        if client.role == "learner":  # a restarted hub learns the learner's version from it
            self.core.adopt_version(msg.policy_version)
        elif client.role == "actor":
            client.loaded_version = max(client.loaded_version, msg.policy_version)
            self.core.weights_loaded(client.identity, client.loaded_version)

    def on_credit_return(self, client: Client, msg: CreditReturn, frames: list[Any]) -> None:
        self.core.give_back(client.identity, msg.credit_ids)

    def on_batch_ack(self, client: Client, msg: BatchAck, frames: list[Any]) -> None:
        self.core.trained(msg.request_id)

    def on_stats_request(self, client: Client, msg: StatsRequest, frames: list[Any]) -> None:
        self.send(client.identity, Stats(stats=self.stats()))

    # --- a turn's decisions (replay/core.py), sent ----------------------------------------------

    def grant_credits(self) -> None:
        """Top up the actors' credit windows as far as admission allows (`HubCore.grant`),
        unless an alarm or an operator paused the actors."""
        if self.obs.paused:
            return
        for identity, credits in self.core.grant():
            self.send(identity, credits)

    def serve_parked(self) -> None:
        """Answer parked sample requests in arrival order while enough eligible groups exist."""
        for identity, batch in self.core.serve(time.monotonic(), self.durable_lsn):
            self.send_committed(identity, batch)

    # --- sending --------------------------------------------------------------------------------

    def send(self, identity: bytes, msg: Message) -> None:
        self.outbox.send_message(identity, msg)

    def send_committed(self, identity: bytes, msg: Message) -> None:
        """Send a message that promises state (an Ack, a Batch): in durable mode only after the
        records of this loop turn are written (`commit`)."""
        if self.wal is None:
            self.send(identity, msg)
        else:
            self.gated.append((self.wal.lsn, identity, msg))

    def commit(self) -> None:
        """Group commit (durable mode): write the turn's records and have them fsynced (on the
        syncer thread), release the messages whose records are durable by now; snapshot when
        the log has grown long."""
        if self.wal is None:
            return
        durable = self.wal.commit()
        gated = self.gated
        while gated and gated[0][0] <= durable:
            _, identity, msg = gated.popleft()
            self.send(identity, msg)
        if self.wal.due_for_snapshot():
            self.wal.snapshot(self.core.state)

    def stats(self) -> dict[str, Any]:
        """Counters and gauges, as answered to `StatsRequest` (replay/observer.py)."""
        return self.obs.stats()
