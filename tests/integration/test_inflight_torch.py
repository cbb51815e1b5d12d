"""In-flight weight updates in the torch engine: new weights between two decoding steps.

The engine calls `between_steps` after each sampled token; here it loads another model's
weights after the k-th token. Every token must record the version that produced it, and its
behaviour logprob must be exactly that version's (a plain forward pass of the model holding
those weights, over the prompt and the tokens before it): the KV cache is recomputed after an
update, never mixed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from token_checks import plain_logprobs
from transformers import AutoModelForCausalLM

from actors.engines.base import GenerationRequest
from actors.engines.torch_engine import TorchEngine
from asyncrl.config import ModelConfig, TaskConfig

PROMPTS = ("3141:", "27:", "98765432:")


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny model of the same shape, other weights (the "new version")."""
    from asyncrl.models.tiny import ensure_model

    cache = tmp_path_factory.mktemp("other")
    return ensure_model(ModelConfig(cache_dir=str(cache), init_seed=7), TaskConfig())


@pytest.mark.parametrize("swap_after", [1, 3])
def test_tokens_after_an_update_come_from_the_new_version(
    tiny_model_dir: Path, other_model_dir: Path, swap_after: int
) -> None:
    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(other_model_dir, dtype=torch.float32).eval()
    new_weights = [(n, p.detach().clone()) for n, p in new.named_parameters()]
    engine = TorchEngine(tiny_model_dir, seed=0)
    engine.load_weights(engine.named_weights(), policy_version=5)
    steps = []

    def between() -> None:
        steps.append(len(steps))
        if len(steps) == swap_after:
            engine.load_weights(new_weights, policy_version=6)

    engine.between_steps = between
    requests = [
        GenerationRequest(
            prompt_tokens=engine.encode(p), n=2, max_new_tokens=8, stop_token_ids=(), seed=i
        )
        for i, p in enumerate(PROMPTS)
    ]
    results = engine.generate(requests)
    assert engine.inflight_updates == 1 and engine.policy_version == 6
    for request, samples in zip(requests, results, strict=True):
        prompt = list(request.prompt_tokens)
        for sample in samples:
            assert len(sample.completion_tokens) == 8
            assert sample.versions is not None and sample.policy_version == 5
            expected_versions = [5] * swap_after + [6] * (8 - swap_after)
            assert sample.versions.tolist() == expected_versions
            for version, model in ((5, old), (6, new)):
                at = sample.versions == version
                lps = plain_logprobs(model, prompt, sample.completion_tokens)
                np.testing.assert_allclose(sample.logprobs[at], lps[at], atol=1e-3)
            wrong = plain_logprobs(old, prompt, sample.completion_tokens)[swap_after:]
            assert np.abs(wrong - sample.logprobs[swap_after:]).max() > 1e-2  # not the old one
    engine.between_steps = None
    (again,) = engine.generate(requests[:1])
    assert again[0].versions is None and again[0].policy_version == 6
    engine.close()


def test_rows_that_stopped_before_the_update_keep_one_version(tiny_model_dir: Path) -> None:
    engine = TorchEngine(tiny_model_dir, seed=0)
    weights = engine.named_weights()
    calls = []

    def between() -> None:
        calls.append(1)
        if len(calls) == 2:
            engine.load_weights(weights, policy_version=1)

    engine.between_steps = between
    short = GenerationRequest(prompt_tokens=engine.encode("5:"), n=1, max_new_tokens=2, seed=1)
    long = GenerationRequest(prompt_tokens=engine.encode("55:"), n=1, max_new_tokens=6, seed=2)
    (s,), (lg,) = engine.generate([short, long])
    assert s.token_versions().tolist() == [0, 0]
    assert lg.token_versions().tolist() == [0, 0, 1, 1, 1, 1]  # updated after its 2nd token
    engine.close()


def test_a_trajectory_spanning_two_versions_is_weighted_token_by_token(
    tiny_model_dir: Path, other_model_dir: Path
) -> None:
    """Through the wire and the learner: with the learner at the new version, the importance
    weight π_prox/μ is 1 on the tokens the new version sampled and not on the older ones."""
    from asyncrl.config import LossConfig
    from asyncrl.protocol.codec import decode, encode
    from asyncrl.protocol.messages import Group, Trajectory
    from learner.losses import policy_loss
    from learner.step import collate, token_logprobs

    new = AutoModelForCausalLM.from_pretrained(other_model_dir, dtype=torch.float32).eval()
    engine = TorchEngine(tiny_model_dir, seed=0)
    swapped = []

    def between() -> None:
        if not swapped:
            swapped.append(1)
            engine.load_weights([(n, p.detach().clone()) for n, p in new.named_parameters()], 1)

    engine.between_steps = between
    prompt = engine.encode("3141:")
    (samples,) = engine.generate(
        [GenerationRequest(prompt_tokens=prompt, n=4, max_new_tokens=6, stop_token_ids=(), seed=3)]
    )
    trajectories = []
    for s in samples:
        spans = (0, 0, 1, 1)  # the first token from version 0, the rest from version 1
        assert s.token_versions().tolist() == [0, 1, 1, 1, 1, 1]
        trajectories.append(
            Trajectory(
                tokens=np.concatenate([np.asarray(prompt, np.int32), s.completion_tokens]),
                prompt_len=len(prompt),
                loss_mask=np.ones(6, np.uint8),
                behavior_logprobs=s.logprobs,
                reward=1.0,
                min_policy_version=0,
                max_policy_version=1,
                finish_reason="length",
                version_spans=spans,
            )
        )
    group = Group.build(
        group_id="g", prompt_id="p", credit_id=0, actor_id="a", seq=0, trajectories=trajectories
    )
    group = decode(encode(group))
    assert group.trajectories()[0].token_versions().tolist() == [0, 1, 1, 1, 1, 1]
    batch = collate([group], pad_id=0)
    with torch.no_grad():
        prox, _ = token_logprobs(new, batch, 1.0)
    weights = torch.exp(prox - batch.behavior_logprobs)
    np.testing.assert_allclose(weights[:, 1:].numpy(), 1.0, atol=2e-3)
    assert (weights[:, 0] - 1.0).abs().max() > 1e-2
    cfg = LossConfig(name="decoupled_ppo")
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    _, stats = policy_loss(prox, prox, batch.behavior_logprobs, advantages, batch.mask, cfg)
    assert stats["is_weight_max"] == pytest.approx(float(weights.max()), rel=1e-4)
    engine.close()
