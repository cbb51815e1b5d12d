"""One optimizer step (or `learner.minibatches` of them) over a batch, on one rank or many:
a `Batch` -> padded tensors -> group-relative advantages -> the loss (learner/losses.py) ->
backward -> AdamW.

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

## Tensors (`collate`, `TrainBatch`)

A batch of B trajectories becomes `input_ids` [B, L] (right-padded, L = longest sequence) and
completion-aligned tensors [B, C] (C = longest completion): `behavior_logprobs`, `mask` (the
actor's loss mask, 0 on padding), and `gather_index` — for completion token k of row b, the
position in the shifted logits that predicts it (prompt_len_b - 1 + k).

The same batch also comes split at the prompt, for scoring with a shared prompt
(`learner.share_prompt`): a group's trajectories all continue one prompt, so the prompt needs
computing once, not once per sample (GRPO samples 8-64 completions a prompt). `prompt_ids`
[U, P] holds each distinct run of equal prompts once, `prompt_row` [B] says which one a row
continues, and `completion_ids` [B, C] the completions. `pack_shared_prompts` lays a prompt and
its completions out in one row, each completion attending to the prompt and causally to itself
only, at the positions it has in its own sequence:

```
  row:        p0 p1 p2 | a0 a1 a2 | b0 b1 | c0 c1 c2 c3 | pad      (completion inputs: all
  positions:   0  1  2 |  3  4  5 |  3  4 |  3  4  5  6 |          but their last token)
  a1 sees:    p0 p1 p2 , a0 a1            (never b or c)
  logits:     p2 predicts token 0 of a, b and c; a_k predicts a_k+1
```
Both ways give the same log-probs and gradients (tests/unit/test_batching.py); the packed way
does the prompt's forward and backward once per row, in one model call. Logprobs are taken
under logits / actor.temperature, the distribution the actors sampled from.

## Advantages (`group_advantages`)

The critic-free baseline of GRPO and Dr.GRPO. The unit of data is a group: all `n` samples
drawn for one prompt. A sample's advantage is its reward minus the mean reward of its group,
optionally divided by the group's standard deviation:

    GRPO     (std_norm=True):   A_ij = (r_ij - mean_j r_i) / (std_j r_i + eps)
    Dr.GRPO  (std_norm=False):  A_ij =  r_ij - mean_j r_i

The standard deviation is the unbiased one (Bessel's correction, `torch.std`), as in TRL and
veRL. A group of one sample has no baseline and gets advantage 0. A group whose rewards are all
equal gets advantage 0 either way (it carries no learning signal; `eps` keeps the division
finite). Advantages are per sequence; `policy_loss` broadcasts them over the sequence's tokens.

## The step (`StepRunner`)

π_prox (DESIGN §5) is the policy at the start of the step. With one optimizer step per batch
(`learner.minibatches` = 1) the parameters every micro-batch's forward pass uses are exactly
those, so π_prox = π_θ.detach() and no second forward pass is needed; with several minibatches
one no-grad forward over the batch computes it first.

With several ranks, minibatch k is the union of every rank's k-th slice of its own rows (with
one minibatch: the whole batch), and the result equals one rank training on the whole batch
(tests/integration/test_learner_world.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from asyncrl.config import LearnerConfig, RunConfig
from asyncrl.protocol.messages import Batch, Group
from learner.losses import NEEDS_PROXIMAL, policy_loss
from learner.parallel import SINGLE, Ranks, all_reduce_stats, comm_device, shard_groups


@dataclass(frozen=True)
class TrainBatch:
    """Padded tensors of one micro- or full batch."""

    input_ids: torch.Tensor  # int64 [B, L]
    attention_mask: torch.Tensor  # int64 [B, L]
    gather_index: torch.Tensor  # int64 [B, C]
    mask: torch.Tensor  # float32 [B, C]
    behavior_logprobs: torch.Tensor  # float32 [B, C]
    rewards: torch.Tensor  # float32 [B]
    group_index: torch.Tensor  # int64 [B]: which group each row belongs to
    min_policy_version: torch.Tensor  # int64 [B]
    token_versions: torch.Tensor  # int64 [B, C]: the policy version behind each completion token
    prompt_ids: torch.Tensor  # int64 [U, P]: each distinct run of equal prompts, right-padded
    prompt_row: torch.Tensor  # int64 [B]: the prompt_ids row that row b continues (ascending)
    prompt_len: torch.Tensor  # int64 [B]
    completion_ids: torch.Tensor  # int64 [B, C]: the completion tokens, right-padded
    completion_len: torch.Tensor  # int64 [B]

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    def rows(self, start: int, stop: int) -> TrainBatch:
        """A contiguous slice of rows (a micro-batch), trimmed to its own longest row."""
        lengths = self.attention_mask[start:stop].sum(dim=1)
        completion = self.mask[start:stop].shape[1]
        seq_len = int(lengths.max())
        first, last = int(self.prompt_row[start]), int(self.prompt_row[stop - 1]) + 1
        prompt_width = int(self.prompt_len[start:stop].max())
        return TrainBatch(
            input_ids=self.input_ids[start:stop, :seq_len],
            attention_mask=self.attention_mask[start:stop, :seq_len],
            gather_index=self.gather_index[start:stop, :completion].clamp(max=seq_len - 2),
            mask=self.mask[start:stop],
            behavior_logprobs=self.behavior_logprobs[start:stop],
            rewards=self.rewards[start:stop],
            group_index=self.group_index[start:stop],
            min_policy_version=self.min_policy_version[start:stop],
            token_versions=self.token_versions[start:stop],
            prompt_ids=self.prompt_ids[first:last, :prompt_width],
            prompt_row=self.prompt_row[start:stop] - first,
            prompt_len=self.prompt_len[start:stop],
            completion_ids=self.completion_ids[start:stop],
            completion_len=self.completion_len[start:stop],
        )

    @property
    def num_prompts(self) -> int:
        return int(self.prompt_ids.shape[0])


def collate(groups: Sequence[Group], pad_id: int) -> TrainBatch:
    """Pad every trajectory of every group into one `TrainBatch` (rows grouped by group)."""
    trajs = [(gi, t) for gi, g in enumerate(groups) for t in g.trajectories()]
    num = len(trajs)
    seq_len = max(int(t.tokens.shape[0]) for _, t in trajs)
    comp_len = max(max(int(t.tokens.shape[0]) - t.prompt_len for _, t in trajs), 1)
    input_ids = np.full((num, seq_len), pad_id, dtype=np.int64)
    attention = np.zeros((num, seq_len), dtype=np.int64)
    gather = np.zeros((num, comp_len), dtype=np.int64)
    mask = np.zeros((num, comp_len), dtype=np.float32)
    behavior = np.zeros((num, comp_len), dtype=np.float32)
    versions = np.zeros((num, comp_len), dtype=np.int64)
    completions = np.full((num, comp_len), pad_id, dtype=np.int64)
    prompt_row = np.zeros(num, dtype=np.int64)
    prompts: list[np.ndarray] = []
    for row, (gi, t) in enumerate(trajs):
        length, plen = int(t.tokens.shape[0]), t.prompt_len
        clen = length - plen
        assert plen >= 1, "a trajectory needs at least one prompt token to condition on"
        input_ids[row, :length] = t.tokens
        attention[row, :length] = 1
        gather[row, :clen] = np.arange(plen - 1, length - 1)
        mask[row, :clen] = t.loss_mask
        behavior[row, :clen] = t.behavior_logprobs
        versions[row, :clen] = t.token_versions()
        completions[row, :clen] = t.tokens[plen:]
        prompt = t.tokens[:plen]
        same = row > 0 and trajs[row - 1][0] == gi and np.array_equal(prompts[-1], prompt)
        if not same:  # rows of one group continue one prompt; anything else gets its own row
            prompts.append(prompt)
        prompt_row[row] = len(prompts) - 1
    prompt_width = max(int(p.shape[0]) for p in prompts)
    prompt_ids = np.full((len(prompts), prompt_width), pad_id, dtype=np.int64)
    for i, prompt in enumerate(prompts):
        prompt_ids[i, : prompt.shape[0]] = prompt
    return TrainBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention),
        gather_index=torch.from_numpy(gather),
        mask=torch.from_numpy(mask),
        behavior_logprobs=torch.from_numpy(behavior),
        rewards=torch.tensor([t.reward for _, t in trajs], dtype=torch.float32),
        group_index=torch.tensor([gi for gi, _ in trajs], dtype=torch.int64),
        min_policy_version=torch.tensor(
            [t.min_policy_version for _, t in trajs], dtype=torch.int64
        ),
        token_versions=torch.from_numpy(versions),
        prompt_ids=torch.from_numpy(prompt_ids),
        prompt_row=torch.from_numpy(prompt_row),
        prompt_len=torch.tensor([t.prompt_len for _, t in trajs], dtype=torch.int64),
        completion_ids=torch.from_numpy(completions),
        completion_len=torch.tensor(
            [int(t.tokens.shape[0]) - t.prompt_len for _, t in trajs], dtype=torch.int64
        ),
    )


@dataclass(frozen=True)
class PackedRows:
    """Prompts and their completions packed into rows (see the module docstring, "Tensors")."""

    input_ids: torch.Tensor  # int64 [R, T]
    position_ids: torch.Tensor  # int64 [R, T]: positions within each sample's own sequence
    attention: torch.Tensor  # bool [R, 1, T, T]: query t may attend to key t'
    index: torch.Tensor  # int64 [B, C]: where in the flattened [R * T] the logits predicting
    #                      completion token k of batch row b are (padding: any valid place)


def pack_shared_prompts(batch: TrainBatch, row_tokens: int) -> PackedRows:
    """Pack each prompt with as many of its completions as fit in `row_tokens` tokens (at least
    one); the next completions start a new row with the prompt again. A completion contributes
    its tokens but the last (nothing is predicted from it)."""
    prompt_row = batch.prompt_row.tolist()
    prompt_len = batch.prompt_len.tolist()
    completion_len = batch.completion_len.tolist()
    rows: list[list[int]] = []  # batch rows packed into each packed row
    lengths: list[int] = []
    for b, (u, plen, clen) in enumerate(zip(prompt_row, prompt_len, completion_len, strict=True)):
        extra = max(clen - 1, 0)
        fits = bool(rows) and prompt_row[rows[-1][0]] == u and lengths[-1] + extra <= row_tokens
        if not fits:
            rows.append([])
            lengths.append(plen)
        rows[-1].append(b)
        lengths[-1] += extra
    width = max(lengths)
    num_rows, num_completion = len(rows), batch.completion_ids.shape[1]
    ids = np.zeros((num_rows, width), dtype=np.int64)  # padding is never attended: any id
    positions = np.zeros((num_rows, width), dtype=np.int64)
    segment = -1 - np.tile(np.arange(width), (num_rows, 1))  # padding: a segment of its own
    index = np.zeros((batch.num_rows, num_completion), dtype=np.int64)
    prompts, completions = batch.prompt_ids.numpy(), batch.completion_ids.numpy()
    for r, members in enumerate(rows):
        plen = prompt_len[members[0]]
        ids[r, :plen] = prompts[prompt_row[members[0]], :plen]
        positions[r, :plen] = np.arange(plen)
        segment[r, :plen] = 0
        index[members, :] = r * width + plen - 1  # the last prompt token predicts token 0
        at = plen
        for seg, b in enumerate(members, start=1):
            extra = max(completion_len[b] - 1, 0)
            ids[r, at : at + extra] = completions[b, :extra]
            positions[r, at : at + extra] = np.arange(plen, plen + extra)
            segment[r, at : at + extra] = seg
            index[b, 1 : 1 + extra] = r * width + np.arange(at, at + extra)
            at += extra
    seg = torch.from_numpy(segment)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same = (seg[:, None, :] == 0) | (seg[:, :, None] == seg[:, None, :])  # [R, query, key]
    return PackedRows(
        input_ids=torch.from_numpy(ids),
        position_ids=torch.from_numpy(positions),
        attention=(same & causal).unsqueeze(1),
        index=torch.from_numpy(index),
    )


def token_logprobs(
    model: torch.nn.Module,
    batch: TrainBatch,
    temperature: float,
    share_prompt: bool = False,
    row_tokens: int = LearnerConfig.packed_row_tokens,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [B, C] of the completion tokens under `model` (logits / temperature), and the
    per-token entropy [B, C] of that distribution (no gradient).

    `share_prompt` packs each distinct prompt with its completions into rows of up to
    `row_tokens` tokens (see the module docstring, "Tensors"); a batch whose rows share no prompt is
    scored the plain way.
    """
    device = next(model.parameters()).device  # batches are built on the CPU
    if share_prompt and batch.num_prompts < batch.num_rows:
        packed = pack_shared_prompts(batch, row_tokens)
        out = model(
            input_ids=packed.input_ids.to(device),
            attention_mask=packed.attention.to(device),
            position_ids=packed.position_ids.to(device),
        ).logits
        logits = out.reshape(-1, out.shape[-1])[packed.index.to(device)]
    else:
        logits = _completion_logits(model, batch, device)
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    targets = batch.completion_ids.to(device).unsqueeze(-1)
    logprobs = torch.gather(logp_all, 2, targets).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs, entropy


