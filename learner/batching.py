"""Turning a `Batch` of columnar groups into padded tensors, and scoring them with the model.

Layout: a batch of B trajectories becomes `input_ids` [B, L] (right-padded, L = longest
sequence) and completion-aligned tensors [B, C] (C = longest completion): `behavior_logprobs`,
`mask` (the actor's loss mask, 0 on padding), and `gather_index` — for completion token k of
row b, the position in the shifted logits that predicts it (prompt_len_b - 1 + k).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.protocol import Group


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

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    def rows(self, start: int, stop: int) -> TrainBatch:
        """A contiguous slice of rows (a micro-batch), trimmed to its own longest row."""
        lengths = self.attention_mask[start:stop].sum(dim=1)
        completion = self.mask[start:stop].shape[1]
        seq_len = int(lengths.max())
        return TrainBatch(
            input_ids=self.input_ids[start:stop, :seq_len],
            attention_mask=self.attention_mask[start:stop, :seq_len],
            gather_index=self.gather_index[start:stop, :completion].clamp(max=seq_len - 2),
            mask=self.mask[start:stop],
            behavior_logprobs=self.behavior_logprobs[start:stop],
            rewards=self.rewards[start:stop],
            group_index=self.group_index[start:stop],
            min_policy_version=self.min_policy_version[start:stop],
        )


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
    for row, (_, t) in enumerate(trajs):
        length, plen = int(t.tokens.shape[0]), t.prompt_len
        clen = length - plen
        assert plen >= 1, "a trajectory needs at least one prompt token to condition on"
        input_ids[row, :length] = t.tokens
        attention[row, :length] = 1
        gather[row, :clen] = np.arange(plen - 1, length - 1)
        mask[row, :clen] = t.loss_mask
        behavior[row, :clen] = t.behavior_logprobs
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
    )


def token_logprobs(
    model: torch.nn.Module, batch: TrainBatch, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [B, C] of the completion tokens under `model` (logits / temperature), and the
    per-token entropy [B, C] of that distribution (no gradient)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logits = logits[:, :-1].float() / temperature
    targets = batch.input_ids[:, 1:]
    index = batch.gather_index.clamp(max=logits.shape[1] - 1)
    picked_logits = torch.gather(logits, 1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    logp_all = torch.log_softmax(picked_logits, dim=-1)
    picked_targets = torch.gather(targets, 1, index)
    logprobs = torch.gather(logp_all, 2, picked_targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs, entropy
