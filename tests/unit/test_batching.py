"""learner.step's batching: padding columnar groups and scoring them equals per-sample scoring."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.protocol.messages import Group, Trajectory
from learner.step import TrainBatch, collate, pack_shared_prompts, token_logprobs


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


def _shared_group(
    rng: np.random.Generator, group_id: str, prompt_len: int, completion_lens: list[int]
) -> Group:
    """A group as actors make it: every trajectory continues the same prompt."""
    prompt = rng.integers(4, 16, size=prompt_len).astype(np.int32)
    group = _group(rng, group_id, [(prompt_len, c) for c in completion_lens])
    trajs = [
        dataclasses.replace(t, tokens=np.concatenate([prompt, t.tokens[prompt_len:]]))
        for t in group.trajectories()
    ]
    return Group.build(
        group_id=group_id, prompt_id=group_id, credit_id=0, actor_id="a", seq=0, trajectories=trajs
    )


def _mixed_batch() -> list[Group]:
    rng = np.random.default_rng(7)
    return [
        _shared_group(rng, "g0", 5, [3, 6, 1, 4]),  # completions of different lengths
        _shared_group(rng, "g1", 2, [2, 5]),  # a shorter prompt: left-padded to 5
        _group(rng, "g2", [(3, 2), (4, 3)]),  # prompts that differ: one prompt row each
        _shared_group(rng, "g3", 7, [1, 1, 1]),  # the longest prompt, one-token completions
    ]


def test_collate_keeps_each_distinct_prompt_once() -> None:
    batch = collate(_mixed_batch(), pad_id=0)
    assert batch.num_rows == 11
    assert batch.prompt_row.tolist() == [0, 0, 0, 0, 1, 1, 2, 3, 4, 4, 4]
    assert batch.prompt_ids.shape == (5, 7)
    for row in range(batch.num_rows):
        plen, clen = int(batch.prompt_len[row]), int(batch.completion_len[row])
        prompt = batch.prompt_ids[batch.prompt_row[row], :plen]
        assert torch.equal(prompt, batch.input_ids[row, :plen])
        completion = batch.completion_ids[row, :clen]
        assert torch.equal(completion, batch.input_ids[row, plen : plen + clen])


def test_packing_lays_out_prompt_then_completions() -> None:
    batch = collate(_mixed_batch(), pad_id=0)
    packed = pack_shared_prompts(batch, row_tokens=12)
    # g0 (prompt 5; completions 3, 6, 1, 4 -> inputs 2, 5, 0, 3): 5+2+5+0 = 12 fits, then a
    # new row 5+3; g1: 2+1+4; g2: two prompts of its own; g3: 7 and three empty completions
    assert packed.input_ids.shape == (6, 12)
    ids, pos = packed.input_ids[0], packed.position_ids[0]
    assert torch.equal(ids[:5], batch.prompt_ids[0, :5])
    assert torch.equal(ids[5:7], batch.completion_ids[0, :2])
    assert torch.equal(ids[7:12], batch.completion_ids[1, :5])
    assert pos.tolist() == [0, 1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9]
    seen = packed.attention[0, 0]
    assert seen[8].tolist() == [True] * 5 + [False] * 2 + [True, True] + [False] * 3
    assert seen[3].tolist() == [True] * 4 + [False] * 8  # the prompt stays causal
    # completion token k of row 1 is predicted at: the last prompt token, then its own inputs
    assert packed.index[1, :6].tolist() == [4, 7, 8, 9, 10, 11]
    assert packed.index[2].tolist() == [4] * 6  # one token: predicted by the prompt alone
    assert packed.index[3, :4].tolist() == [12 + 4, 12 + 5, 12 + 6, 12 + 7]  # the next row
    pad = packed.attention[-1, 0]  # g3's row: 7 prompt tokens, then padding (seen by none)
    assert pad[9].tolist() == [True] * 7 + [False] * 2 + [True] + [False] * 2
    assert not pad[:7, 7:].any()


def _score(
    model: torch.nn.Module, batch: TrainBatch, share: bool, weights: torch.Tensor, row_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logprobs, entropy = token_logprobs(model, batch, 0.7, share, row_tokens)
    (logprobs * batch.mask * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logprobs.detach() * batch.mask, entropy * batch.mask, grads


@pytest.mark.parametrize(
    ("start", "stop", "row_tokens"), [(0, 11, 256), (0, 11, 9), (2, 7, 256), (4, 10, 8), (8, 11, 1)]
)
def test_shared_prompt_scores_and_gradients_equal_whole_rows(
    tiny_model_dir: Path, start: int, stop: int, row_tokens: int
) -> None:
    batch = collate(_mixed_batch(), pad_id=0)
    rows = batch if (start, stop) == (0, batch.num_rows) else batch.rows(start, stop)
    assert rows.num_prompts < rows.num_rows  # the shared path is the one taken
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
    weights = torch.randn(rows.mask.shape, generator=torch.Generator().manual_seed(start))
    want_lp, want_ent, want_grads = _score(model, rows, False, weights, row_tokens)
    got_lp, got_ent, got_grads = _score(model, rows, True, weights, row_tokens)
    torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_ent, want_ent, atol=1e-5, rtol=1e-5)
    for name, grad in want_grads.items():
        assert torch.isfinite(got_grads[name]).all(), name
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_rows_without_a_shared_prompt_take_one_pass(tiny_model_dir: Path) -> None:
    rng = np.random.default_rng(3)
    batch = collate([_group(rng, "g0", [(3, 2), (4, 3), (2, 4)])], pad_id=0)
    assert batch.num_prompts == batch.num_rows
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    calls: list[int] = []
    hook = model.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        token_logprobs(model, batch, 1.0, share_prompt=True)
    hook.remove()
    assert len(calls) == 1
