"""The rollout actor: credits in, scored and versioned groups out, new weights swapped in.

```
   hub --Credits--------> [I/O thread] --inbox--> main loop (this file)
   hub --WeightsAnnounce> [I/O thread] --> WeightReceiver thread (gloo/nccl, buckets)
                                                    |
   main loop, once per generation round:            v  (newest complete version)
     1. swap in received weights  <---------- receiver.poll()   -> WeightsLoaded to hub
     2. take every credit held (<= actor.concurrency groups)
     3. engine.generate(one request per credit, n = group_size)
     4. score each sample with the task's verifier (a failing verifier marks the sample)
     5. push one Group per credit, stamped with the engine's policy_version
   back-pressure: the hub grants credits only as admission allows (η, learner version), so
   with a small η the actor waits here instead of producing samples that would be dropped.
```

Weights are only swapped between generation rounds, so every sample of a round carries
min_policy_version == max_policy_version == the engine's version during that round.
SIGTERM finishes the current round, pushes it, returns unused credits and says Bye.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from actors.engines.base import Engine, GenerationRequest, Sample
from actors.rewards.base import RewardResult, Verifier, safe_score
from asyncrl.config import ActorConfig, RunConfig, load_config
from asyncrl.protocol import (
    CreditItem,
    CreditReturn,
    Credits,
    Error,
    Group,
    Trajectory,
    WeightsAnnounce,
    WeightsLoaded,
)
from asyncrl.transport import HubConnection
from asyncrl.weights.digest import digest_named_tensors


class Actor:
    """One rollout actor process: a hub connection, an engine, a verifier, a weight receiver."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        actor_id: str,
        conn: HubConnection,
        engine: Engine,
        tokenizer: Any,
        verifier: Verifier,
        receiver: Any | None = None,
    ) -> None:
        self.cfg = cfg
        self.actor_id = actor_id
        self.conn = conn
        self.engine = engine
        self.tokenizer = tokenizer
        self.verifier = verifier
        self.receiver = receiver
        self.stop_event = threading.Event()
        self.pending: list[CreditItem] = []
        self.group_size = cfg.actor.group_size
        self.seq = 0
        self.stats: dict[str, float] = {
            "groups_pushed": 0,
            "samples": 0,
            "tokens": 0,
            "wait_credit_s": 0.0,
            "generate_s": 0.0,
            "reward_s": 0.0,
            "weights_loaded": 0,
            "weights_load_s": 0.0,
            "reward_failures": 0,
        }
        self.eos_id = int(tokenizer.eos_token_id)
        if receiver is not None:
            conn.on(WeightsAnnounce, self.on_announce)

    def on_announce(self, msg: WeightsAnnounce) -> None:
        """On the I/O thread: hand the rendezvous to the receiver (a bad one is reported)."""
        assert self.receiver is not None
        try:
            self.receiver.on_announce(msg.announcement)
        except ValueError as exc:
            print(f"[{self.actor_id}] refused weights v{msg.policy_version}: {exc}", flush=True)

    # --- the main loop ------------------------------------------------------------------------

    def run(self, max_groups: int = 0) -> None:
        """Generate until stopped (or `max_groups` pushed, for tests and benchmarks)."""
        while not self.stop_event.is_set():
            self.swap_weights()
            credits = self.take_credits()
            if not credits:
                continue
            groups = self.rollout(credits)
            for group in groups:
                self.conn.send(group)
            self.stats["groups_pushed"] += len(groups)
            if max_groups and self.stats["groups_pushed"] >= max_groups:
                break
        self.return_credits()

    # --- named steps --------------------------------------------------------------------------

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

    def take_credits(self, timeout_s: float = 0.2) -> list[CreditItem]:
        """Drain the inbox; return every credit held (waiting briefly when there is none)."""
        start = time.perf_counter()
        deadline = start + timeout_s
        while True:
            wait = max(0.0, deadline - time.perf_counter()) if not self.pending else 0.0
            msg = self.conn.recv(timeout_s=wait)
            if msg is None:
                break
            self.handle(msg)
        self.stats["wait_credit_s"] += time.perf_counter() - start if not self.pending else 0.0
        credits, self.pending = self.pending, []
        return credits

    def handle(self, msg: Any) -> None:
        """Anything the hub sends that is not a weight announcement."""
        if isinstance(msg, Credits):
            self.group_size = msg.group_size
            self.pending.extend(msg.items)
        elif isinstance(msg, Error):
            print(
                f"[{self.actor_id}] hub refused a message: {msg.code} {msg.field}: {msg.detail}",
                flush=True,
            )

    def rollout(self, credits: Sequence[CreditItem]) -> list[Group]:
        """Generate, score and package one group per credit."""
        policy_version = self.engine.policy_version
        requests = [self.request_for(c) for c in credits]
        start = time.perf_counter()
        outputs = self.engine.generate(requests)
        gen_s = time.perf_counter() - start
        self.stats["generate_s"] += gen_s
        groups = []
        for credit, request, samples in zip(credits, requests, outputs, strict=True):
            groups.append(self.make_group(credit, request, samples, policy_version, gen_s))
        return groups

    def request_for(self, credit: CreditItem) -> GenerationRequest:
        prompt_tokens = self.tokenizer(credit.prompt)["input_ids"]
        return generation_request(
            self.cfg.actor, prompt_tokens, self.group_size, self.eos_id, credit.seed
        )

    def make_group(
        self,
        credit: CreditItem,
        request: GenerationRequest,
        samples: Sequence[Sample],
        policy_version: int,
        gen_s: float,
    ) -> Group:
        start = time.perf_counter()
        prompt = np.asarray(request.prompt_tokens, dtype=np.int32)
        trajectories = []
        for i, sample in enumerate(samples):
            result = self.score(credit, sample)
            completion = np.asarray(sample.completion_tokens, dtype=np.int32)
            trajectories.append(
                Trajectory(
                    tokens=np.concatenate([prompt, completion]),
                    prompt_len=int(prompt.shape[0]),
                    loss_mask=np.ones(completion.shape[0], dtype=np.uint8),
                    behavior_logprobs=np.asarray(sample.logprobs, dtype=np.float32),
                    reward=result.reward,
                    min_policy_version=policy_version,
                    max_policy_version=policy_version,
                    finish_reason=sample.finish_reason,
                    trajectory_id=f"{self.actor_id}/{self.seq}/{i}",
                    reward_failed=result.failed,
                )
            )
            self.stats["tokens"] += int(completion.shape[0])
        reward_s = time.perf_counter() - start
        self.stats["reward_s"] += reward_s
        self.stats["samples"] += len(samples)
        group = Group.build(
            group_id=f"{self.actor_id}/{self.seq}",
            prompt_id=credit.prompt_id,
            credit_id=credit.credit_id,
            actor_id=self.actor_id,
            seq=self.seq,
            trajectories=trajectories,
            timings={"generate_s": gen_s, "reward_s": reward_s},
        )
        self.seq += 1
        return group

    def score(self, credit: CreditItem, sample: Sample) -> RewardResult:
        text = self.tokenizer.decode(sample.completion_tokens, skip_special_tokens=False)
        result = safe_score(self.verifier, credit.prompt, text, credit.info)
        if result.failed:
            self.stats["reward_failures"] += 1
        return result

    def return_credits(self) -> None:
        """Hand back credits that will not be used (shutdown), so their prompts are re-issued."""
        msg = self.conn.recv(timeout_s=0.0)
        while msg is not None:
            self.handle(msg)
            msg = self.conn.recv(timeout_s=0.0)
        if self.pending:
            self.conn.send(CreditReturn(credit_ids=[c.credit_id for c in self.pending]))
            self.pending = []


