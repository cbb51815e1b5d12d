"""The discrete-event model of an asyncrl cluster: actors, the hub, the learner, weight syncs.

```
                 credits (replay/core.py: AReaL window at the actor's weights, capacity,
                 credit window)
   A actors  <----------------------------------------------  HubCore (the hub's own core)
   take up to `concurrency` held credits, generate one batch   |  ^     ^
   (time: timing.GenerationTime), push one Group each  ------>-+  |     | SampleRequest(v, B)
   WeightsLoaded(w) on every swap  ---------------------------|->+     | (parked until B groups
        ^                                                      | batch  |  with v - min <= η)
        | swap at the generation boundary, or at once if idle  v        |
   weights v+1 available  <--- sync (timing.WeightSync) <--- learner: step (timing.LearnerTime),
                                non-blocking                  v += 1, Version(v), publish
```

The hub is asyncrl's: `replay.core.HubCore`, the same decisions `replay/server.py` takes (its
credits, buffer, staleness bound, admission and batches), driven here by simulated messages
instead of sockets; actors are named by their id's bytes, the learner by b"learner". The
actors and the learner behave as asyncrl's do (`actors/actor.py`, `learner/loop.py`):

- The hub bounds each actor's credits by the AReaL window at the version the actor will
  generate with, w = min(hub version, loaded version) (`replay.core.grant`): groups stamped
  w must be consumed by version w + η, so credits the window at w has no room for would only
  make groups that go stale. An actor swaps in the newest weights at each generation boundary
  (the end of its batch) and, when idle, as soon as a sync lands, and reports each swap to the
  hub (WeightsLoaded), whose window for it moves up when that message arrives.
- An actor holding credits granted at hub version c waits, at its generation boundary, until it
  holds weights >= c - η, rounded down to a published version (every `publish_every`-th): the
  floor its Credits carry (`Credits.min_weights_version`, `Actor.wait_for_weights`); the wait
  counts as idle. `wait_for_weights=False` models the
  earlier actor that starts at once.
- The learner pipelines its request (`Learner.train`): on receiving the batch it trains at
  version v it asks at once for the next one with version v + 1, so the hub adopts v + 1
  (dropping what is stale w.r.t. it, opening admission) while step v runs; a batch served
  meanwhile waits in the learner's inbox. `pipeline_requests=False` models a learner that asks
  only after its step.

Event loop: a heap of (time, priority, serial, handler). At equal times, completed weight
syncs run first, then finished generations, then finished learner steps, then actors starting
their next batch, so an actor that starts at the instant new weights land uses them and takes
the credits granted at that instant (also those its own WeightsLoaded opened). After every
event that changes the hub's state, the hub grants credits and serves the parked request, as
`replay/server.py`'s loop does. Every message (credits, groups, WeightsLoaded, SampleRequest,
Version, a batch) acts `message_latency_s` after it is sent (a delivery event, after the
learner's step ends and before actors start at the same instant); with 0 it acts at once, in
the sender's event. Versions and staleness follow the real system: an actor stamps its whole
batch with the version loaded at the batch's start (min = max policy version, between groups;
in flight, max is the last version loaded during the batch); the learner
consumes at version v and the hub records staleness v - min_policy_version.

Measurements cover steps `warmup_steps + 1 .. num_steps`: the window runs from the end of step
`warmup_steps` (time 0 when it is 0) to the end of step `num_steps`.

In-flight weight updates (`weight_update = "in_flight"`, `actors/engines/*`): a sync that lands
while an actor generates is loaded at once, the batch pausing `inflight_pause_s` (+ per
sequence `inflight_pause_per_seq_s`: the load and the KV recompute) and going on under the new
weights; the actor reports the load (WeightsLoaded), so the hub's window for its next credits
moves up at once. Its groups span the versions from the batch's start to its end, and the hub
counts their staleness from the oldest (`min_policy_version`), as asyncrl's does. The actor
still waits for weights >= c - η before it starts a batch (its oldest tokens would be stale).

Not modelled: the hub's own processing time (apart from the message latency), actor failures
and heartbeats, heterogeneous actors, an engine's batch limit (a batch beyond vLLM's
max_num_seqs would run in waves), reuse (`max_times_sampled` > 1), and the reward cost apart
from a fixed per-batch part.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.config import ActorConfig, LearnerConfig, ReplayConfig, RunConfig
from asyncrl.prompt_records import Prompt
from asyncrl.protocol.messages import CreditItem, Credits, Group, SampleRequest, Trajectory
from replay.core import HubCore
from replay.prompts import PromptSource

from .config import SimConfig, SimResult, SimulationStalled
from .timing import LengthModel, Spread
from .tracker import Tracker

NUM_PROMPTS = 16384
LEARNER = b"learner"
PRIO_SYNC, PRIO_GEN_DONE, PRIO_STEP_DONE, PRIO_MESSAGE, PRIO_ACTOR_START = 0, 1, 2, 3, 4


class Simulation:
    """One run of the model; `run()` returns its `SimResult`."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        prompts = PromptSource([Prompt(f"p{i}", "") for i in range(NUM_PROMPTS)], seed=cfg.seed)
        self.hub = HubCore(hub_config(cfg), prompts, incarnation=1)
        self.groups = _GroupMaker(cfg.group_size)
        self.lengths = _LengthPool(cfg.lengths, np.random.default_rng(cfg.seed))
        # own streams, so adding a spread leaves the length draws as they were
        self.gen_spread = Spread(cfg.generation.spread, np.random.default_rng([cfg.seed, 1]))
        self.step_spread = Spread(cfg.learner.spread, np.random.default_rng([cfg.seed, 2]))
        self.now = 0.0
        self.events: list[tuple[float, int, int, Callable[[Any], None], Any]] = []
        self.serial = itertools.count()
        self.actors = [_Actor(f"actor-{i:06d}") for i in range(cfg.num_actors)]
        self.by_holder = {a.holder: a for a in self.actors}
        for actor in self.actors:  # each one's Hello
            self.hub.actor_joined(
                actor.holder, actor.actor_id, 0, cfg.credit_window or cfg.concurrency
            )
        self.group_tokens: dict[tuple[str, int], int] = {}
        self.policy_version = 0
        self.steps_done = 0
        self.waiting_since: float | None = None  # None while a step runs
        self.inbox: list[Any] | None = None  # a batch that came while a step ran
        self.request_id = 0
        self.weights = _Publisher()
        self.track = Tracker(num_actors=cfg.num_actors, max_staleness=cfg.max_staleness)

    # --- the loop -------------------------------------------------------------------------------

    def run(self) -> SimResult:
        """Simulate until step `num_steps` ends; measure over the window."""
        self.track.begin(self.cfg.warmup_steps)
        self.waiting_since = 0.0
        self.learner_request(self.policy_version)
        self.hub_tick()
        while self.steps_done < self.cfg.num_steps:
            if not self.events:
                raise SimulationStalled(
                    f"no event left after {self.steps_done} of {self.cfg.num_steps} steps at "
                    f"t={self.now:.3f} s (policy_version {self.policy_version}): "
                    "check capacity, concurrency and groups_per_step"
                )
            t, _prio, _serial, handler, arg = heapq.heappop(self.events)
            self.track.advance(t)
            self.now = t
            handler(arg)
        return self.track.result(self.cfg, self.cfg.sync.seconds)

    def at(self, t: float, prio: int, handler: Callable[[Any], None], arg: Any = None) -> None:
        heapq.heappush(self.events, (t, prio, next(self.serial), handler, arg))

    def to_hub(self, handler: Callable[..., None], *args: Any) -> None:
        """A message to the hub: handled now, or after the latency and then a hub tick (the
        sender's own tick, at send time, has nothing new to act on then)."""
        if not self.cfg.message_latency_s:
            handler(*args)
            return

        def arrive(_arg: Any) -> None:
            handler(*args)
            self.hub_tick()

        self.at(self.now + self.cfg.message_latency_s, PRIO_MESSAGE, arrive)

    def to_client(self, handler: Callable[[Any], None], arg: Any) -> None:
        """A message from the hub to an actor or the learner."""
        if not self.cfg.message_latency_s:
            handler(arg)
        else:
            self.at(self.now + self.cfg.message_latency_s, PRIO_MESSAGE, handler, arg)

    def hub_tick(self) -> None:
        """The hub's loop after a message: grant credits, serve the parked request."""
        while True:
            for holder, credits in self.hub.grant():
                self.to_client(self.actor_credits, (self.by_holder[holder], credits))
            batches = self.hub.serve(self.now)
            if not batches:
                return
            for _learner, batch in batches:  # then grant again: room may be freed
                self.to_client(self.learner_receive, list(batch.groups))

    # --- actors ---------------------------------------------------------------------------------

    def actor_credits(self, arg: tuple[_Actor, Credits]) -> None:
        """Credits reach an actor: hold them, note the weights they need, start if idle."""
        actor, credits = arg
        actor.held.extend(credits.items)
        actor.min_weights = max(actor.min_weights, credits.min_weights_version)
        self.wake(actor)

    def wake(self, actor: _Actor) -> None:
        if not actor.busy and not actor.start_pending and actor.held:
            actor.start_pending = True
            self.at(self.now, PRIO_ACTOR_START, self.actor_start, actor)

    def load_weights(self, actor: _Actor) -> bool:
        """Swap in the newest available weights, if newer, and tell the hub (WeightsLoaded).

        Called at the end of an actor's batch (the generation boundary) and, when a sync lands,
        for every actor: idle ones swap at once; generating ones only with in-flight updates,
        whose batch then ends `inflight_pause_s` later (the load and the KV recompute).
        """
        if actor.version >= self.weights.available:
            return False
        if actor.busy:
            if self.cfg.weight_update != "in_flight":
                return False
            actor.done_at += self.cfg.inflight_pause_s
            actor.done_at += self.cfg.inflight_pause_per_seq_s * actor.batch_seqs
            self.track.inflight_update()
        actor.version = self.weights.available
        self.track.weights_loaded()
        self.to_hub(self.hub.weights_loaded, actor.holder, actor.version)
        return True

    def actor_start(self, actor: _Actor) -> None:
        """Start a batch with the weights loaded (the newest: an idle actor swaps at once) and
        up to `concurrency` held credits."""
        actor.start_pending = False
        assert actor.version == self.weights.available, "an idle actor holds the newest weights"
        if self.cfg.wait_for_weights:
            if self.weights.available < actor.min_weights:
                self.weights.waiters.append(actor)
                return
        batch = self.cfg.concurrency
        credits, actor.held = actor.held[:batch], actor.held[batch:]
        actor.busy, actor.batch_version = True, actor.version
        n = actor.batch_seqs = len(credits) * self.cfg.group_size
        lengths = self.lengths.take(n)
        seconds = self.cfg.generation.seconds(lengths, self.cfg.lengths.prompt_tokens)
        seconds *= self.gen_spread.draw()
        self.track.actor_started(+1)
        actor.done_at = self.now + seconds
        self.at(actor.done_at, PRIO_GEN_DONE, self.actor_done, (actor, credits, lengths))
        self.track.generation(seconds, n, sum(lengths))

    def actor_done(self, arg: tuple[_Actor, list[CreditItem], list[int]]) -> None:
        """Push one group per credit, its tokens made by versions batch_version .. version
        (the same one unless in-flight updates came); later if in-flight pauses came."""
        actor, credits, lengths = arg
        if self.now < actor.done_at:
            self.at(actor.done_at, PRIO_GEN_DONE, self.actor_done, arg)
            return
        size = self.cfg.group_size
        prompt_tokens = self.cfg.lengths.prompt_tokens * size
        groups = []
        for i, credit in enumerate(credits):
            groups.append(
                self.groups.make(
                    actor.actor_id, actor.seq, credit, actor.batch_version, actor.version
                )
            )
            tokens = sum(lengths[i * size : (i + 1) * size]) + prompt_tokens
            self.group_tokens[(actor.actor_id, actor.seq)] = tokens
            actor.seq += 1
        self.to_hub(self.hub_groups, groups)
        self.track.actor_started(-1)
        self.track.generated(len(lengths))
        actor.busy = False
        self.load_weights(actor)
        self.wake(actor)
        self.hub_tick()

    def hub_groups(self, groups: list[Group]) -> None:
        for group in groups:
            self.hub.take_group(group.actor_id.encode(), group.actor_id, group, ())

    # --- learner --------------------------------------------------------------------------------

    def learner_request(self, policy_version: int) -> None:
        """A SampleRequest for the step that trains at `policy_version`."""
        self.request_id += 1
        request = SampleRequest(
            request_id=self.request_id,
            policy_version=policy_version,
            num_groups=self.cfg.groups_per_step,
        )
        self.to_hub(self.hub_request, request)

    def hub_request(self, request: SampleRequest) -> None:
        self.hub.request(LEARNER, request, self.now)

    def learner_receive(self, groups: list[Any]) -> None:
        """The hub sent a batch: train on it now, or keep it in the inbox while a step runs."""
        if self.waiting_since is None:
            assert self.inbox is None, "a second batch came while a step was running"
            self.inbox = groups
        else:
            self.learner_start(groups)

    def learner_start(self, groups: list[Any]) -> None:
        assert self.waiting_since is not None, "a step started while another was running"
        wait_s, self.waiting_since = self.now - self.waiting_since, None
        if self.cfg.pipeline_requests and self.steps_done + 1 < self.cfg.num_steps:
            self.learner_request(self.policy_version + 1)  # the hub prepares the next batch
        tokens = sum(self.group_tokens.pop((g.actor_id, g.seq)) for g in groups)
        staleness = [self.policy_version - g.min_policy_version for g in groups]
        mixed = sum(1 for g in groups if g.max_policy_version > g.min_policy_version)
        seconds = self.cfg.learner.seconds(tokens) * self.step_spread.draw()
        self.track.step(
            self.steps_done + 1, self.cfg.warmup_steps, wait_s, seconds, tokens, staleness, mixed
        )
        self.at(self.now + seconds, PRIO_STEP_DONE, self.learner_done)

    def learner_done(self, _arg: Any = None) -> None:
        """v += 1, report it, publish (non-blocking), take the next batch (or ask for it)."""
        self.policy_version += 1
        self.steps_done += 1
        self.to_hub(self.hub.adopt_version, self.policy_version)  # Version
        if self.policy_version % self.cfg.publish_every == 0:
            self.publish(self.policy_version)
        dropped = self.hub.state.counters["groups_dropped_stale"]
        self.track.step_done(self.steps_done, self.cfg, dropped)
        if self.steps_done < self.cfg.num_steps:
            if self.cfg.learner.after_s:  # metrics and logs, while the actors generate
                self.at(self.now + self.cfg.learner.after_s, PRIO_STEP_DONE, self.learner_ready)
            else:
                self.learner_ready()

    def learner_ready(self, _arg: Any = None) -> None:
        """The learner turns to its next batch: from the inbox, or it waits (and asks)."""
        self.waiting_since = self.now
        if not self.cfg.pipeline_requests:
            self.learner_request(self.policy_version)
        if self.inbox is not None:
            batch, self.inbox = self.inbox, None
            self.learner_start(batch)
        self.hub_tick()

    # --- weights --------------------------------------------------------------------------------

    def publish(self, policy_version: int) -> None:
        """At most one publication in flight; a newer version supersedes a queued one."""
        self.weights.published_at[policy_version] = self.now
        if self.weights.in_flight is None:
            self.weights.in_flight = policy_version
            self.at(self.now + self.cfg.sync.seconds, PRIO_SYNC, self.sync_done, policy_version)
        else:
            self.weights.queued = policy_version

    def sync_done(self, policy_version: int) -> None:
        self.weights.available = policy_version
        self.track.synced(self.now - self.weights.published_at.pop(policy_version))
        self.weights.in_flight, queued, self.weights.queued = None, self.weights.queued, None
        if queued is not None:
            self.weights.in_flight = queued
            self.at(self.now + self.cfg.sync.seconds, PRIO_SYNC, self.sync_done, queued)
        for v in [v for v in self.weights.published_at if v < policy_version]:
            del self.weights.published_at[v]  # superseded: never delivered
        loaded = [self.load_weights(actor) for actor in self.actors]  # the idle ones swap now
        waiters, self.weights.waiters = self.weights.waiters, []
        for actor in waiters:
            self.wake(actor)
        if any(loaded):
            self.hub_tick()  # their admission window moved up with their weights


