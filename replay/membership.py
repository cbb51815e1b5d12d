"""Who the hub's clients are (`Membership`): the Hello handshake, and clients leaving (Bye, a
session replaced under the same routing id, silence past `replay.heartbeat_timeout_s`, or, after
a recovery, never coming back): their credits expire and their prompts are re-issued, their
parked sample requests and queued sends are dropped. It works on the hub's core
(replay/core.py), its client registry and its outbox (replay/clients.py), nothing else."""

from __future__ import annotations

import logging
from typing import Any

from asyncrl.config import RunConfig
from asyncrl.protocol.messages import Bye, Hello, Welcome, check_hello
from replay.clients import Client, Outbox, Registry
from replay.core import HubCore

log = logging.getLogger("asyncrl.replay")


class Membership:
    """Joining and leaving for one hub; `orphans_at` (monotonic time, 0 = none) is when the
    credits a recovered hub found, held by clients that have not said Hello again, expire."""

    def __init__(
        self,
        cfg: RunConfig,
        core: HubCore,
        clients: Registry,
        outbox: Outbox,
        config_hash: str,
        orphans_at: float = 0.0,
    ) -> None:
        self.cfg = cfg
        self.core = core
        self.clients = clients
        self.outbox = outbox
        self.config_hash = config_hash
        self.orphans_at = orphans_at
        self.handlers = {Bye: self.on_bye}

    def on_hello(self, identity: bytes, msg: Hello, now: float) -> None:
        check_hello(msg, self.config_hash)
        old = self.clients.get(identity)
        if old is not None:  # a new session under the same routing id ends the old one
            self.drop(old, "replaced")
        self.clients.add(identity, msg, now)
        next_seq = 0
        if msg.role == "actor":
            next_seq = self.core.actor_joined(identity, msg.client_id, msg.session, msg.concurrency)
        elif msg.role == "learner":
            returned = self.core.learner_joined(msg.session, msg.acks_batches)
            if returned:
                log.info("learner session %d: %d lent groups back in replay", msg.session, returned)
        log.info("%s %s joined (concurrency %d)", msg.role, msg.client_id, msg.concurrency)
        rc = self.cfg.replay
        self.outbox.send_message(
            identity,
            Welcome(
                client_id=msg.client_id,
                policy_version=self.core.policy_version,
                heartbeat_interval_s=rc.heartbeat_interval_s,
                max_staleness=rc.max_staleness,
                next_seq=next_seq,
            ),
        )

    def on_bye(self, client: Client, msg: Bye, frames: list[Any]) -> None:
        self.drop(client, msg.reason or "bye")

    def drop(self, client: Client, why: str) -> None:
        """A client left or died: its credits expire and their prompts are re-issued."""
        expired = self.core.left(client.identity)
        self.clients.remove(client, why)
        self.outbox.forget(client.identity)
        log.info(
            "%s %s left (%s); %d credits re-issued", client.role, client.client_id, why, expired
        )

    def expire_dead(self, now: float) -> None:
        """Drop the clients silent for too long, and expire the credits of holders that did not
        come back after a recovery once `orphans_at` has passed."""
        timeout = self.cfg.replay.heartbeat_timeout_s
        for client in self.clients.silent(now, timeout):
            self.drop(client, f"silent for more than {timeout} s")
        if self.orphans_at and now >= self.orphans_at:  # recovered credits nobody came back for
            self.orphans_at = 0.0
            for holder in self.core.state.credits.holders():
                if self.clients.get(holder) is None:
                    expired = self.core.left(holder)
                    log.info(
                        "%r did not come back after recovery; %d credits re-issued", holder, expired
                    )
