"""Turning a `Batch` of columnar groups into padded tensors, and scoring them with the model.

Layout: a batch of B trajectories becomes `input_ids` [B, L] (right-padded, L = longest
sequence) and completion-aligned tensors [B, C] (C = longest completion): `behavior_logprobs`,
`mask` (the actor's loss mask, 0 on padding), and `gather_index` — for completion token k of
row b, the position in the shifted logits that predicts it (prompt_len_b - 1 + k).

The same batch also comes split at the prompt, for scoring with a shared prompt: a group's
trajectories all continue one prompt, so the prompt needs computing once, not once per sample
(GRPO samples 8-64 completions a prompt). `prompt_ids` [U, P] holds each distinct run of equal
prompts once, `prompt_row` [B] says which one a row continues, and `completion_ids` [B, C] the
completions. `pack_shared_prompts` lays a prompt and its completions out in one row, each
completion attending to the prompt and causally to itself only, at the positions it has in its
own sequence:

```
  row:        p0 p1 p2 | a0 a1 a2 | b0 b1 | c0 c1 c2 c3 | pad      (completion inputs: all
  positions:   0  1  2 |  3  4  5 |  3  4 |  3  4  5  6 |          but their last token)
  a1 sees:    p0 p1 p2 , a0 a1            (never b or c)
  logits:     p2 predicts token 0 of a, b and c; a_k predicts a_k+1
```
Both ways give the same log-probs and gradients (tests/unit/test_batching.py); the packed way
does the prompt's forward and backward once per row, in one model call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.config import LearnerConfig
from asyncrl.protocol.messages import Group


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
    """Prompts and their completions packed into rows (see the module docstring)."""

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
    `row_tokens` tokens (see the module docstring); a batch whose rows share no prompt is
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
