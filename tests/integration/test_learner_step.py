"""The learner's optimizer step: minibatches against a hand-written reference on the real model.

`learner.minibatches = n` splits a batch's rows into n parts, one AdamW step each, all against
π_prox = the policy at the batch's start; n = 1 uses π_prox = π_θ.detach() (no extra forward).
The reference below does the same from the formulas' building blocks (token_logprobs,
group_advantages, policy_loss) on a second copy of the model. One micro-batch per minibatch, so
both compute the same floats: Adam's first steps turn any rounding difference in a near-zero
gradient into a full-size update.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.config import RunConfig, load_config
from asyncrl.protocol.messages import Batch, Group, Trajectory
from asyncrl.transport.connection import HubConnection
from learner.loop import Learner
from learner.losses import policy_loss
from learner.policy_model import make_adamw
from learner.step import collate, group_advantages, token_logprobs


def _group(rng: np.random.Generator, group_id: str, size: int, versions: tuple = (0, 0)) -> Group:
    """`versions` (old, new): each trajectory's first two tokens made by `old`, the rest by
    `new` (an in-flight update) when they differ."""
    trajs = []
    old, new = versions
    spans = (0, old, 2, new) if new != old else ()
    plen, prompt = 4, rng.integers(4, 16, size=4).astype(np.int32)  # one prompt per group
    for _ in range(size):
        clen = int(rng.integers(2, 7))
        tokens = np.concatenate([prompt, rng.integers(4, 16, size=clen).astype(np.int32)])
        trajs.append(
            Trajectory(
                tokens=tokens,
                prompt_len=plen,
                loss_mask=np.ones(clen, np.uint8),
                behavior_logprobs=np.log(rng.uniform(0.03, 0.2, clen)).astype(np.float32),
                reward=float(rng.random()),
                min_policy_version=old,
                max_policy_version=new,
                finish_reason="stop",
                version_spans=spans,
            )
        )
    return Group.build(
        group_id=group_id, prompt_id=group_id, credit_id=0, actor_id="a", seq=0, trajectories=trajs
    )


def _config(model_dir: Path, minibatches: int, loss: str) -> RunConfig:
    return load_config(
        None,
        [
            f"model.path={json.dumps(str(model_dir))}",
            "learner.groups_per_step=2",
            f"learner.minibatches={minibatches}",
            "learner.micro_batch_samples=64",
            "learner.lr=0.01",
            "learner.grad_clip=1.0",
            f"loss.name={loss}",
            "actor.temperature=1.0",
        ],
    )


@pytest.fixture
def make_learner(tiny_model_dir: Path, tmp_path: Path) -> Iterator:
    made: list[Learner] = []

    def make(cfg: RunConfig) -> Learner:
        conn = HubConnection(
            "tcp://127.0.0.1:1", role="learner", client_id="learner", config_hash=cfg.config_hash()
        )  # never started: nothing is sent
        made.append(Learner(cfg, tmp_path / "run", conn, tiny_model_dir))
        return made[-1]

    yield make
    for learner in made:
        learner.publisher.close()


def _reference(
    cfg: RunConfig, model_dir: Path, groups: list[Group], version: int = 0
) -> torch.nn.Module:
    """The step from the formulas; `version` is the one trained (token lags count from it)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = make_adamw(model, cfg.learner.lr, cfg.learner.weight_decay)
    data = collate(groups, pad_id=0)
    share, row_tokens = cfg.learner.share_prompt, cfg.learner.packed_row_tokens
    rewards = [torch.tensor(g.rewards)[None, :] for g in groups]
    advantages = torch.cat([group_advantages(r, std_norm=True)[0] for r in rewards])
    with torch.no_grad():
        start_logprobs, _ = token_logprobs(model, data, 1.0, share, row_tokens)
    parts = cfg.learner.minibatches
    bounds = [round(k * data.num_rows / parts) for k in range(parts + 1)]
    for first, last in zip(bounds, bounds[1:], strict=False):
        rows = data.rows(first, last)
        optimizer.zero_grad(set_to_none=True)
        logprobs, _ = token_logprobs(model, rows, 1.0, share, row_tokens)
        proximal = start_logprobs[first:last] if parts > 1 else logprobs.detach()
        loss, _ = policy_loss(
            logprobs,
            proximal,
            rows.behavior_logprobs,
            advantages[first:last],
            rows.mask,
            cfg.loss,
            num_samples_total=last - first,
            max_tokens=cfg.actor.max_new_tokens,
            num_tokens_total=float(rows.mask.sum()),
            token_lag=version - rows.token_versions,
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.learner.grad_clip)
        optimizer.step()
    return model