def generation_request(
    actor: ActorConfig, prompt_tokens: Sequence[int], group_size: int, eos_id: int, seed: int
) -> GenerationRequest:
    """The engine request of one credit: `group_size` samples under the actor's settings."""
    return GenerationRequest(
        prompt_tokens=prompt_tokens,
        n=group_size,
        temperature=actor.temperature,
        top_p=actor.top_p,
        max_new_tokens=actor.max_new_tokens,
        stop_token_ids=(eos_id,),
        seed=seed,
    )


# --- process entry point ----------------------------------------------------------------------


def build_engine(cfg: RunConfig, model_dir: Path, seed: int) -> Engine:
    """The engine named by `actor.engine`, loading `model_dir`."""
    if cfg.actor.engine == "torch":
        from actors.engines.torch_engine import TorchEngine

        return TorchEngine(model_dir, dtype=cfg.model.dtype, seed=seed)
    from actors.engines.vllm_engine import VllmEngine

    return VllmEngine(
        model_dir, dtype=cfg.model.dtype, seed=seed, kv_cache_gib=cfg.actor.vllm_kv_cache_gib
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl actor", description="Run one rollout actor.")
    p.add_argument("--config", required=True, help="run config TOML")
    p.add_argument("--hub", required=True, help="hub endpoint, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--engine", choices=["torch", "vllm"], help="overrides actor.engine")
    p.add_argument("--actor-id", default=f"actor-{os.getpid()}", help="unique name of this actor")
    p.add_argument("--index", type=int, default=0, help="actor index (seed offset)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    p.add_argument(
        "--status-file", default="", help="JSON written at exit: stats, version, weights digest"
    )
    p.add_argument("--max-groups", type=int, default=0, help="stop after pushing this many groups")
    return p.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    """`asyncrl actor`: connect to the hub and generate until SIGTERM."""
    args = parse_args(argv)
    overrides = list(args.set) + ([f"actor.engine={args.engine}"] if args.engine else [])
    cfg = load_config(args.config, overrides)
    from transformers import AutoTokenizer

    from actors.rewards.sort_verifier import make_verifier
    from asyncrl.tiny_model import ensure_model
    from asyncrl.weights.bucket_plan import BucketPlan, params_from_safetensors
    from asyncrl.weights.receiver import WeightReceiver

    model_dir = ensure_model(cfg.model, cfg.task)
    seed = cfg.run.seed + 1000 * (args.index + 1)
    engine = build_engine(cfg, model_dir, seed)
    plan = BucketPlan.from_params(params_from_safetensors(model_dir), cfg.weights.bucket_bytes)
    receiver = WeightReceiver(
        plan, args.actor_id, timeout_s=cfg.weights.timeout_s, backend=cfg.weights.backend
    )
    conn = HubConnection(
        args.hub,
        role="actor",
        client_id=args.actor_id,
        config_hash=cfg.config_hash(),
        concurrency=cfg.actor.concurrency,
        heartbeat_interval_s=cfg.replay.heartbeat_interval_s,
        max_message_bytes=cfg.replay.max_message_bytes,
        hwm=cfg.replay.hwm,
        auth_dir=cfg.replay.auth_dir,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    actor = Actor(
        cfg,
        actor_id=args.actor_id,
        conn=conn,
        engine=engine,
        tokenizer=tokenizer,
        verifier=make_verifier(cfg.task),
        receiver=receiver,
    )
    signal.signal(signal.SIGTERM, lambda *_: actor.stop_event.set())
    signal.signal(signal.SIGINT, lambda *_: actor.stop_event.set())
    conn.start()
    try:
        actor.run(max_groups=args.max_groups)
        actor.swap_weights()  # the last announced weights, if they arrived meanwhile
    finally:
        if args.status_file:
            status = {
                "actor_id": args.actor_id,
                "policy_version": engine.policy_version,
                "weights_digest": digest_named_tensors(engine.named_weights()),
                "stats": actor.stats,
            }
            Path(args.status_file).write_text(json.dumps(status, indent=1))
        conn.close(reason="shutdown")
        receiver.close()
        engine.close()
    return 0
