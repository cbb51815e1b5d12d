"""One optimizer step (or `learner.minibatches` of them) over a batch, on one rank or many.

```
  Batch (all groups of the step)
    -> this rank's groups (learner/parallel.py shard_groups; all of them on one rank)
    -> collate -> group-normalised advantages
    -> per minibatch: the global counts (all-reduced) / world -> the loss denominators
                      micro-batches: π_θ logprobs -> loss -> backward (FSDP2 reduce-scatters)
                      padding passes with a zero loss where this rank has fewer micro-batches
                      global grad norm -> clip -> AdamW
    -> step statistics, combined over the ranks
```

π_prox (DESIGN §5) is the policy at the start of the step. With one optimizer step per batch
(`learner.minibatches` = 1) the parameters every micro-batch's forward pass uses are exactly
those, so π_prox = π_θ.detach() and no second forward pass is needed; with several minibatches
one no-grad forward over the batch computes it first. Logprobs are taken under
logits / actor.temperature, the distribution the actors sampled from; with
`learner.share_prompt` each group's prompt is computed once, packed in one row with its
completions (learner/batching.py), for the same log-probs and gradients.

With several ranks, minibatch k is the union of every rank's k-th slice of its own rows (with
one minibatch: the whole batch), and the result equals one rank training on the whole batch
(tests/integration/test_learner_world.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from asyncrl.config import RunConfig
from asyncrl.protocol.messages import Batch
from learner.advantages import group_advantages
from learner.batching import TrainBatch, collate, token_logprobs
from learner.losses import NEEDS_PROXIMAL, policy_loss
from learner.parallel import SINGLE, Ranks, all_reduce_stats, comm_device, shard_groups


class StepRunner:
    """The model, its optimizer and the step math of one learner rank."""

    def __init__(
        self,
        cfg: RunConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        pad_id: int,
        ranks: Ranks = SINGLE,
    ) -> None:
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.pad_id = pad_id
        self.ranks = ranks
        self.version = 0
        """The policy version being trained (the batch's): token lags are counted from it."""

    def optimize(self, batch: Batch) -> dict[str, float]:
        """Train on this rank's share of `batch`; statistics are the step's (all ranks')."""
        first, last = shard_groups(len(batch.groups), self.ranks.rank, self.ranks.world)
        data = collate(batch.groups[first:last], self.pad_id)
        self.version = batch.policy_version
        lr = self.set_learning_rate(data)
        advantages = self.advantages(batch.groups[first:last], data)
        parts = self.cfg.learner.minibatches
        needs = parts > 1 and self.cfg.loss.name in NEEDS_PROXIMAL
        proximal = self.proximal_logprobs(data) if needs else None
        bounds = [round(k * data.num_rows / parts) for k in range(parts + 1)]
        sums: dict[str, float] = {}
        for start, stop in zip(bounds, bounds[1:], strict=False):
            stats = self.minibatch_step(data, advantages, proximal, start, stop)
            for key, value in stats.items():
                if key == "is_weight_max":
                    sums[key] = max(sums.get(key, 0.0), value)
                else:
                    sums[key] = sums.get(key, 0.0) + value * (stop - start) / data.num_rows
        sums["lr"] = lr
        if not self.ranks.distributed:
            return sums
        total_rows = sum(g.size for g in batch.groups)
        return all_reduce_stats(sums, data.num_rows / total_rows, self.ranks.world)

    def minibatch_step(
        self,
        data: TrainBatch,
        advantages: torch.Tensor,
        proximal: torch.Tensor | None,
        first: int,
        last: int,
    ) -> dict[str, float]:
        """One AdamW step over rows [first, last), accumulated over micro-batches."""
        totals = self.global_totals(data.mask[first:last], last - first)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        ranges = self.micro_batches(first, last)
        padding = self.padding_passes(len(ranges))  # before any pass: collectives stay in step
        for start, stop in ranges:
            prox = proximal[start:stop] if proximal is not None else None
            stats = self.micro_step(data.rows(start, stop), advantages[start:stop], prox, totals)
            for key, value in stats.items():
                weight = (stop - start) / max(last - first, 1)
                sums[key] = sums.get(key, 0.0) + (value if key == "loss" else value * weight)
            sums["is_weight_max"] = max(sums.get("is_weight_max", 0.0), stats["is_weight_max"])
        for _ in range(padding):
            start, stop = ranges[0]
            self.micro_step(data.rows(start, stop), advantages[start:stop], None, totals, scale=0.0)
        sums["grad_norm"] = self.clip_gradients()
        self.optimizer.step()
        return sums

    def set_learning_rate(self, data: TrainBatch) -> float:
        """learner.lr / (1 + κ·ℓ) on every parameter group, ℓ = the mean token lag of the step
        (over all ranks), κ = learner.lr_staleness_decay; returns the rate."""
        learner = self.cfg.learner
        lr = learner.lr
        if learner.lr_staleness_decay > 0:
            lag = (self.version - data.token_versions).clamp(min=0).to(torch.float64)
            sums = torch.stack([(lag * data.mask).sum(), data.mask.sum().to(torch.float64)])
            if self.ranks.distributed:
                sums = sums.to(comm_device())
                dist.all_reduce(sums)
                sums = sums.cpu()
            mean_lag = float(sums[0] / sums[1].clamp(min=1.0))
            lr = learner.lr / (1.0 + learner.lr_staleness_decay * mean_lag)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def global_totals(self, mask: torch.Tensor, num_rows: int) -> dict[str, Any]:
        """Loss denominators: the minibatch's counts over all ranks, divided by the world size
        (FSDP2 averages gradients over the ranks; learner/losses.py)."""
        counts = torch.tensor([float(num_rows), float(mask.sum())], dtype=torch.float64)
        if self.ranks.distributed:
            counts = counts.to(comm_device())
            dist.all_reduce(counts)
            counts = counts.cpu()
        world = self.ranks.world
        return {
            "num_samples_total": float(counts[0]) / world,
            "max_tokens": self.cfg.actor.max_new_tokens,
            "num_tokens_total": max(float(counts[1]), 1.0) / world,
        }

    def padding_passes(self, num_passes: int) -> int:
        """How many zero-loss passes this rank adds so every rank runs as many as the busiest."""
        if not self.ranks.distributed:
            return 0
        most = torch.tensor([num_passes], dtype=torch.int64, device=comm_device())
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most.cpu()) - num_passes

    def clip_gradients(self) -> float:
        """Clip to learner.grad_clip by the global norm (over every shard); return the norm."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        full = getattr(norm, "full_tensor", None)
        norm = full() if full is not None else norm  # a DTensor under FSDP2: all ranks' shards
        clip = self.cfg.learner.grad_clip
        if clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
        return float(norm)

    @torch.no_grad()
    def proximal_logprobs(self, data: TrainBatch) -> torch.Tensor:
        """π_prox: log-probs of every row under the parameters at the batch's start."""
        out = torch.empty_like(data.behavior_logprobs)
        ranges = self.micro_batches(0, data.num_rows)
        padding = self.padding_passes(len(ranges))
        for start, stop in ranges:
            rows = data.rows(start, stop)  # keeps the batch's completion width
            out[start:stop] = self.score(rows)[0]
        for _ in range(padding):
            self.score(data.rows(*ranges[0]))
        return out

    def micro_batches(self, first: int, last: int) -> list[tuple[int, int]]:
        """[start, stop) row ranges of at most learner.micro_batch_samples rows."""
        size = self.cfg.learner.micro_batch_samples
        return [(start, min(start + size, last)) for start in range(first, last, size)]

    def micro_step(
        self,
        mb: TrainBatch,
        advantages: torch.Tensor,
        proximal: torch.Tensor | None,
        totals: dict[str, Any],
        scale: float = 1.0,
    ) -> dict[str, float]:
        """Forward, loss and backward of one micro-batch (`scale` 0: a padding pass)."""
        logprobs, entropy = self.score(mb)
        device = logprobs.device  # the model's: the batch was built on the CPU
        mask = mb.mask.to(device)
        loss, stats = policy_loss(
            logprobs,
            logprobs.detach() if proximal is None else proximal.to(device),
            mb.behavior_logprobs.to(device),
            advantages.to(device),
            mask,
            self.cfg.loss,
            token_lag=(self.version - mb.token_versions).clamp(min=0).to(device),
            **totals,
        )
        (loss * scale if scale != 1.0 else loss).backward()
        produced = mask.sum().clamp(min=1.0)
        stats["entropy"] = float((entropy * mask).sum() / produced)
        return stats

    def score(self, rows: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropy [rows, C] of the completions under the current parameters."""
        learner = self.cfg.learner
        return token_logprobs(
            self.model,
            rows,
            self.cfg.actor.temperature,
            learner.share_prompt,
            learner.packed_row_tokens,
        )

    def advantages(self, groups: Any, data: TrainBatch) -> torch.Tensor:
        """Group-normalised advantages, one per row, in collate's row order."""
        out = []
        for g in groups:
            rewards = torch.tensor(g.rewards, dtype=torch.float32)[None, :]
            out.append(group_advantages(rewards, std_norm=self.cfg.loss.adv_std_norm)[0])
        adv = torch.cat(out)
        assert adv.shape[0] == data.num_rows
        return adv
