"""Helpers shared by the token-level tests of the engines and the episode runner."""

from __future__ import annotations

import numpy as np
import torch
from transformers import PreTrainedModel

from actors.episodes import EpisodeGroup
from asyncrl.protocol.messages import Group, Trajectory


def plain_logprobs(model: PreTrainedModel, context: list[int], tokens: np.ndarray) -> np.ndarray:
    """Log-probs of `tokens` after `context` from one plain forward pass (temperature 1)."""
    ids = torch.tensor([context + tokens.tolist()])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(context) - 1 : -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.as_tensor(tokens, dtype=torch.long)[:, None])[:, 0].numpy()


def episode_group(group: EpisodeGroup, group_id: str = "g") -> Group:
    """The wire group of finished episodes (what an actor would push for them)."""
    trajectories = []
    for ep in group.episodes:
        tokens, mask, logprobs = ep.trajectory()
        trajectories.append(
            Trajectory(
                tokens=tokens,
                prompt_len=len(ep.prompt),
                loss_mask=mask,
                behavior_logprobs=logprobs,
                reward=ep.reward,
                min_policy_version=0,
                max_policy_version=0,
                finish_reason=ep.finish_reason,
                num_turns=ep.num_turns,
            )
        )
    return Group.build(
        group_id=group_id,
        prompt_id=group.row.prompt_id,
        credit_id="c",
        actor_id="a",
        seq=0,
        trajectories=trajectories,
    )
