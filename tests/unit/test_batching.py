"""learner.batching: padding columnar groups and scoring them equals per-sample scoring."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from asyncrl.protocol import Group, Trajectory
from learner.batching import collate, token_logprobs


def _group(rng: np.random.Generator, group_id: str, lengths: list[tuple[int, int]]) -> Group:
    trajs = []
    for plen, clen in lengths:
        tokens = rng.integers(4, 16, size=plen + clen).astype(np.int32)
        mask = (rng.random(clen) > 0.2).astype(np.uint8)
        trajs.append(
            Trajectory(
                tokens=tokens,
                prompt_len=plen,
                loss_mask=mask,
                behavior_logprobs=-rng.random(clen).astype(np.float32) * mask,
                reward=float(rng.random()),
                min_policy_version=0,
                max_policy_version=0,
                finish_reason="stop",
            )
        )
    return Group.build(
        group_id=group_id, prompt_id=group_id, credit_id=0, actor_id="a", seq=0, trajectories=trajs
    )


def test_collate_layout_and_logprobs_match_per_sample(tiny_model_dir: Path) -> None:
    rng = np.random.default_rng(0)
    groups = [_group(rng, "g0", [(5, 3), (5, 6)]), _group(rng, "g1", [(3, 1), (7, 4), (2, 5)])]
    batch = collate(groups, pad_id=0)
    assert batch.input_ids.shape == (5, 11)
    assert batch.mask.shape == (5, 6)
    assert batch.group_index.tolist() == [0, 0, 1, 1, 1]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        logprobs, entropy = token_logprobs(model, batch, temperature=0.7)
        row = 0
        for g in groups:
            for t in g.trajectories():
                ids = torch.from_numpy(t.tokens.astype(np.int64))[None]
                logits = model(input_ids=ids).logits[0, :-1] / 0.7
                want = torch.log_softmax(logits, -1)[torch.arange(ids.shape[1] - 1), ids[0, 1:]]
                clen = t.tokens.shape[0] - t.prompt_len
                got = logprobs[row, :clen]
                torch.testing.assert_close(got, want[t.prompt_len - 1 :], atol=1e-5, rtol=1e-5)
                np.testing.assert_array_equal(batch.mask[row, :clen].numpy(), t.loss_mask)
                assert float(batch.mask[row, clen:].sum()) == 0.0
                row += 1
    assert torch.isfinite(entropy).all()


def test_micro_batch_rows_keep_values(tiny_model_dir: Path) -> None:
    rng = np.random.default_rng(1)
    groups = [_group(rng, "g0", [(4, 2), (9, 5), (3, 3)])]
    batch = collate(groups, pad_id=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        full, _ = token_logprobs(model, batch, 1.0)
        part, _ = token_logprobs(model, batch.rows(2, 3), 1.0)
    torch.testing.assert_close(part[0, :3], full[2, :3], atol=1e-5, rtol=1e-5)
