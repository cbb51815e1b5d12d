"""The hub's observability: live status, alarms, pause/resume, and evaluations during the run.

```
  asyncrl status ──StatusRequest──> hub ──Status(summary())──> asyncrl status (table)
  asyncrl status --pause/--resume ──Control──> hub: paused = no credits granted (actors idle)
  learner ──AlarmRaised──> hub: kept for status; action "pause" pauses the actors
  hub loop tick ──> rate window (1 s samples, 30 s) ; EvalSchedule ──EvalRequest──> an actor
  actor ──EvalResult──> hub ──forwarded unchanged──> learner (eval.jsonl, TensorBoard)
```

`StatusRequest` and `Control` need no Hello (an operator's one-off query): the socket already
admits only loopback peers, or with CURVE only allow-listed keys. Everything here runs on the
hub's one thread, called from replay/server.py's loop and handlers; it reads the hub's core
(replay/core.py) and client registry, and sends through its outbox (replay/clients.py).
"""

from __future__ import annotations

import collections
import time
from typing import Any

from asyncrl.config import RunConfig
from asyncrl.evaluation import summarize
from asyncrl.metrics import LiveMetrics
from asyncrl.protocol.messages import (
    AlarmRaised,
    Control,
    EvalResult,
    ProtocolError,
    Status,
    StatusRequest,
)
from replay.clients import Client, Outbox, Registry
from replay.core import HubCore
from replay.durability import Recovery, WriteAheadLog
from replay.evals import EvalSchedule

ROLE_OF = {EvalResult: "actor", AlarmRaised: "learner"}
"""Which role may send each message handled here (the hub refuses the others)."""
OPEN_TYPES = (StatusRequest, Control)
"""Messages answered without a Hello."""
RATE_WINDOW_S = 30.0
MAX_ALARMS = 50


