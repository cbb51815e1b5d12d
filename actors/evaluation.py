"""Evaluation by an actor: run the held-out prompts as episodes at a known policy version and
score them with the task's reward (through the task's environment), outside the training stream
(nothing here makes a Group or spends a credit).

```
  hub ──EvalRequest──> [I/O thread] pending.append ──> actor loop, between generation waves:
        ActorEvaluator.poll(): weights >= request.policy_version?
            -> evaluate(): EpisodeRunner of its own (make_env per episode, eval sampling)
               advance() until every episode ended -> rewards, lengths, finish reasons
            -> EvalResult ──> hub
```

`evaluate` is also what `asyncrl eval CHECKPOINT` runs (tools/eval.py), on an engine loaded
from the checkpoint: the same requests, the same seeds, the same environments and scoring.
Temperature 0 is greedy (a top-p nucleus of one token, so every engine can do it). An actor
whose weights are older than the version asked for keeps the request until they arrive; the hub
sends it to another actor if that takes longer than eval.timeout_s. The training episodes in
flight simply wait while an evaluation runs, and in-flight weight updates (actor.weight_update
= in_flight) are held off until it ends: every evaluated sample has the one version logged.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from actors.engines.base import Engine
from actors.envs.base import Env
from actors.envs.data import from_credit
from actors.episodes import EpisodeLimits, EpisodeRunner
from asyncrl.evaluation import sampling
from asyncrl.protocol.messages import EvalRequest, EvalResult


def evaluate(
    engine: Engine,
    tokenizer: Any,
    make_env: Callable[[], Env],
    request: EvalRequest,
    actor_id: str,
    limits: EpisodeLimits,
    workers: int = 0,
) -> EvalResult:
    """Run `num_samples` episodes per held-out prompt with the engine's current weights (the
    task's environment scores each one) and summarize them prompt-major."""
    policy_version = engine.policy_version
    temperature, top_p = sampling(request.temperature)
    limits = replace(
        limits, temperature=temperature, top_p=top_p, max_new_tokens=request.max_new_tokens
    )
    runner = EpisodeRunner(engine, tokenizer, make_env, limits, workers)
    start = time.perf_counter()
    in_flight = getattr(engine, "between_steps", None)
    if in_flight is not None:
        engine.between_steps = None  # type: ignore[attr-defined]  # one version for the eval
    try:
        groups = [
            runner.start(
                i,
                from_credit(item.prompt_id, item.prompt, item.info),
                item.seed,
                request.num_samples,
            )
            for i, item in enumerate(request.items)
        ]
        while runner.num_groups:
            runner.advance()
    finally:
        runner.close()
        if in_flight is not None:
            engine.between_steps = in_flight  # type: ignore[attr-defined]
    generate_s = time.perf_counter() - start
    episodes = [ep for group in groups for ep in group.episodes]
    assert all(ep.max_version <= policy_version for ep in episodes), "weights changed mid-eval"
    return EvalResult(
        eval_id=request.eval_id,
        actor_id=actor_id,
        policy_version=policy_version,
        requested_version=request.policy_version,
        num_samples=request.num_samples,
        pass_threshold=request.pass_threshold,
        prompt_ids=[item.prompt_id for item in request.items],
        rewards=[float(ep.reward) for ep in episodes],
        lengths=[int(ep.trajectory()[1].sum()) for ep in episodes],
        finish_reasons=[ep.finish_reason for ep in episodes],
        reward_failed=[ep.reward_failed for ep in episodes],
        generate_s=generate_s,
    )


class ActorEvaluator:
    """Takes the hub's evaluation requests (on the connection's thread) and runs them on the
    actor's loop, between generation rounds."""

    def __init__(self, actor: Any, make_env: Callable[[], Env]) -> None:
        self.actor = actor
        self.make_env = make_env
        self.pending: collections.deque[EvalRequest] = collections.deque()
        self.num_done = 0
        actor.conn.on(EvalRequest, self.pending.append)

    def poll(self) -> None:
        """Run every pending request the engine's weights are new enough for."""
        engine = self.actor.engine
        waiting: list[EvalRequest] = []
        while self.pending:
            request = self.pending.popleft()
            if engine.policy_version < request.policy_version:
                waiting.append(request)  # the weights asked for are still on their way
                continue
            result = evaluate(
                engine,
                self.actor.tokenizer,
                self.make_env,
                request,
                self.actor.actor_id,
                EpisodeLimits.from_config(self.actor.cfg),
                self.actor.cfg.actor.env_workers,
            )
            self.actor.conn.send(result)
            self.num_done += 1
        self.pending.extendleft(reversed(waiting))
