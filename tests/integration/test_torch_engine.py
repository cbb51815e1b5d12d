"""TorchEngine against a plain transformers forward pass on the real tiny model.

The engine's logprobs must be those of the distribution it sampled from (temperature, top-p),
survive `load_weights`, not depend on batch neighbours, and be reproducible from seeds.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from actors.engines.base import GenerationRequest, Sample
from actors.engines.torch_engine import TorchEngine, process_logits

PROMPTS = ("3141:", "27:", "98765432:", "0:")


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[TorchEngine]:
    eng = TorchEngine(tiny_model_dir, seed=0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _requests(engine: TorchEngine, **kwargs: object) -> list[GenerationRequest]:
    base = {"n": 4, "max_new_tokens": 8, "stop_token_ids": engine.stop_token_ids}
    return [
        GenerationRequest(prompt_tokens=engine.encode(p), **{**base, **kwargs}) for p in PROMPTS
    ]


def _reference_logprobs(
    model: PreTrainedModel, prompt: Sequence[int], sample: Sample, temperature: float = 1.0
) -> np.ndarray:
    tokens = torch.tensor([list(prompt) + sample.completion_tokens.tolist()])
    with torch.no_grad():
        logits = model(input_ids=tokens).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.as_tensor(sample.completion_tokens, dtype=torch.long)[:, None])[
        :, 0
    ].numpy()


def _assert_parity(
    model: PreTrainedModel,
    requests: list[GenerationRequest],
    results: list[list[Sample]],
    temperature: float = 1.0,
) -> None:
    for req, group in zip(requests, results, strict=True):
        assert len(group) == req.n
        for sample in group:
            assert sample.logprobs.dtype == np.float32
            assert sample.completion_tokens.dtype == np.int32
            expected = _reference_logprobs(model, req.prompt_tokens, sample, temperature)
            np.testing.assert_allclose(sample.logprobs, expected, atol=1e-3)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_plain_forward_pass(
    engine: TorchEngine, reference: PreTrainedModel, temperature: float
) -> None:
    requests = _requests(engine, temperature=temperature)
    _assert_parity(reference, requests, engine.generate(requests), temperature)


def test_top_p_logprobs_are_renormalised_over_the_nucleus(
    engine: TorchEngine, reference: PreTrainedModel
) -> None:
    requests = _requests(engine, top_p=0.3, temperature=0.5)
    for req, group in zip(requests, engine.generate(requests), strict=True):
        for sample in group:
            tokens = list(req.prompt_tokens) + sample.completion_tokens.tolist()
            with torch.no_grad():
                logits = reference(input_ids=torch.tensor([tokens])).logits[0]
            positions = range(len(req.prompt_tokens) - 1, len(tokens) - 1)
            for pos, token, logprob in zip(
                positions, sample.completion_tokens, sample.logprobs, strict=True
            ):
                p = torch.softmax(logits[pos] / 0.5, dim=-1)
                ranked = p.sort(descending=True).values
                keep = int(((ranked.cumsum(0) - ranked) < 0.3).sum())
                assert p[token] >= ranked[keep - 1] - 1e-6  # sampled inside the nucleus
                expected = torch.log(p[token] / ranked[:keep].sum())
                assert logprob == pytest.approx(float(expected), abs=1e-4)


def test_load_weights_changes_logprobs_to_the_new_model(tiny_model_dir: Path) -> None:
    engine = TorchEngine(tiny_model_dir, seed=1)
    perturbed = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in perturbed.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    engine.load_weights(perturbed.named_parameters(), policy_version=5)
    assert engine.policy_version == 5
    requests = _requests(engine)
    results = engine.generate(requests)
    assert all(s.policy_version == 5 for group in results for s in group)
    _assert_parity(perturbed, requests, results)


def test_load_weights_rejects_unknown_or_misshaped_tensors(tiny_model_dir: Path) -> None:
    engine = TorchEngine(tiny_model_dir)
    name, param = next(iter(engine.model.named_parameters()))
    before = param.detach().clone()
    with pytest.raises(ValueError, match="unknown tensor 'nope'"):
        engine.load_weights([(name, before + 1), ("nope", before)], policy_version=1)
    with pytest.raises(ValueError, match=f"{name!r} has shape"):
        engine.load_weights([(name, before[:1])], policy_version=1)
    assert torch.equal(param, before)  # nothing copied when any tensor is rejected
    assert engine.policy_version == 0


def test_batching_prompts_of_different_lengths_matches_one_by_one(engine: TorchEngine) -> None:
    requests = [
        GenerationRequest(
            prompt_tokens=engine.encode(p),
            n=3,
            max_new_tokens=6,
            stop_token_ids=engine.stop_token_ids,
            seed=100 + i,
        )
        for i, p in enumerate(PROMPTS)
    ]
    together = engine.generate(requests)
    for req, group in zip(requests, together, strict=True):
        (alone,) = engine.generate([req])
        for a, b in zip(group, alone, strict=True):
            np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
            assert a.finish_reason == b.finish_reason


def test_same_seed_gives_same_samples(tiny_model_dir: Path) -> None:
    def tokens(engine: TorchEngine) -> list[list[int]]:
        results = engine.generate(_requests(engine))
        return [s.completion_tokens.tolist() for group in results for s in group]

    first, again = TorchEngine(tiny_model_dir, seed=3), TorchEngine(tiny_model_dir, seed=3)
    assert tokens(first) == tokens(again)
    assert tokens(first) != tokens(TorchEngine(tiny_model_dir, seed=4))


def test_finish_reasons_and_stop_tokens(engine: TorchEngine) -> None:
    stop = engine.stop_token_ids
    results = engine.generate(_requests(engine, n=16, max_new_tokens=3))
    samples = [s for group in results for s in group]
    for s in samples:
        assert 1 <= len(s.completion_tokens) == len(s.logprobs) <= 3
        if s.finish_reason == "stop":
            assert s.completion_tokens[-1] in stop
            assert not set(s.completion_tokens[:-1].tolist()) & set(stop)
        else:
            assert len(s.completion_tokens) == 3 and not set(s.completion_tokens.tolist()) & set(
                stop
            )
    no_stop = engine.generate(_requests(engine, n=2, max_new_tokens=5, stop_token_ids=()))
    assert all(len(s.completion_tokens) == 5 for g in no_stop for s in g)


def test_process_logits_is_a_normalised_distribution() -> None:
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    for top_p in (1.0, 0.9, 0.2, 1e-6):
        logp = process_logits(logits, torch.full((5,), 0.8), torch.full((5,), top_p))
        torch.testing.assert_close(logp.exp().sum(dim=-1), torch.ones(5))
    greedy = process_logits(logits, torch.ones(5), torch.full((5,), 1e-6))
    assert ((greedy > float("-inf")).sum(dim=-1) == 1).all()


def test_bad_requests_are_refused(engine: TorchEngine) -> None:
    with pytest.raises(ValueError, match=r"requests\[0\].temperature"):
        engine.generate([GenerationRequest(prompt_tokens=[1, 5], temperature=0.0)])
    with pytest.raises(ValueError, match=r"requests\[0\].prompt_tokens"):
        engine.generate([GenerationRequest(prompt_tokens=[])])
    assert engine.generate([]) == []


def test_a_kept_kv_cache_continues_the_next_turn(
    tiny_model_dir: Path, reference: PreTrainedModel
) -> None:
    """A second request that continues kept caches prefills only its new tokens and samples
    exactly what a plain forward pass over the whole context gives."""
    eng = TorchEngine(tiny_model_dir, seed=0)
    prompts = [eng.encode(p) for p in PROMPTS[:3]]
    first = eng.generate(
        [
            GenerationRequest(
                prompt_tokens=p,
                n=2,
                max_new_tokens=5,
                stop_token_ids=eng.stop_token_ids,
                seed=i,
                cache_keys=(f"{i}a", f"{i}b"),
            )
            for i, p in enumerate(prompts)
        ]
    )
    assert len(eng.kv) == 6
    turn2 = []
    for i, (prompt, samples) in enumerate(zip(prompts, first, strict=True)):
        for key, sample in zip("ab", samples, strict=True):
            context = [*prompt, *sample.completion_tokens.tolist(), *eng.encode("12:")[1:]]
            turn2.append(
                GenerationRequest(
                    prompt_tokens=context,
                    n=1,
                    max_new_tokens=4,
                    seed=10 + i,
                    resume_key=f"{i}{key}",
                    cache_keys=(f"{i}{key}",),
                )
            )
    second = eng.generate(turn2)
    assert eng.kv.hits == 6 and eng.kv.misses == 0 and eng.kv.reused_tokens > 0
    _assert_parity(reference, turn2, second)
    eng.load_weights(eng.named_weights(), policy_version=1)  # new weights: kept caches are stale
    assert len(eng.kv) == 0
    again = eng.generate(turn2[:1])
    assert eng.kv.misses == 1
    _assert_parity(reference, turn2[:1], again)
    eng.close()