def _completion_logits(
    model: torch.nn.Module, batch: TrainBatch, device: torch.device
) -> torch.Tensor:
    """Logits [B, C, V] predicting each completion token, from one pass over whole rows."""
    ids, attention = batch.input_ids.to(device), batch.attention_mask.to(device)
    logits = model(input_ids=ids, attention_mask=attention).logits
    logits = logits[:, :-1]
    index = batch.gather_index.to(device).clamp(max=logits.shape[1] - 1)
    return torch.gather(logits, 1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))


def group_advantages(rewards: Tensor, std_norm: bool, eps: float = 1e-6) -> Tensor:
    """Advantages [G, n] from rewards [G, n] (G groups of n samples each).

    `std_norm=True` is GRPO (centred and scaled by the group's std); False is Dr.GRPO (centred
    only, which avoids up-weighting groups whose rewards barely differ).
    """
    if not isinstance(rewards, Tensor):
        raise ValueError(f"rewards: must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards: must have shape [groups, group_size], got {tuple(rewards.shape)}"
        )
    if not rewards.is_floating_point():
        raise ValueError(f"rewards: must be a floating point tensor, got {rewards.dtype}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards: must be finite (found nan or inf)")
    if eps <= 0:
        raise ValueError(f"eps: must be > 0, got {eps!r}")
    if rewards.shape[1] == 1:
        return torch.zeros_like(rewards)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not std_norm:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


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