@dataclass(eq=False)
class _Actor:
    actor_id: str
    held: list[CreditItem] = field(default_factory=list)
    busy: bool = False
    start_pending: bool = False
    version: int = 0
    batch_version: int = 0  # the version loaded when its batch started: its oldest tokens'
    done_at: float = 0.0  # when its batch ends (in-flight pauses push it back)
    batch_seqs: int = 0
    seq: int = 0
    min_weights: int = 0  # the weights its credits require (the largest Credits floor)

    @property
    def holder(self) -> bytes:
        """The name the hub knows it by (a routing id, in asyncrl)."""
        return self.actor_id.encode()


class _LengthPool:
    """Completion lengths drawn in large chunks (one numpy call per chunk, not per batch)."""

    def __init__(self, model: LengthModel, rng: np.random.Generator, chunk: int = 1 << 16) -> None:
        self.model, self.rng, self.chunk = model, rng, chunk
        self.pool: list[int] = model.sample(rng, chunk).tolist()
        self.cursor = 0

    def take(self, n: int) -> list[int]:
        if self.cursor + n > len(self.pool):
            fresh = self.model.sample(self.rng, max(self.chunk, n)).tolist()
            self.pool = self.pool[self.cursor :] + fresh
            self.cursor = 0
        out = self.pool[self.cursor : self.cursor + n]
        self.cursor += n
        return out