@pytest.mark.parametrize(
    ("minibatches", "loss"),
    [(1, "decoupled_ppo"), (2, "decoupled_ppo"), (2, "ppo"), (2, "m2po"), (1, "stale_clip")],
)
def test_minibatch_steps_match_the_reference(
    make_learner: object, tiny_model_dir: Path, minibatches: int, loss: str
) -> None:
    rng = np.random.default_rng(minibatches)
    groups = [_group(rng, "g0", 3), _group(rng, "g1", 3)]
    cfg = _config(tiny_model_dir, minibatches, loss)
    learner = make_learner(cfg)  # type: ignore[operator]
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    stats = learner.optimize(
        Batch(request_id=1, policy_version=0, groups=tuple(groups), dropped_stale=0, wait_s=0.0)
    )
    steps = {int(s["step"]) for s in learner.optimizer.state.values()}
    assert steps == {minibatches}  # one AdamW step per minibatch
    want = dict(_reference(cfg, tiny_model_dir, groups).named_parameters())
    for name, param in learner.model.named_parameters():
        assert not torch.equal(param, before[name]), name
        torch.testing.assert_close(param, want[name], atol=1e-6, rtol=1e-5, msg=name)
    if minibatches > 1 and loss == "decoupled_ppo":
        # the second minibatch's ratio π_θ/π_prox is no longer 1 after the first step
        assert stats["ratio_mean"] != pytest.approx(1.0, abs=1e-7)
    assert np.isfinite(list(stats.values())).all()


def test_stale_clip_clips_each_token_by_its_own_lag(
    make_learner: object, tiny_model_dir: Path
) -> None:
    """Trajectories spanning versions 1 and 3, trained at version 4: lags 3 and 1 per token.
    The learner matches the reference given those lags, and not the one given none."""
    rng = np.random.default_rng(7)
    groups = [_group(rng, "g0", 3, (1, 3)), _group(rng, "g1", 3, (1, 3))]
    cfg = _config(tiny_model_dir, 1, "stale_clip")
    learner = make_learner(cfg)  # type: ignore[operator]
    learner.optimize(Batch(request_id=1, policy_version=4, groups=tuple(groups)))
    want = dict(_reference(cfg, tiny_model_dir, groups, version=4).named_parameters())
    fresh = dict(_reference(cfg, tiny_model_dir, groups, version=3).named_parameters())
    differs = False
    for name, param in learner.model.named_parameters():
        torch.testing.assert_close(param, want[name], atol=1e-6, rtol=1e-5, msg=name)
        differs |= not torch.allclose(param, fresh[name], atol=1e-5, rtol=1e-4)
    assert differs


def test_the_learning_rate_falls_with_the_mean_token_lag(
    make_learner: object, tiny_model_dir: Path
) -> None:
    """Trained at version 4, tokens 0-1 of every trajectory have lag 3 and the rest lag 1;
    with κ = 0.5 the step's rate is lr / (1 + 0.5 ℓ), ℓ the mean over produced tokens."""
    rng = np.random.default_rng(11)
    groups = [_group(rng, "g0", 3, (1, 3)), _group(rng, "g1", 3, (1, 3))]
    lengths = [len(t.tokens) - t.prompt_len for g in groups for t in g.trajectories()]
    mean_lag = sum(3 * 2 + 1 * (n - 2) for n in lengths) / sum(lengths)
    cfg = _config(tiny_model_dir, 1, "decoupled_ppo")
    cfg = dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, lr_staleness_decay=0.5))
    learner = make_learner(cfg)  # type: ignore[operator]
    stats = learner.optimize(Batch(request_id=1, policy_version=4, groups=tuple(groups)))
    rate = 0.01 / (1 + 0.5 * mean_lag)
    assert stats["lr"] == pytest.approx(rate, rel=1e-12)
    same = dataclasses.replace(
        cfg, learner=dataclasses.replace(cfg.learner, lr=rate, lr_staleness_decay=0.0)
    )
    want = dict(_reference(same, tiny_model_dir, groups, version=4).named_parameters())
    for name, param in learner.model.named_parameters():
        torch.testing.assert_close(param, want[name], atol=1e-6, rtol=1e-5, msg=name)


def test_minibatches_beyond_groups_per_step_are_refused(tiny_model_dir: Path) -> None:
    assert _config(tiny_model_dir, 2, "ppo").learner.minibatches == 2
    with pytest.raises(ValueError, match="learner.minibatches"):
        load_config(None, ["learner.groups_per_step=2", "learner.minibatches=3"])
    with pytest.raises(ValueError, match="learner.minibatches"):
        load_config(None, ["learner.minibatches=0"])


def test_wait_actors_s_zero_starts_at_once(
    make_learner: object, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the connection was never started: one Version sent while waiting would raise
    base = _config(tiny_model_dir, 1, "ppo")
    cfg = dataclasses.replace(
        base,
        run=dataclasses.replace(base.run, num_actors=3),
        learner=dataclasses.replace(base.learner, wait_actors_s=0.0),
    )
    learner = make_learner(cfg)  # type: ignore[operator]
    before = learner.start_time
    learner.wait_for_actors(cfg.run.num_actors, cfg.learner.wait_actors_s)
    assert learner.start_time >= before and learner.members == []
    assert capsys.readouterr().out == ""  # nothing said: not waiting is what was asked
    with pytest.raises(ValueError, match="learner.wait_actors_s: must be >= 0"):
        load_config(None, ["learner.wait_actors_s=-1"])
