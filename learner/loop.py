"""The learner: batches in, one optimizer step each, policy_version out, weights published.

```
            SampleRequest(v, groups_per_step)            Version(v+1)
   learner ----------------------------------> hub <------------------ learner
      ^   <---------- Batch (staleness <= η) ---  |  ---- Members ------>   |
      |                                           |                        v
      |   step: collate -> π_θ logprobs -> loss (importance-corrected) -> backward -> AdamW
      |                                                                     |
      +--- publish(v+1): snapshot into staging buffers, return at once; a background thread
           announces through the hub and broadcasts buckets to the actors (gloo | nccl)
   back-pressure: the learner waits for a batch (time logged as wait_data_s); the hub only
   lets actors run (η + v + 1) · groups_per_step groups ahead of what the learner consumed.
```

The optimizer work of a step (π_prox, micro-batches, loss denominators, several ranks) is
learner/step.py's; the process entry point is learner/main.py. `policy_version` counts optimizer
steps and survives `--resume`.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import torch

from asyncrl.config import RunConfig
from asyncrl.metrics import LiveMetrics
from asyncrl.protocol.messages import (
    Batch,
    BatchAck,
    Error,
    Members,
    SampleRequest,
    Version,
    WeightsAnnounce,
)
from asyncrl.transport.connection import HubConnection
from asyncrl.weights.backends import buffer_device
from asyncrl.weights.broadcast import WeightPublisher
from asyncrl.weights.digest import digest_named_tensors
from asyncrl.weights.hf_layout import checkpoint_tensors
from learner.checkpoint import (
    checkpoint_dir,
    is_sharded,
    latest_checkpoint,
    load_checkpoint,
    load_sharded,
    save_checkpoint,
    save_sharded,
)
from learner.metrics_log import MetricsLog, episode_metrics, staleness_histogram, version_metrics
from learner.observe import LearnerObserver
from learner.parallel import SINGLE, Op, Ranks, pack_batch, recv_command, send_command, unpack_batch
from learner.policy_model import load_policy, make_adamw
from learner.publish import ShardedSource, actors_loaded, gather_all, sharded_digest
from learner.step import StepRunner


class Learner:
    """Owns the model, the optimizer, `policy_version` and the weight publisher."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        conn: HubConnection | None,
        model_dir: Path,
        ranks: Ranks = SINGLE,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.conn = conn  # rank 0 only: the other ranks never talk to the hub
        self.model_dir = model_dir
        self.ranks = ranks
        torch.manual_seed(cfg.run.seed)
        self.model, plan, self.pad_id = load_policy(cfg, model_dir, ranks)
        self.optimizer = make_adamw(self.model, cfg.learner.lr, cfg.learner.weight_decay)
        self.runner = StepRunner(cfg, self.model, self.optimizer, self.pad_id, ranks)
        self.policy_version = 0
        self.step = 0
        self.request_id = 0
        self.members: list[str] = []
        self.published_to: list[str] = []  # the members of the last publication
        self.members_changed = False
        self.member_sessions: list[int] = []  # a new session = a restarted actor: publish again
        self.stop_event = threading.Event()
        self.start_time = time.time()
        self.plan = plan
        self.live: LiveMetrics | None = None
        self.obs: LearnerObserver | None = None  # rewards, alarms, trajectories, evals (rank 0)
        self.publisher: WeightPublisher | None = None
        self.source: ShardedSource | None = None
        if ranks.is_leader:
            self.publisher = WeightPublisher(
                plan,
                backend=cfg.weights.backend,
                store_host=cfg.weights.host,
                store_port=0,
                timeout_s=cfg.weights.timeout_s,
                announce=self.announce,
            )
        if ranks.is_leader and ranks.distributed:
            self.source = ShardedSource(plan, self.model, buffer_device(cfg.weights.backend))

    # --- the main loop ------------------------------------------------------------------------

    def train(self, log: MetricsLog) -> None:
        obs = self.obs
        if obs is None:
            raise RuntimeError("Learner.train: set learner.obs (a LearnerObserver) first")
        self.publish()  # actors start from the learner's weights (matters after --resume)
        self.request_batch(self.policy_version)
        while self.step < self.cfg.learner.max_steps and not self.stop_event.is_set():
            batch, wait_s = self.fetch_batch()
            if batch is None:
                break
            if self.step + 1 < self.cfg.learner.max_steps:
                self.request_batch(self.policy_version + 1)  # the hub prepares the next batch now
            start = time.perf_counter()
            obs.before_step(batch)  # a sampled step: logprobs at the starting weights
            metrics = self.optimize(batch)
            step_s = time.perf_counter() - start
            self.policy_version += 1
            self.step += 1
            # trained: logged first, then the hub may forget the batch (a learner dying before
            # the ack gets it again); an ack never covers groups the log does not have
            self.record_trained(batch)
            self.conn.send(BatchAck(request_id=batch.request_id))
            # Members come back asynchronously; fetch_batch re-publishes if they changed
            self.conn.send(Version(policy_version=self.policy_version))
            if self.step % self.cfg.learner.publish_every == 0:
                self.publish()
            row = self.step_metrics(batch, metrics, wait_s, step_s)
            row.update(obs.reward_metrics(batch, row))
            log.log(self.step, row)
            if self.live is not None:  # the /metrics endpoint, when [metrics] turns it on
                self.live.publish({**row, "step": self.step})
            obs.after_step(batch, row)  # alarms (may stop the run), trajectory store
            every = self.cfg.learner.checkpoint_every
            if every and self.step % every == 0:
                self.checkpoint()

    # --- named steps --------------------------------------------------------------------------

    def request_batch(self, policy_version: int) -> None:
        """Ask the hub for the groups of the step that trains at `policy_version`.

        The next step's request is sent before this step's optimizer work (pipelining): the hub
        checks staleness against the version the batch will be trained at, adopts it (versions
        only move forward), and the batch waits in our inbox instead of a round trip.
        """
        self.request_id += 1
        self.conn.send(
            SampleRequest(
                request_id=self.request_id,
                policy_version=policy_version,
                num_groups=self.cfg.learner.groups_per_step,
            )
        )

    def record_trained(self, batch: Batch) -> None:
        """Append the step's groups, as (actor_id, seq), to run_dir/trained_groups.jsonl (the
        provenance of every step; bench/chaos.py checks delivery with it)."""
        ids = [[g.actor_id, g.seq] for g in batch.groups]
        line = json.dumps({"step": self.step, "policy_version": self.policy_version, "groups": ids})
        with open(self.run_dir / "trained_groups.jsonl", "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def fetch_batch(self) -> tuple[Batch | None, float]:
        """Wait for the batch of the outstanding request (or until we are stopped)."""
        start = time.perf_counter()
        next_check = start + 1.0
        while not self.stop_event.is_set():
            msg = self.conn.recv(timeout_s=0.2)
            if isinstance(msg, Batch) and msg.request_id == self.request_id:
                return msg, time.perf_counter() - start
            self.handle_other(msg)
            if time.perf_counter() > next_check:
                # Waiting long: has an actor joined since the last publication? A late joiner
                # holds old weights and (at small η) waits for fresh ones before generating.
                self.conn.send(Version(policy_version=self.policy_version))
                next_check = time.perf_counter() + 1.0
            if self.members_changed:
                self.members_changed = False
                self.publish()
        return None, time.perf_counter() - start

    def optimize(self, batch: Batch) -> dict[str, float]:
        """The step's optimizer work (learner/step.py); with several ranks, rank 0 first hands
        the batch to the others, which train on their share of it."""
        if self.ranks.distributed:
            send_command(Op.TRAIN, pack_batch(batch))
        return self.runner.optimize(batch)

    def report_version(self) -> None:
        """Tell the hub the new version; learn which actors are alive (broadcast members)."""
        self.conn.send(Version(policy_version=self.policy_version))
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            msg = self.conn.recv(timeout_s=0.2)
            if isinstance(msg, Members):
                self.members, self.member_sessions = list(msg.actor_ids), list(msg.sessions)
                self.members_changed = False  # the publication that follows includes them
                return
            self.handle_other(msg)
            if self.stop_event.is_set():
                return  # shutting down (the hub may be gone too): keep the last members
        raise TimeoutError("hub did not answer Version with Members within 10 s")

    def wait_for_actors(self, num_actors: int, timeout_s: float) -> None:
        """Hold the first step until `num_actors` actors are connected (or `timeout_s` passes;
        0 = do not wait).

        Members only come back in answer to Version, so the current version is re-sent every
        half second. Each change in the count is printed. The clock of metrics.jsonl's time_s
        starts when the wait ends.
        """
        deadline = time.monotonic() + timeout_s
        shown = -1
        while timeout_s and len(self.members) < num_actors and not self.stop_event.is_set():
            if len(self.members) != shown:
                shown = len(self.members)
                joined = f" ({', '.join(self.members)})" if self.members else ""
                print(
                    f"learner: waiting for actors: {shown} of {num_actors} connected{joined}",
                    flush=True,
                )
            if time.monotonic() >= deadline:
                print(
                    f"learner: only {shown} of run.num_actors={num_actors} actors connected "
                    f"within learner.wait_actors_s={timeout_s:g} s; starting with them",
                    flush=True,
                )
                break
            time.sleep(0.5)
            self.report_version()
        self.start_time = time.time()

    def publish(self) -> None:
        """Snapshot the weights and hand them to the publisher thread (non-blocking); with
        several ranks, gather and broadcast bucket by bucket now (learner/publish.py)."""
        assert self.publisher is not None
        if self.source is None:
            named = checkpoint_tensors(self.model.named_parameters())  # the actors' layout
            self.publisher.publish(self.policy_version, named, self.members)
        else:
            send_command(Op.PUBLISH)
            buckets = self.source.buckets()
            self.publisher.publish_blocking(self.policy_version, buckets, self.members)
        self.published_to = list(self.members)

    def announce(self, announcement: dict[str, Any]) -> None:
        """Called by the publisher thread: forward the rendezvous to the actors via the hub."""
        self.conn.send(
            WeightsAnnounce(
                policy_version=int(announcement["policy_version"]),
                plan_hash=str(announcement["plan_hash"]),
                announcement=announcement,
            )
        )

    def handle_other(self, msg: Any) -> None:
        if isinstance(msg, Members):
            members, sessions = list(msg.actor_ids), list(msg.sessions)
            changed = members != self.members or sessions != self.member_sessions
            self.members_changed = self.members_changed or changed
            self.members, self.member_sessions = members, sessions
        elif isinstance(msg, Error):
            raise RuntimeError(
                f"hub refused a learner message: {msg.code} {msg.field}: {msg.detail}"
            )

    def step_metrics(
        self, batch: Batch, loss_stats: dict[str, float], wait_s: float, step_s: float
    ) -> dict[str, Any]:
        groups = batch.groups
        staleness = [self.policy_version - 1 - g.min_policy_version for g in groups]
        num_samples = sum(g.size for g in groups)
        completion_tokens = sum(int(g.loss_mask.sum()) for g in groups)
        rewards = [r for g in groups for r in g.rewards]
        elapsed = time.time() - self.start_time
        pub = self.publisher.last_result
        return {
            "policy_version": self.policy_version,
            "time_s": elapsed,
            "reward_mean": sum(rewards) / len(rewards),
            "reward_max": max(rewards),
            "staleness_max": max(staleness),
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_hist": staleness_histogram(staleness, self.cfg.replay.max_staleness),
            "samples": num_samples,
            "samples_per_s": num_samples / max(wait_s + step_s, 1e-9),
            "tokens_per_s": completion_tokens / max(wait_s + step_s, 1e-9),
            "response_len_mean": completion_tokens / num_samples,
            "wait_data_s": wait_s,
            "step_s": step_s,
            "dropped_stale": batch.dropped_stale,
            "weight_sync_s": pub.form_s + pub.broadcast_s if pub else 0.0,
            "weight_snapshot_s": pub.snapshot_s if pub else 0.0,
            "weight_sync_failures": self.publisher.stats.num_failed,
            "num_actors": len(self.members),
            **{k: v for k, v in loss_stats.items() if k != "num_tokens"},
            **episode_metrics(groups),
            **version_metrics(groups, self.policy_version - 1, self.cfg.replay.max_staleness),
        }

    def checkpoint(self) -> Path:
        """Save model, optimizer and run state (every rank writes its shards when sharded)."""
        state = {"policy_version": self.policy_version, "step": self.step}
        path = checkpoint_dir(self.run_dir, self.step)
        if not self.ranks.distributed:
            return save_checkpoint(
                path, self.model, self.optimizer, state, tokenizer_dir=self.model_dir, keep_last=2
            )
        if self.ranks.is_leader:
            send_command(Op.CHECKPOINT, json.dumps(state).encode())
        state["world"] = self.ranks.world
        return save_sharded(
            path,
            self.model,
            self.optimizer,
            state,
            self.model_dir,
            rank=self.ranks.rank,
            keep_last=2,
        )

    def resume(self) -> None:
        """Continue from the run directory's latest checkpoint, at any world size (collective)."""
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            raise ValueError(f"--resume: no checkpoint under {self.run_dir / 'checkpoints'}")
        if is_sharded(ckpt):
            state = load_sharded(ckpt, self.model, self.optimizer)
        elif self.ranks.distributed:
            raise ValueError(
                f"--resume: {ckpt} was written by a single-rank learner (no dcp/ state); "
                "resume it with learner.world = 1"
            )
        else:
            state = load_checkpoint(ckpt, self.model, self.optimizer)
        self.policy_version = int(state["policy_version"])
        self.step = int(state["step"])

    def follow(self) -> None:
        """Ranks > 0: mirror rank 0's collectives until it says STOP."""
        while True:
            op, payload, _ = recv_command()
            if op is Op.TRAIN:
                self.runner.optimize(unpack_batch(payload))
            elif op is Op.PUBLISH:
                gather_all(self.plan, self.model)
            elif op is Op.CHECKPOINT:
                state = json.loads(payload)
                self.policy_version, self.step = state["policy_version"], state["step"]
                self.checkpoint()
            elif op is Op.DIGEST:
                sharded_digest(self.model, leader=False)
            else:
                return

    def finish(self, wait_actors_s: float) -> dict[str, Any]:
        """Final checkpoint, final weights to every actor, and a summary for the run directory.

        The checkpoint comes first, so it is written whatever happens next; when stopping on a
        signal the waits for the actors are kept shorter (15 s at most), and the final
        evaluation (when one is due) is waited for only on a normal finish.
        """
        self.checkpoint()
        stopping = self.stop_event.is_set()
        wait_s = (
            self.cfg.weights.timeout_s if not stopping else min(self.cfg.weights.timeout_s, 15.0)
        )
        self.publisher.wait(timeout=wait_s)
        if not stopping:
            try:  # the actors alive now: one may have joined after the last publication
                self.report_version()
            except TimeoutError as exc:
                print(f"learner: {exc}; final weights go to the last known actors", flush=True)
        unpublished = self.policy_version % self.cfg.learner.publish_every != 0
        if unpublished or self.members != self.published_to:
            self.publish()
            self.publisher.wait(timeout=wait_s)
        loaded = actors_loaded(self.conn, self.policy_version, min(wait_actors_s, wait_s))
        if self.obs is not None and not stopping:
            self.obs.wait_final_eval(self.policy_version, self.cfg.eval.timeout_s)
        return {
            "policy_version": self.policy_version,
            "step": self.step,
            "weights_digest": self.weights_digest(),
            "actors_loaded": loaded,
        }

    def weights_digest(self) -> str:
        """Digest of the full weights (gathered one parameter at a time when sharded)."""
        if not self.ranks.distributed:
            return digest_named_tensors(self.model.named_parameters())
        send_command(Op.DIGEST)
        return sharded_digest(self.model, leader=True)