class HubObserver:
    """Status summaries, alarms, pause state and the evaluation schedule of one hub."""

    def __init__(
        self,
        cfg: RunConfig,
        core: HubCore,
        clients: Registry,
        outbox: Outbox,
        evals: EvalSchedule,
        *,
        endpoint: str,
        errors: collections.Counter[str],
        wal: WriteAheadLog | None,
        recovery: Recovery,
    ) -> None:
        self.cfg = cfg
        self.core = core
        self.clients = clients
        self.outbox = outbox
        self.evals = evals
        self.endpoint = endpoint
        self.errors = errors  # the hub's refusals, by code
        self.wal = wal
        self.recovery = recovery
        self.live: LiveMetrics | None = None  # the /metrics endpoint, when [metrics] turns it on
        self.started = time.monotonic()
        self.paused = ""  # why the actors are paused ("" = not paused)
        self.alarms: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_ALARMS)
        self.num_alarms = 0
        self.samples: collections.deque[tuple[float, int, int, int]] = collections.deque()
        self.handlers = {AlarmRaised: self.on_alarm, EvalResult: self.on_eval_result}

    # --- messages -------------------------------------------------------------------------------

    def on_open(self, identity: bytes, msg: StatusRequest | Control) -> None:
        """A StatusRequest or Control from anyone: apply it, answer with the status."""
        if isinstance(msg, Control):
            if msg.action not in ("pause", "resume"):
                raise ProtocolError("action", f"must be pause or resume, got {msg.action!r}")
            self.pause(msg.reason or "operator") if msg.action == "pause" else self.resume()
        self.outbox.send_message(identity, Status(status=self.summary()))

    def on_alarm(self, client: Client, msg: AlarmRaised, frames: list[Any]) -> None:
        if msg.action not in ("warn", "pause", "stop"):
            raise ProtocolError("action", f"must be warn, pause or stop, got {msg.action!r}")
        self.num_alarms += 1
        self.alarms.append(
            {
                "name": msg.name,
                "step": msg.step,
                "policy_version": msg.policy_version,
                "message": msg.message,
                "action": msg.action,
                "time": time.time(),
            }
        )
        if msg.action == "pause":
            self.pause(f"alarm {msg.name} at step {msg.step}")

    def on_eval_result(self, client: Client, msg: EvalResult, frames: list[Any]) -> None:
        if msg.actor_id != client.client_id:
            raise ProtocolError("actor_id", f"{msg.actor_id!r} is not the sender")
        n, prompts = msg.num_samples, len(msg.prompt_ids)
        for name in ("rewards", "lengths", "finish_reasons", "reward_failed"):
            if n < 1 or len(getattr(msg, name)) != n * prompts:
                raise ProtocolError(name, f"must hold num_samples x prompts = {n * prompts} values")
        if not self.evals.accept(msg, summarize(msg)):
            return  # a late answer to a request already sent elsewhere: logged once, by the other
        for learner in self.clients.by_identity.values():
            if learner.role == "learner":
                self.outbox.send(learner.identity, list(frames))  # forwarded as received

    # --- state ----------------------------------------------------------------------------------

    def pause(self, why: str) -> None:
        """No more credits until resumed (credits already granted are still used)."""
        if not self.paused:
            print(f"asyncrl replay: actors paused: {why}", flush=True)
        self.paused = why

    def resume(self) -> None:
        if self.paused:
            print(f"asyncrl replay: actors resumed (were paused: {self.paused})", flush=True)
        self.paused = ""

    def tick(self, now: float) -> None:
        """Once per loop turn: sample the rates and publish /metrics (once a second), and hand
        out evaluations."""
        if not self.samples or now - self.samples[-1][0] >= 1.0:
            self.publish_metrics()
            c = self.core.state.counters
            self.samples.append(
                (now, c["groups_received"], c["groups_consumed"], self.core.policy_version)
            )
            while now - self.samples[0][0] > RATE_WINDOW_S:
                self.samples.popleft()
        self.schedule_eval(now)

    def publish_metrics(self) -> None:
        """Hand the live metrics endpoint (when on) a snapshot of the counters."""
        live = self.live
        if live is None:
            return
        snapshot = self.stats()
        clients = snapshot.pop("clients")
        snapshot["clients_alive"] = sum(1 for c in clients.values() if c.get("alive"))
        live.publish(snapshot)

    def schedule_eval(self, now: float) -> None:
        """Send the evaluation due (if any) to the actor holding the newest weights."""
        if not any(c.role == "learner" for c in self.clients.by_identity.values()):
            return  # results go to the learner: none connected yet (or any more)
        actors = list(self.clients.actors())
        request = self.evals.ready(self.core.policy_version, now, {c.identity for c in actors})
        if request is None or not actors:
            return
        actor = max(actors, key=lambda c: c.loaded_version)
        self.outbox.send_message(actor.identity, request)
        self.evals.sent(request, actor.identity, now)

    # --- the summary ----------------------------------------------------------------------------

    def rates(self) -> dict[str, float]:
        if len(self.samples) < 2:
            return {
                "window_s": 0.0,
                "groups_received_per_s": 0.0,
                "groups_consumed_per_s": 0.0,
                "samples_per_s": 0.0,
                "versions_per_s": 0.0,
            }
        (t0, r0, c0, v0), (t1, r1, c1, v1) = self.samples[0], self.samples[-1]
        dt = max(t1 - t0, 1e-9)
        group_size = self.cfg.actor.group_size
        return {
            "window_s": round(dt, 3),
            "groups_received_per_s": (r1 - r0) / dt,
            "groups_consumed_per_s": (c1 - c0) / dt,
            "samples_per_s": (c1 - c0) * group_size / dt,
            "versions_per_s": (v1 - v0) / dt,
        }

    def staleness(self) -> dict[str, Any]:
        hist = self.core.state.staleness_hist
        total = sum(hist.values())
        mean = sum(k * v for k, v in hist.items()) / total if total else 0.0
        return {
            "bound": self.cfg.replay.max_staleness,
            "mean": mean,
            "max": max(hist) if hist else 0,
            "hist": {str(k): v for k, v in sorted(hist.items())},
        }

    def summary(self) -> dict[str, Any]:
        """The live summary `Status` carries."""
        core, stats = self.core, self.stats()
        clients = stats.pop("clients")
        for line in clients.values():
            if "loaded_version" in line and line.get("role") == "actor":
                line["lag"] = core.policy_version - int(line["loaded_version"])
        ev = self.evals
        in_flight = ev.in_flight.request.policy_version if ev.in_flight else None
        return {
            "time": time.time(),
            "uptime_s": time.monotonic() - self.started,
            "endpoint": self.endpoint,
            "policy_version": core.policy_version,
            "paused": self.paused,
            "clients": clients,
            "throughput": self.rates(),
            "staleness": self.staleness(),
            "buffer": {
                "stored": len(core.state.buffer),
                "capacity": core.state.buffer.capacity,
                "parked_requests": len(core.parked),
            },
            "errors": stats.pop("errors"),
            "counters": stats,
            "alarms": list(self.alarms),
            "num_alarms": self.num_alarms,
            "eval": {
                "every_versions": ev.every,
                "requested": ev.num_requested,
                "results": ev.num_results,
                "resent": ev.num_resent,
                "in_flight_version": in_flight,
                "last": ev.last,
            },
        }

    def stats(self) -> dict[str, Any]:
        """Counters and gauges, as answered to `StatsRequest`."""
        core = self.core
        state = core.state
        clients = self.clients.describe(state.credits.held_by, time.monotonic())
        book, prompts = state.credits, state.prompts
        lent = sum(map(len, state.lent.values()))
        return {
            **{k: state.counters[k] for k in COUNTED},
            "sends_dropped": self.outbox.dropped,
            "credits_issued": book.num_issued,
            "credits_outstanding": book.outstanding,
            "credits_expired": book.num_expired,
            "credits_returned": book.num_returned,
            "policy_version": core.policy_version,
            "stored": len(state.buffer),
            "parked_requests": len(core.parked),
            "errors": dict(self.errors),
            "clients": clients,
            "dataset_epoch": prompts.epoch,
            "prompts_reissued": prompts.num_reissued,
            "groups_lent": lent,
            "durability": self.durability(),
            "staleness_hist": {str(k): v for k, v in sorted(state.staleness_hist.items())},
        }

    def durability(self) -> dict[str, Any]:
        wal, found = self.wal, self.recovery
        if wal is None:
            return {"mode": "volatile"}
        return {
            "mode": "durable",
            "commits": wal.num_commits,
            "snapshots": wal.num_snapshots,
            "log_bytes": wal.log_bytes,
            "recovered_ops": found.ops,
            "recovered_snapshot_groups": found.snapshot_groups,
            "recovery_skipped_bytes": found.skipped_bytes,
            **_writes(wal),
        }


def _writes(wal: WriteAheadLog) -> dict[str, int]:
    """How the log's bytes reached the disk: written from the frames' own memory (placed) or
    copied through the O_DIRECT staging buffer (replay/direct_io.py)."""
    if wal.syncer is None:
        return {}
    writer = wal.syncer.writer
    return {"log_bytes_placed": writer.placed_bytes, "log_bytes_copied": writer.copied_bytes}


COUNTED = (
    "groups_received",
    "groups_stored",
    "groups_consumed",
    "groups_dropped_stale",
    "groups_duplicate",
    "groups_adopted",
    "groups_trained",
    "groups_returned",
    "weights_announced",
)
"""The hub's counters that `stats()` reports (besides gauges)."""
