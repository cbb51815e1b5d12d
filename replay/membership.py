"""Who the hub's clients are (`Membership`): the Hello handshake, and clients leaving (Bye, a
session replaced under the same routing id, silence past `replay.heartbeat_timeout_s`, or, after
a recovery, never coming back): their credits expire and their prompts are re-issued, their
parked sample requests and queued sends are dropped."""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING, Any

from asyncrl.protocol.messages import Bye, Hello, Welcome, check_hello
from replay.clients import Client

if TYPE_CHECKING:
    from replay.server import Hub

log = logging.getLogger("asyncrl.replay")


class Membership:
    """Joining and leaving for one hub; `orphans_at` (monotonic time, 0 = none) is when the
    credits a recovered hub found, held by clients that have not said Hello again, expire."""

    def __init__(self, hub: Hub, orphans_at: float = 0.0) -> None:
        self.hub = hub
        self.orphans_at = orphans_at
        self.handlers = {Bye: self.on_bye}

    def on_hello(self, identity: bytes, msg: Hello) -> None:
        hub = self.hub
        check_hello(msg, hub.config_hash)
        old = hub.clients.get(identity)
        if old is not None:  # a new session under the same routing id ends the old one
            self.drop(old, "replaced")
        hub.clients.add(identity, msg, time.monotonic())
        next_seq = 0
        if msg.role == "actor":
            next_seq = hub.state.actor_hello(identity, msg.client_id, msg.session)
        elif msg.role == "learner":
            returned = hub.state.learner_hello(msg.session, msg.acks_batches)
            if returned:
                log.info("learner session %d: %d lent groups back in replay", msg.session, returned)
        log.info("%s %s joined (concurrency %d)", msg.role, msg.client_id, msg.concurrency)
        rc = hub.cfg.replay
        hub.send(
            identity,
            Welcome(
                client_id=msg.client_id,
                policy_version=hub.policy_version,
                heartbeat_interval_s=rc.heartbeat_interval_s,
                max_staleness=rc.max_staleness,
                next_seq=next_seq,
            ),
        )

    def on_bye(self, client: Client, msg: Bye, frames: list[Any]) -> None:
        self.drop(client, msg.reason or "bye")

    def drop(self, client: Client, why: str) -> None:
        """A client left or died: its credits expire and their prompts are re-issued."""
        hub = self.hub
        expired = hub.state.expire(client.identity)
        hub.clients.remove(client, why)
        hub.parked = collections.deque(p for p in hub.parked if p.identity != client.identity)
        hub.outbox.forget(client.identity)
        log.info(
            "%s %s left (%s); %d credits re-issued", client.role, client.client_id, why, expired
        )

    def expire_dead(self, now: float) -> None:
        """Drop the clients silent for too long, and expire the credits of holders that did not
        come back after a recovery once `orphans_at` has passed."""
        hub = self.hub
        timeout = hub.cfg.replay.heartbeat_timeout_s
        for client in hub.clients.silent(now, timeout):
            self.drop(client, f"silent for more than {timeout} s")
        if self.orphans_at and now >= self.orphans_at:  # recovered credits nobody came back for
            self.orphans_at = 0.0
            for holder in hub.state.credits.holders():
                if hub.clients.get(holder) is None:
                    expired = hub.state.expire(holder)
                    log.info(
                        "%r did not come back after recovery; %d credits re-issued", holder, expired
                    )
