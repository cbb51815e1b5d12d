"""The rollout actor: credits in, scored and versioned groups out, new weights swapped in.

```
   hub --Credits--------> [I/O thread] --inbox--> main loop (this file)
   hub --WeightsAnnounce> [I/O thread] --> WeightReceiver thread (gloo/nccl, buckets)
                                                    |
   main loop, once per generation round:            v  (newest complete version)
     1. swap in received weights  <---------- receiver.poll()   -> WeightsLoaded to hub
     2. take up to actor.concurrency credits (the window already holds the next round's)
     3. engine.generate(one request per credit, n = group_size)
     4. decode all samples at once, score each with the task's verifier (a failing verifier
        marks the sample), build one columnar Group per credit
     5. push the groups (the I/O thread sends them; acks come back to it)
   back-pressure: the hub grants credits only as admission allows (η, the learner's version and
   the version this actor reported loading), so with a small η the actor waits at 2 instead of
   producing samples that would be dropped; weights arriving meanwhile wake it (1, then 2).
```

The actor asks the hub for `actor.num_window_credits` credits (2 × concurrency by default) but
generates at most `concurrency` groups per round: the next round's credits arrive while the
current round generates, so no hub round trip sits between rounds. Scoring stays on the main
thread on purpose: on a scoring thread it overlapped with generation but competed with it for
the GIL, and the actor loop lost more throughput than it gained (bench/engine.py measures the
loop against the bare engine). Weights are only swapped between rounds, so every sample of a
round carries min_policy_version == max_policy_version == the engine's version during that
round. SIGTERM finishes the current round, pushes it, returns unused credits (their prompts are
re-issued at once) and says Bye; the exit code is 0.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
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
from actors.evaluation import ActorEvaluator, verifier_score
from actors.rewards.base import Verifier, safe_score
from asyncrl.config import ActorConfig, RunConfig, load_config
from asyncrl.metrics import LiveMetrics
from asyncrl.metrics import start as start_metrics
from asyncrl.protocol import (
    CreditItem,
    CreditReturn,
    Credits,
    Error,
    Group,
    WeightsAnnounce,
    WeightsLoaded,
)
from asyncrl.transport import HubConnection
from asyncrl.weights.digest import digest_named_tensors

ACTOR_COUNTERS = ("rounds", "groups_pushed", "samples", "tokens", "wait_credit_s", "generate_s",
                  "reward_s", "weights_loaded", "weights_load_s", "reward_failures",
                  "credits_returned", "wait_weights_s")  # fmt: skip
"""Actor statistics that only grow (exported as Prometheus counters)."""
ROUND_RECORDS = 4096  # rounds whose generate time the status file keeps (the latest ones)


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
            "rounds": 0,
            "groups_pushed": 0,
            "samples": 0,
            "tokens": 0,
            "wait_credit_s": 0.0,
            "generate_s": 0.0,
            "reward_s": 0.0,
            "weights_loaded": 0,
            "weights_load_s": 0.0,
            "reward_failures": 0,
            "credits_returned": 0,
            "wait_weights_s": 0.0,
            "wall_s": 0.0,
        }
        self.round_generate_s: collections.deque[float] = collections.deque(maxlen=ROUND_RECORDS)
        """engine.generate seconds of the latest rounds (their spread feeds the simulator)."""
        self.min_weights_version = 0  # credits need weights at least this new (see run)
        self.live: LiveMetrics | None = None  # the /metrics endpoint, when [metrics] turns it on
        self.evaluator: ActorEvaluator | None = None  # runs the hub's evaluation requests
        self.started = time.perf_counter()
        self.eos_id = int(tokenizer.eos_token_id)
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
        """Generate until stopped (or `max_groups` generated); then swap in the last received
        weights and return the credits left unused."""
        generated = 0
        while not self.stop_event.is_set():
            self.swap_weights()
            if self.evaluator is not None:
                self.evaluator.poll()  # held-out prompts, outside the training stream
            credits = self.take_credits()
            if not credits:
                continue
            self.wait_for_weights()
            for group in self.rollout(credits):
                self.conn.send(group)
                self.stats["groups_pushed"] += 1
            generated += len(credits)
            self.publish_metrics()
            if max_groups and generated >= max_groups:
                break
        self.swap_weights()  # the last announced weights, if they arrived meanwhile
        self.return_credits()  # last: the caller closes the connection (Bye) right after

    # --- named steps --------------------------------------------------------------------------

    def publish_metrics(self) -> None:
        """A snapshot for the live /metrics endpoint (when [metrics] turns it on)."""
        if self.live is None:
            return
        gen_s = self.stats["generate_s"]
        self.live.publish({**self.stats, "policy_version": self.engine.policy_version,
                           "tokens_per_s": self.stats["tokens"] / gen_s if gen_s else 0.0})  # fmt: skip

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
        would only be dropped as stale. The time is reported as `wait_weights_s`. Bounded by weights.timeout_s: if weights do
        not come (a failed broadcast), generate anyway and let the hub's bound decide.
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

    def take_credits(self, timeout_s: float = 0.2) -> list[CreditItem]:
        """Up to `concurrency` held credits; waits (up to timeout_s) only when none is held."""
        self.drain_inbox(0.0)
        if not self.pending:
            start = time.perf_counter()
            self.drain_inbox(timeout_s)
            self.stats["wait_credit_s"] += time.perf_counter() - start
        batch = self.cfg.actor.concurrency
        credits, self.pending = self.pending[:batch], self.pending[batch:]
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
            need = max(0, msg.policy_version - self.cfg.replay.max_staleness)
            need -= need % self.cfg.learner.publish_every  # only these versions are published
            self.min_weights_version = max(self.min_weights_version, need)
        elif isinstance(msg, Error):
            print(
                f"[{self.actor_id}] hub refused a message: {msg.code} {msg.field}: {msg.detail}",
                flush=True,
            )

    def rollout(self, credits: list[CreditItem]) -> list[Group]:
        """One engine call for every credit of the round; then score and package the samples."""
        policy_version = self.engine.policy_version
        requests = [self.request_for(c) for c in credits]
        start = time.perf_counter()
        outputs = self.engine.generate(requests)
        gen_s = time.perf_counter() - start
        self.stats["generate_s"] += gen_s
        self.stats["rounds"] += 1
        self.round_generate_s.append(gen_s)
        return self.make_groups(credits, requests, outputs, policy_version, gen_s)

    def request_for(self, credit: CreditItem) -> GenerationRequest:
        prompt_tokens = self.tokenizer(credit.prompt)["input_ids"]
        return generation_request(
            self.cfg.actor, prompt_tokens, self.group_size, self.eos_id, credit.seed
        )

    def make_groups(
        self,
        credits: Sequence[CreditItem],
        requests: Sequence[GenerationRequest],
        outputs: Sequence[Sequence[Sample]],
        policy_version: int,
        gen_s: float,
    ) -> list[Group]:
        """Score every sample of a round (one batched decode) and build one Group per credit."""
        start = time.perf_counter()
        flat = [s.completion_tokens.tolist() for samples in outputs for s in samples]
        texts = iter(self.tokenizer.batch_decode(flat, skip_special_tokens=False))
        groups = []
        for credit, request, samples in zip(credits, requests, outputs, strict=True):
            completions = [next(texts) for _ in samples]
            groups.append(self.make_group(credit, request, samples, completions, policy_version))
        reward_s = time.perf_counter() - start
        self.stats["reward_s"] += reward_s
        for group in groups:
            group.timings.update(generate_s=gen_s, reward_s=reward_s / len(groups))
        return groups

    def make_group(
        self,
        credit: CreditItem,
        request: GenerationRequest,
        samples: Sequence[Sample],
        completions: Sequence[str],
        policy_version: int,
    ) -> Group:
        """The columnar Group of one credit's samples (no per-sample message objects)."""
        results = [
            safe_score(self.verifier, credit.prompt, text, credit.info) for text in completions
        ]
        prompt = np.asarray(request.prompt_tokens, dtype=np.int32)
        lengths = [len(s.completion_tokens) for s in samples]
        num = len(samples)
        failures = [r.failed for r in results]
        self.stats["reward_failures"] += sum(1 for f in failures if f)
        self.stats["samples"] += num
        self.stats["tokens"] += sum(lengths)
        group_id = f"{self.actor_id}/{self.seq}"
        group = Group(
            group_id=group_id, prompt_id=credit.prompt_id, credit_id=credit.credit_id,
            actor_id=self.actor_id, seq=self.seq,
            trajectory_ids=[f"{group_id}/{i}" for i in range(num)],
            seq_lens=[len(prompt) + n for n in lengths], prompt_lens=[len(prompt)] * num,
            rewards=[r.reward for r in results],
            min_policy_versions=[policy_version] * num,
            max_policy_versions=[policy_version] * num,
            finish_reasons=[s.finish_reason for s in samples], reward_failed=failures,
            tokens=np.concatenate([a for s in samples for a in (prompt, s.completion_tokens)]),
            loss_mask=np.ones(sum(lengths), dtype=np.uint8),
            behavior_logprobs=np.concatenate([s.logprobs for s in samples], dtype=np.float32),
        )  # fmt: skip
        self.seq += 1
        return group

    def return_credits(self) -> None:
        """Hand back credits that will not be used (shutdown), so their prompts are re-issued."""
        self.drain_inbox(0.0)
        if self.pending:
            self.conn.send(CreditReturn(credit_ids=[c.credit_id for c in self.pending]))
            self.stats["credits_returned"] += len(self.pending)
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
    p.add_argument(
        "--max-groups", type=int, default=0, help="stop after generating this many groups"
    )
    return p.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    """`asyncrl actor`: connect to the hub and generate until SIGTERM."""
    args = parse_args(argv)
    stop = threading.Event()  # set by SIGTERM/SIGINT, even while the engine is still starting
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 pid`: stacks to stderr
    overrides = list(args.set) + ([f"actor.engine={args.engine}"] if args.engine else [])
    cfg = load_config(args.config, overrides)
    from transformers import AutoTokenizer

    from actors.rewards.sort_verifier import make_verifier
    from asyncrl.tiny_model import ensure_model
    from asyncrl.weights.bucket_plan import BucketPlan, params_from_safetensors
    from asyncrl.weights.receiver import WeightReceiver

    model_dir = ensure_model(cfg.model, cfg.task)
    engine = build_engine(cfg, model_dir, seed=cfg.run.seed + 1000 * (args.index + 1))
    plan = BucketPlan.from_params(params_from_safetensors(model_dir), cfg.weights.bucket_bytes)
    receiver = WeightReceiver(
        plan, args.actor_id, timeout_s=cfg.weights.timeout_s, backend=cfg.weights.backend
    )
    conn = HubConnection(
        args.hub, role="actor", client_id=args.actor_id, config_hash=cfg.config_hash(),
        concurrency=cfg.actor.num_window_credits,
        heartbeat_interval_s=cfg.replay.heartbeat_interval_s,
        max_message_bytes=cfg.replay.max_message_bytes, hwm=cfg.replay.hwm,
        auth_dir=cfg.replay.auth_dir,
    )  # fmt: skip
    actor = Actor(
        cfg, actor_id=args.actor_id, conn=conn, engine=engine,
        tokenizer=AutoTokenizer.from_pretrained(model_dir), verifier=make_verifier(cfg.task),
        receiver=receiver,
    )  # fmt: skip
    actor.stop_event = stop
    actor.evaluator = ActorEvaluator(actor, verifier_score(actor.verifier))
    if cfg.metrics.actor_port:
        port = cfg.metrics.actor_port + args.index
        actor.live = start_metrics("actor", args.actor_id, port, ACTOR_COUNTERS)
    conn.start()
    try:
        actor.run(max_groups=args.max_groups)
    finally:
        conn.close(reason="shutdown")  # Bye right after the CreditReturn: nothing granted between
        receiver.close()
        if args.status_file:
            write_status(Path(args.status_file), actor)
        engine.close()
    return 0


def write_status(path: Path, actor: Actor) -> None:
    """The actor's final state; the digest is of the weights the engine really holds."""
    actor.stats["wall_s"] = time.perf_counter() - actor.started
    status = {
        "actor_id": actor.actor_id,
        "policy_version": actor.engine.policy_version,
        "weights_digest": digest_named_tensors(actor.engine.named_weights()),
        "stats": actor.stats,
        "round_generate_s": [round(s, 6) for s in actor.round_generate_s],
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(status, indent=1))
    os.replace(tmp, path)  # a reader never sees half a file