@dataclass
class _Publisher:
    available: int = 0  # actors start from the initial weights (version 0)
    in_flight: int | None = None
    queued: int | None = None
    published_at: dict[int, float] = field(default_factory=dict)
    waiters: list[_Actor] = field(default_factory=list)  # wait_for_weights only


def hub_config(cfg: SimConfig) -> RunConfig:
    """The run config the simulated hub's core is made with: the shape of `cfg`."""
    return RunConfig(
        replay=ReplayConfig(
            max_staleness=cfg.max_staleness,
            capacity_groups=cfg.capacity_groups,
            sampling=cfg.sampling,
        ),
        learner=LearnerConfig(groups_per_step=cfg.groups_per_step, publish_every=cfg.publish_every),
        actor=ActorConfig(group_size=cfg.group_size),
    )


class _GroupMaker:
    """Real `Group`s for simulated generations: one built with `Group.build` per (min, max)
    policy version (tiny arrays, `group_size` samples) and reused with each group's own
    identity; their lengths live in the simulator, which needs them only for timing."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self._templates: dict[tuple[int, int], dict[str, Any]] = {}  # (min, max) -> fields

    def make(
        self,
        actor_id: str,
        seq: int,
        credit: CreditItem,
        policy_version: int,
        max_version: int | None = None,
    ) -> Group:
        """A Group for this credit, every sample's tokens made by `policy_version` (the oldest,
        which staleness counts from) up to `max_version` (default: the same)."""
        versions = (policy_version, policy_version if max_version is None else max_version)
        fields = self._templates.get(versions)
        if fields is None:
            template = self._template(*versions)
            fields = {f.name: getattr(template, f.name) for f in dataclasses.fields(Group)}
            self._templates[versions] = fields
        identity = {
            "group_id": f"{actor_id}/{seq}",
            "prompt_id": credit.prompt_id,
            "credit_id": credit.credit_id,
            "actor_id": actor_id,
            "seq": seq,
        }
        return Group(**(fields | identity))

    def _template(self, policy_version: int, max_version: int) -> Group:
        sample = Trajectory(
            tokens=np.zeros(2, np.int32),
            prompt_len=1,
            loss_mask=np.ones(1, np.uint8),
            behavior_logprobs=np.zeros(1, np.float32),
            reward=0.0,
            min_policy_version=policy_version,
            max_policy_version=max_version,
            finish_reason="stop",
        )
        return Group.build(
            group_id="template",
            prompt_id="template",
            credit_id=0,
            actor_id="template",
            seq=0,
            trajectories=[sample] * self.group_size,
        )


def simulate(cfg: SimConfig) -> SimResult:
    """Run one simulation."""
    return Simulation(cfg).run()
