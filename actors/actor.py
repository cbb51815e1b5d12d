"""The rollout actor: credits in, episodes run, scored and versioned groups out, weights in.

```
   hub --Credits--------> [I/O thread] --inbox--> main loop (this file)
   hub --WeightsAnnounce> [I/O thread] --> WeightReceiver thread (gloo/nccl, buckets)
                                                    |
   main loop, one iteration per generation wave:    v  (newest complete version)
     1. swap in received weights  <---------- receiver.poll()   -> WeightsLoaded to hub
     2. take credits, up to actor.concurrency groups in flight (the window holds the next)
     3. start their episodes: group_size per credit (actors/episodes.py)
     4. advance: ONE engine.generate for every episode awaiting the model; environment
        steps and tool calls on the worker pool (actor.env_workers), never blocking the others
     5. score the groups whose episodes all ended: ONE reward-pipeline call per wave
        (actors/rewards/pipeline.py: the task verifier and the configured components,
        composed; canaries every reward.canary_every versions)
     6. build one columnar Group per credit (component values and provenance included) and
        push it (the I/O thread sends; acks return); a group whose reward failed under
        reward.on_failure = drop_group is not pushed, its credit goes back (prompt re-issued)
   back-pressure: the hub grants credits only as admission allows (η, the learner's version and
   the version this actor reported loading), so with a small η the actor waits at 2 instead of
   producing samples that would be dropped; weights arriving meanwhile wake it (1, then 2).
```

The actor asks the hub for `actor.num_window_credits` credits (2 × concurrency by default) but
keeps at most `concurrency` groups in flight: the next credits arrive while the current ones
generate, so no hub round trip sits between waves. A single-turn task (sort) runs a whole round
in one wave: one engine call with n = group_size per credit, scored on the main thread (its
verifier is quicker than a hand-off to a thread, which also competed with generation for the
GIL: bench/engine.py measures the loop against the bare engine). Weights are swapped only
between waves, so a single-turn sample has min_policy_version == max_policy_version; an episode
over several waves may span versions, and its trajectory says so. SIGTERM finishes the episodes
in flight, pushes them, returns unused credits (their prompts are re-issued at once) and says
Bye; the exit code is 0.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from actors.engines.base import Engine, GenerationRequest
from actors.envs.base import Env
from actors.envs.data import from_credit
from actors.episodes import EpisodeGroup, EpisodeLimits, EpisodeRunner
from actors.evaluation import ActorEvaluator
from actors.rewards.canaries import canary_runner
from actors.rewards.pipeline import RewardOutcome, RewardPipeline, item_from_episode
from asyncrl.config import ActorConfig, RunConfig
from asyncrl.metrics import LiveMetrics
from asyncrl.protocol.messages import (
    CreditItem,
    CreditReturn,
    Credits,
    Error,
    Group,
    Trajectory,
    WeightsAnnounce,
    WeightsLoaded,
)
from asyncrl.transport.connection import HubConnection

ACTOR_COUNTERS = (
    "rounds",
    "groups_pushed",
    "samples",
    "tokens",
    "wait_credit_s",
    "generate_s",
    "reward_s",
    "weights_loaded",
    "weights_load_s",
    "reward_failures",
    "credits_returned",
    "wait_weights_s",
    "reward_groups_dropped",
)
"""Actor statistics that only grow (exported as Prometheus counters)."""


class Actor:
    """One rollout actor process: a hub connection, an engine, episodes, a weight receiver."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        actor_id: str,
        conn: HubConnection,
        engine: Engine,
        tokenizer: Any,
        make_env: Callable[[], Env],
        receiver: Any | None = None,
        rewards: RewardPipeline | None = None,
    ) -> None:
        self.cfg = cfg
        self.actor_id = actor_id
        self.conn = conn
        self.engine = engine
        self.tokenizer = tokenizer
        self.receiver = receiver
        self.rewards = rewards or RewardPipeline.from_config(
            cfg, canaries=canary_runner(cfg, make_env, lambda t: len(tokenizer.encode(t)))
        )
        self.episodes = EpisodeRunner(
            engine, tokenizer, make_env, EpisodeLimits.from_config(cfg), cfg.actor.env_workers
        )
        self.stop_event = threading.Event()
        self.pending: list[CreditItem] = []
        self.group_size = cfg.actor.group_size
        self.seq = 0
        self.stats: dict[str, float] = {
            "groups_pushed": 0,
            "samples": 0,
            "tokens": 0,
            "wait_credit_s": 0.0,
            "reward_s": 0.0,
            "weights_loaded": 0,
            "weights_load_s": 0.0,
            "reward_failures": 0,
            "reward_groups_dropped": 0,
            "credits_returned": 0,
            "wait_weights_s": 0.0,
            "wall_s": 0.0,
        }
        self.min_weights_version = 0  # credits need weights at least this new (see run)
        self.live: LiveMetrics | None = None  # the /metrics endpoint, when [metrics] turns it on
        self.evaluator: ActorEvaluator | None = None  # runs the hub's evaluation requests
        self.started = time.perf_counter()
        if receiver is not None and cfg.actor.weight_update == "in_flight":
            if not hasattr(engine, "between_steps"):
                raise ValueError(
                    f"actor.weight_update: {type(engine).__name__} cannot update weights in flight"
                )
            engine.between_steps = self.swap_weights  # type: ignore[attr-defined]
        if receiver is not None:
            conn.on(WeightsAnnounce, self.on_announce)
            receiver.on_ready = conn.interrupt  # an actor idle without credits swaps at once

    def on_announce(self, msg: WeightsAnnounce) -> None:
        """On the I/O thread: hand the rendezvous to the receiver (a bad one is reported)."""
        assert self.receiver is not None
        try:
            self.receiver.on_announce(msg.announcement)
        except ValueError as exc:
            print(f"[{self.actor_id}] refused weights v{msg.policy_version}: {exc}", flush=True)

    # --- the main loop ------------------------------------------------------------------------

    def run(self, max_groups: int = 0) -> None:
        """Generate until stopped (or `max_groups` groups pushed); then finish the episodes in
        flight, swap in the last received weights and return the credits left unused."""
        started = 0
        while not self.stop_event.is_set():
            self.swap_weights()
            if self.evaluator is not None:
                self.evaluator.poll()  # held-out prompts, outside the training stream
            credits = self.take_credits(limit=max_groups - started if max_groups else None)
            started += len(credits)
            self.start_episodes(credits)
            if not self.episodes.num_groups:
                if max_groups and started >= max_groups:
                    break  # every group started was pushed or dropped (reward.on_failure)
                continue
            self.send(self.make_groups(self.score(self.episodes.advance())))
            self.publish_metrics()
            if max_groups and self.stats["groups_pushed"] >= max_groups:
                break
        while self.episodes.num_groups:  # finish what is in flight (bounded by its limits)
            self.send(self.make_groups(self.score(self.episodes.advance())))
        self.swap_weights()  # the last announced weights, if they arrived meanwhile
        self.return_credits()  # last: the caller closes the connection (Bye) right after

    # --- named steps --------------------------------------------------------------------------

    def publish_metrics(self) -> None:
        """A snapshot for the live /metrics endpoint (when [metrics] turns it on)."""
        if self.live is None:
            return
        stats = self.status_stats()
        gen_s = stats["generate_s"]
        self.live.publish(
            {
                **stats,
                "policy_version": self.engine.policy_version,
                "tokens_per_s": stats["tokens"] / gen_s if gen_s else 0.0,
            }
        )

    def swap_weights(self) -> None:
        """At a generation boundary: load the newest fully received weights, if any."""
        if self.receiver is None:
            return
        received = self.receiver.poll()
        if received is None:
            return
        policy_version, named = received
        start = time.perf_counter()
        self.engine.load_weights(named, policy_version)
        self.stats["weights_load_s"] += time.perf_counter() - start
        self.stats["weights_loaded"] += 1
        self.conn.send(WeightsLoaded(actor_id=self.actor_id, policy_version=policy_version))

    def wait_for_weights(self) -> None:
        """Before generating for credits granted at hub version v, hold weights >= v - η
        (rounded down to a version the learner publishes: every learner.publish_every-th).

        The hub already sizes this actor's credits by the weights it reported loading, so this
        rarely waits; it covers an actor whose weights are far behind the learner's (a late
        joiner, a run resumed at version v with actors on their initial weights), whose groups
        would only be dropped as stale. The time is reported as `wait_weights_s`. Bounded by
        weights.timeout_s: if weights do not come (a failed broadcast), generate anyway and let
        the hub's bound decide.
        """
        need = self.min_weights_version
        if self.receiver is None or self.engine.policy_version >= need:
            return
        start = time.perf_counter()
        deadline = start + self.cfg.weights.timeout_s
        while self.engine.policy_version < need and not self.stop_event.is_set():
            if time.perf_counter() > deadline:
                print(
                    f"[{self.actor_id}] no weights >= v{need} within {self.cfg.weights.timeout_s} s; generating with v{self.engine.policy_version}",
                    flush=True,
                )
                break
            self.receiver.wait_ready(timeout=0.05)
            self.swap_weights()
        self.stats["wait_weights_s"] += time.perf_counter() - start

    def take_credits(self, timeout_s: float = 0.2, limit: int | None = None) -> list[CreditItem]:
        """Credits for the room left under `concurrency` groups in flight (at most `limit`);
        waits (up to timeout_s) only when none is held and no episode is in flight."""
        self.drain_inbox(0.0)
        if not self.pending and not self.episodes.num_groups:
            start = time.perf_counter()
            self.drain_inbox(timeout_s)
            self.stats["wait_credit_s"] += time.perf_counter() - start
        room = self.cfg.actor.concurrency - self.episodes.num_groups
        room = room if limit is None else min(room, limit)
        credits, self.pending = self.pending[: max(room, 0)], self.pending[max(room, 0) :]
        return credits

    def drain_inbox(self, wait_s: float) -> None:
        """Handle every message waiting; wait up to `wait_s` for the first one."""
        msg = self.conn.recv(timeout_s=wait_s)
        while msg is not None:
            self.handle(msg)
            msg = self.conn.recv(timeout_s=0.0)

    def handle(self, msg: Any) -> None:
        """Anything the hub sends that is not a weight announcement."""
        if isinstance(msg, Credits):
            self.group_size = msg.group_size
            self.pending.extend(msg.items)
            # the hub's floor: v - η, rounded down to a published version (replay/core.py)
            self.min_weights_version = max(self.min_weights_version, msg.min_weights_version)
        elif isinstance(msg, Error):
            print(
                f"[{self.actor_id}] hub refused a message: {msg.code} {msg.field}: {msg.detail}",
                flush=True,
            )

    def start_episodes(self, credits: Sequence[CreditItem]) -> None:
        """`group_size` episodes per credit, once the weights are recent enough for them."""
        if not credits:
            return
        self.wait_for_weights()
        for credit in credits:
            row = from_credit(credit.prompt_id, credit.prompt, credit.info)
            self.episodes.start(credit, row, credit.seed, self.group_size)

    def score(self, groups: list[EpisodeGroup]) -> list[tuple[EpisodeGroup, list[RewardOutcome]]]:
        """The composed reward of every episode of these finished groups (one pipeline call
        per wave); groups to drop (reward.on_failure = drop_group) hand their credit back."""
        if not groups:
            return []
        start = time.perf_counter()
        items = [item_from_episode(g.row, ep) for g in groups for ep in g.episodes]
        outcomes = iter(self.rewards.score(items, policy_version=self.engine.policy_version))
        scored, dropped = [], []
        for group in groups:
            mine = [next(outcomes) for _ in group.episodes]
            if any(o.drop_group for o in mine):
                dropped.append(group.tag.credit_id)
            else:
                scored.append((group, mine))
        if dropped:
            self.conn.send(CreditReturn(credit_ids=dropped))
            self.stats["reward_groups_dropped"] += len(dropped)
        self.stats["reward_s"] += time.perf_counter() - start
        return scored

    def make_groups(self, scored: list[tuple[EpisodeGroup, list[RewardOutcome]]]) -> list[Group]:
        """One columnar Group per finished credit."""
        return [self.make_group(group, outcomes) for group, outcomes in scored]

    def make_group(self, group: EpisodeGroup, outcomes: list[RewardOutcome]) -> Group:
        """The Group of one credit's episodes: one trajectory per episode, masks and all."""
        credit: CreditItem = group.tag
        trajectories = []
        for ep, outcome in zip(group.episodes, outcomes, strict=True):
            tokens, mask, logprobs = ep.trajectory()
            version = max(ep.min_version, 0) if ep.num_turns else self.engine.policy_version
            trajectories.append(
                Trajectory(
                    tokens=tokens,
                    prompt_len=len(ep.prompt),
                    loss_mask=mask,
                    behavior_logprobs=logprobs,
                    reward=outcome.reward,
                    min_policy_version=version,
                    max_policy_version=max(ep.max_version, version),
                    finish_reason=ep.finish_reason,
                    reward_failed=outcome.failed,
                    num_turns=ep.num_turns,
                    tool_s=ep.tool_s,
                    env_s=ep.env_s,
                    version_spans=ep.version_spans(),
                )
            )
        failures = sum(1 for o in outcomes if o.failed)
        self.stats["reward_failures"] += failures
        self.stats["samples"] += len(trajectories)
        self.stats["tokens"] += sum(int(t.loss_mask.sum()) for t in trajectories)
        self.seq = self.conn.next_seq(self.seq)  # a restarted actor goes on where the hub is
        group_id = f"{self.actor_id}/{self.seq}"
        counts = {
            k: sum(ep.counts[k] for ep in group.episodes)
            for k in ("tool_calls", "tool_errors", "malformed_calls")
        }
        fields = self.rewards.group_fields(outcomes)
        out = Group.build(
            group_id=group_id,
            prompt_id=credit.prompt_id,
            credit_id=credit.credit_id,
            actor_id=self.actor_id,
            seq=self.seq,
            trajectories=trajectories,
            metadata={**{k: v for k, v in counts.items() if v}, **fields["metadata"]},
            reward_components=fields["reward_components"],
            timings={
                "generate_s": group.generate_s,
                "env_s": sum(ep.env_s for ep in group.episodes),
            },
        )
        self.seq += 1
        return out

    def send(self, groups: list[Group]) -> None:
        """Push finished groups to the hub (the I/O thread sends them; acks come back to it)."""
        for group in groups:
            self.conn.send(group)
            self.stats["groups_pushed"] += 1

    def return_credits(self) -> None:
        """Hand back credits that will not be used (shutdown), so their prompts are re-issued."""
        self.drain_inbox(0.0)
        if self.pending:
            self.conn.send(CreditReturn(credit_ids=[c.credit_id for c in self.pending]))
            self.stats["credits_returned"] += len(self.pending)
            self.pending = []

    def status_stats(self) -> dict[str, Any]:
        """The actor's counters with its episodes' (rounds, generate_s, env and tool time,
        tool calls, finish reasons)."""
        finish = {f"finish_{k}": v for k, v in sorted(self.episodes.finish_counts.items())}
        inflight = {
            k: getattr(self.engine, k)
            for k in ("inflight_updates", "inflight_recompute_s")
            if hasattr(self.engine, k)
        }
        rewards = {f"reward/{k}": v for k, v in sorted(self.rewards.stats.items())}
        return {**self.stats, **self.episodes.stats, **finish, **inflight, **rewards}


def generation_request(
    actor: ActorConfig, prompt_tokens: Sequence[int], group_size: int, eos_id: int, seed: int
) -> GenerationRequest:
    """A single-turn request: `group_size` samples of a prompt under the actor's settings (what
    the episode runner asks for a credit's first turn; bench/engine.py's bare engine too)."""
    return GenerationRequest(
        prompt_tokens=prompt_tokens,
        n=group_size,
        temperature=actor.temperature,
        top_p=actor.top_p,
        max_new_tokens=actor.max_new_tokens,
        stop_token_ids=(eos_id,),
        seed=seed,
    )
