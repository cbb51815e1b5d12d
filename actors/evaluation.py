"""Evaluation by an actor: generate the held-out prompts at a known policy version and score them
with the task's reward, outside the training stream (nothing here makes a Group or spends a
credit).

```
  hub ──EvalRequest──> [I/O thread] pending.append ──> actor loop, at a round boundary:
        ActorEvaluator.poll(): weights >= request.policy_version? -> evaluate() -> EvalResult ──> hub
```

`evaluate` is also what `asyncrl eval CHECKPOINT` runs (tools/eval.py), on an engine loaded
from the checkpoint: the same requests, the same seeds, the same scoring. Temperature 0 is
greedy (a top-p nucleus of one token, so every engine can do it). An actor whose weights are
older than the version asked for keeps the request until they arrive; the hub sends it to
another actor if that takes longer than eval.timeout_s.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from actors.engines.base import Engine, GenerationRequest
from asyncrl.evaluation import sampling
from asyncrl.protocol import EvalRequest, EvalResult

Score = Callable[[str, str, dict[str, Any]], tuple[float, str]]
"""(prompt, completion text, info) -> (reward, failure reason or "")."""


def evaluate(engine: Engine, tokenizer: Any, score: Score, request: EvalRequest,
             actor_id: str) -> EvalResult:  # fmt: skip
    """Generate `num_samples` completions per held-out prompt with the engine's current weights
    and score each one."""
    policy_version = engine.policy_version
    temperature, top_p = sampling(request.temperature)
    eos = (int(tokenizer.eos_token_id),)
    requests = [GenerationRequest(prompt_tokens=tokenizer(item.prompt)["input_ids"],
                                  n=request.num_samples, temperature=temperature, top_p=top_p,
                                  max_new_tokens=request.max_new_tokens, stop_token_ids=eos,
                                  seed=item.seed) for item in request.items]  # fmt: skip
    start = time.perf_counter()
    outputs = engine.generate(requests) if requests else []
    generate_s = time.perf_counter() - start
    flat = [s for samples in outputs for s in samples]
    texts = tokenizer.batch_decode([s.completion_tokens.tolist() for s in flat],
                                   skip_special_tokens=False)  # fmt: skip
    texts_iter = iter(texts)
    rewards: list[float] = []
    failed: list[str] = []
    for item, samples in zip(request.items, outputs, strict=True):
        for _ in samples:
            reward, why = score(item.prompt, next(texts_iter), item.info)
            rewards.append(reward)
            failed.append(why)
    return EvalResult(eval_id=request.eval_id, actor_id=actor_id, policy_version=policy_version,
                      requested_version=request.policy_version,
                      num_samples=request.num_samples, pass_threshold=request.pass_threshold,
                      prompt_ids=[item.prompt_id for item in request.items], rewards=rewards,
                      lengths=[len(s.completion_tokens) for s in flat],
                      finish_reasons=[s.finish_reason for s in flat], reward_failed=failed,
                      generate_s=generate_s)  # fmt: skip


class ActorEvaluator:
    """Takes the hub's evaluation requests (on the connection's thread) and runs them on the
    actor's loop, between generation rounds."""

    def __init__(self, actor: Any, score: Score) -> None:
        self.actor = actor
        self.score = score
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
            result = evaluate(engine, self.actor.tokenizer, self.score, request,
                              self.actor.actor_id)  # fmt: skip
            self.actor.conn.send(result)
            self.num_done += 1
        self.pending.extendleft(reversed(waiting))


def verifier_score(verifier: Any) -> Score:
    """A `Score` from the actor's task verifier (actors/rewards: never raises)."""
    from actors.rewards.base import safe_score

    def score(prompt: str, completion: str, info: dict[str, Any]) -> tuple[float, str]:
        result = safe_score(verifier, prompt, completion, info)
        return result.reward, result.failed

    return score
