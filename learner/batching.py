"""Turning a `Batch` of columnar groups into padded tensors, and scoring them with the model.

Layout: a batch of B trajectories becomes `input_ids` [B, L] (right-padded, L = longest
sequence) and completion-aligned tensors [B, C] (C = longest completion): `behavior_logprobs`,
`mask` (the actor's loss mask, 0 on padding), and `gather_index` — for completion token k of
row b, the position in the shifted logits that predicts it (prompt_len_b - 1 + k).

The same batch also comes split at the prompt, for scoring with a shared prompt: a group's
trajectories all continue one prompt, so its keys and values need computing once, not once per
sample (GRPO samples 8-64 completions a prompt). `prompt_ids` [U, P] holds each distinct run
of equal prompts once (left-padded), `prompt_row` [B] says which one a row continues, and
`completion_ids` [B, C] the completions (right-padded):

```
  prompt_ids  [U, P] --model, use_cache--> keys/values [U] --select prompt_row--> [B]
                 +-- logits of the last prompt token: predict completion token 0
  completion_ids[:, :-1] [B, C-1] --model, past = those keys/values--> predicts tokens 1..C-1
```
Both ways give the same log-probs and gradients (tests/unit/test_batching.py); the shared way
does the prompt's forward and backward once per group.
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
    prompt_ids: torch.Tensor  # int64 [U, P]: each distinct run of equal prompts, left-padded
    prompt_attention: torch.Tensor  # int64 [U, P]: 0 on the left padding
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
            prompt_ids=self.prompt_ids[first:last, -prompt_width:],
            prompt_attention=self.prompt_attention[first:last, -prompt_width:],
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
        completions[row, :clen] = t.tokens[plen:]
        prompt = t.tokens[:plen]
        same = row > 0 and trajs[row - 1][0] == gi and np.array_equal(prompts[-1], prompt)
        if not same:  # rows of one group continue one prompt; anything else gets its own row
            prompts.append(prompt)
        prompt_row[row] = len(prompts) - 1
    prompt_width = max(int(p.shape[0]) for p in prompts)
    prompt_ids = np.full((len(prompts), prompt_width), pad_id, dtype=np.int64)
    prompt_attention = np.zeros((len(prompts), prompt_width), dtype=np.int64)
    for i, prompt in enumerate(prompts):
        prompt_ids[i, prompt_width - prompt.shape[0] :] = prompt
        prompt_attention[i, prompt_width - prompt.shape[0] :] = 1
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
        prompt_ids=torch.from_numpy(prompt_ids),
        prompt_attention=torch.from_numpy(prompt_attention),
        prompt_row=torch.from_numpy(prompt_row),
        prompt_len=torch.tensor([t.prompt_len for _, t in trajs], dtype=torch.int64),
        completion_ids=torch.from_numpy(completions),
        completion_len=torch.tensor(
            [int(t.tokens.shape[0]) - t.prompt_len for _, t in trajs], dtype=torch.int64
        ),
    )


def token_logprobs(
    model: torch.nn.Module, batch: TrainBatch, temperature: float, share_prompt: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [B, C] of the completion tokens under `model` (logits / temperature), and the
    per-token entropy [B, C] of that distribution (no gradient).

    `share_prompt` scores each distinct prompt once (see the module docstring); a batch whose
    rows share no prompt is scored the plain way, which is then one forward pass instead of two.
    """
    if share_prompt and batch.num_prompts < batch.num_rows:
        logits = _completion_logits_shared(model, batch)
    else:
        logits = _completion_logits(model, batch)
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    targets = batch.completion_ids.unsqueeze(-1)
    logprobs = torch.gather(logp_all, 2, targets).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs, entropy


def _completion_logits(model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    """Logits [B, C, V] predicting each completion token, from one pass over whole rows."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logits = logits[:, :-1]
    index = batch.gather_index.clamp(max=logits.shape[1] - 1)
    return torch.gather(logits, 1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))


def _completion_logits_shared(model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    """Logits [B, C, V] predicting each completion token, the prompts computed once each."""
    prompt_attention = batch.prompt_attention
    positions = (prompt_attention.cumsum(-1) - 1).clamp(min=0)
    width = batch.completion_ids.shape[1]
    prefix = model(
        input_ids=batch.prompt_ids,
        attention_mask=prompt_attention,
        position_ids=positions,
        use_cache=width > 1,
    )
    first = prefix.logits[batch.prompt_row, -1:]  # the last prompt token predicts token 0
    if width == 1:
        return first
    cache = prefix.past_key_values
    cache.batch_select_indices(batch.prompt_row)  # a differentiable gather: gradients add up
    tokens = torch.arange(width - 1)
    completion_attention = (tokens[None, :] < batch.completion_len[:, None]).long()
    rest = model(
        input_ids=batch.completion_ids[:, :-1],
        attention_mask=torch.cat([prompt_attention[batch.prompt_row], completion_attention], dim=1),
        position_ids=batch.prompt_len[:, None] + tokens[None, :],
        past_key_values=cache,
        use_cache=False,
    ).logits
    return torch.cat([first, rest], dim=1)
