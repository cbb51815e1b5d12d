"""Episodes that continue inside one torch-engine call (continuous batching across turns).

A row whose turn ends may go on in the same decoding loop with the environment's tokens
appended (`on_turn` answers `Continue`). Its next turn must be exactly what a fresh request
over the same context, seed and limit would sample: same tokens, and logprobs equal to a plain
forward pass of the model over that context, whatever the other rows do meanwhile (rows end
their turns at different steps, append observations of different lengths, or leave). With an
in-flight weight update in the middle, each token's logprob is that of the version that
sampled it. Through the episode runner, episodes continued in-call equal episodes run turn by
turn (one engine call per turn) token for token, and the learner recomputes their logprobs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from token_checks import episode_group, plain_logprobs
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.engines.base import Continue, GenerationRequest, Sample
from actors.engines.torch_engine import TorchEngine
from actors.envs.base import Observation, Row, Step
from actors.episodes import EpisodeGroup, EpisodeLimits, EpisodeRunner
from asyncrl.config import ModelConfig, TaskConfig
from learner.step import collate, token_logprobs

PROMPTS = ("3141:", "27:", "98765432:")
OBSERVATIONS = ("12:", "4:", "777:")  # appended after a first turn; lengths differ


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl.models.tiny import ensure_model

    cache = tmp_path_factory.mktemp("other")
    return ensure_model(ModelConfig(cache_dir=str(cache), init_seed=7), TaskConfig())


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[TorchEngine]:
    eng = TorchEngine(tiny_model_dir, seed=0)
    yield eng
    eng.close()


class TwoTurns:
    """on_turn: every row's first turn continues with an observation; the second ends it."""

    def __init__(self, engine: TorchEngine, requests: list[GenerationRequest]) -> None:
        self.engine, self.requests = engine, requests
        self.turns: dict[tuple[int, int], list[Sample]] = {}
        self.contexts: dict[tuple[int, int], list[list[int]]] = {}

    def __call__(self, req: int, member: int, sample: Sample) -> Continue | str:
        key = (req, member)
        turns = self.turns.setdefault(key, [])
        contexts = self.contexts.setdefault(key, [list(self.requests[req].prompt_tokens)])
        turns.append(sample)
        if len(turns) == 2:
            return "end"
        obs = self.engine.encode(OBSERVATIONS[(req + member) % 3])[1:]  # no bos
        contexts.append([*contexts[0], *sample.completion_tokens.tolist(), *obs])
        return Continue(tokens=obs, max_new_tokens=3 + member, seed=1000 + 10 * req + member)


def first_turn_requests(engine: TorchEngine) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            prompt_tokens=engine.encode(p), n=2, max_new_tokens=2 + 2 * i, stop_token_ids=(), seed=i
        )
        for i, p in enumerate(PROMPTS)
    ]


def test_a_continued_turn_is_what_a_fresh_request_samples(
    engine: TorchEngine, tiny_model_dir: Path
) -> None:
    requests = first_turn_requests(engine)
    handler = TwoTurns(engine, requests)
    engine.generate(requests, on_turn=handler)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert len(handler.turns) == 6
    for (req, member), (first, second) in handler.turns.items():
        assert len(first.completion_tokens) == requests[req].max_new_tokens
        context = handler.contexts[(req, member)][1]
        (fresh,) = engine.generate(
            [
                GenerationRequest(
                    prompt_tokens=context,
                    n=1,
                    max_new_tokens=3 + member,
                    stop_token_ids=(),
                    seed=1000 + 10 * req + member,
                )
            ]
        )
        np.testing.assert_array_equal(second.completion_tokens, fresh[0].completion_tokens)
        np.testing.assert_allclose(second.logprobs, fresh[0].logprobs, atol=1e-4)
        lps = plain_logprobs(model, context, second.completion_tokens)
        np.testing.assert_allclose(second.logprobs, lps, atol=1e-3)


def test_an_update_while_turns_continue_gives_each_token_its_versions_logprob(
    tiny_model_dir: Path, other_model_dir: Path
) -> None:
    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(other_model_dir, dtype=torch.float32).eval()
    engine = TorchEngine(tiny_model_dir, seed=0)
    steps: list[int] = []

    def between() -> None:
        steps.append(1)
        if len(steps) == 4:  # rows of the first request are in their second turn by then
            engine.load_weights([(n, p.detach().clone()) for n, p in new.named_parameters()], 1)

    engine.between_steps = between
    requests = first_turn_requests(engine)
    handler = TwoTurns(engine, requests)
    engine.generate(requests, on_turn=handler)
    assert engine.inflight_updates == 1
    seen = set()
    for key, turns in handler.turns.items():
        for turn, context in zip(turns, handler.contexts[key], strict=True):
            versions = turn.token_versions()
            seen.update(versions.tolist())
            for version, model in ((0, old), (1, new)):
                at = versions == version
                lps = plain_logprobs(model, context, turn.completion_tokens)
                np.testing.assert_allclose(turn.logprobs[at], lps[at], atol=1e-3)
    assert seen == {0, 1}
    engine.close()


def test_a_bad_verdict_is_refused(engine: TorchEngine) -> None:
    request = GenerationRequest(prompt_tokens=engine.encode("5:"), max_new_tokens=2)
    with pytest.raises(ValueError, match="on_turn: must return Continue"):
        engine.generate([request], on_turn=lambda i, j, s: "again")
    with pytest.raises(ValueError, match="Continue.max_new_tokens"):
        engine.generate([request], on_turn=lambda i, j, s: Continue(tokens=(), max_new_tokens=0))


class Chat:
    """Quick scripted environment: a tool message after each turn, done after `turns`."""

    inline_steps = True

    def __init__(self, turns: int = 3) -> None:
        self.turns, self.seen = turns, 0

    def reset(self, row: Row, seed: int) -> Observation:
        self.seen = 0
        return Observation(text=row.prompt)

    def step(self, model_text: str) -> Step:
        self.seen += 1
        if self.seen >= self.turns:
            return Step(done=True, reward=float(len(model_text) % 2), finish_reason="stop")
        return Step(observation=Observation(text="4" * self.seen + ":"), reward=0.0)


def run_episodes(
    engine: TorchEngine, tok: object, in_call: bool, limits: EpisodeLimits
) -> list[EpisodeGroup]:
    engine.supports_turns = in_call
    try:
        runner = EpisodeRunner(engine, tok, Chat, limits, workers=0)
        assert runner.turns_in_call is in_call
        for i, prompt in enumerate(PROMPTS):
            runner.start(i, Row(prompt_id=f"p{i}", prompt=prompt), seed=50 + i, n=3)
        done: list[EpisodeGroup] = []
        for _ in range(50):
            done += runner.advance()
            if not runner.num_groups:
                runner.close()
                return sorted(done, key=lambda g: g.tag)
        raise AssertionError("episodes did not finish")
    finally:
        engine.supports_turns = True


@pytest.mark.parametrize("max_episode_tokens", [0, 14])
def test_episodes_continued_in_call_equal_episodes_run_turn_by_turn(
    engine: TorchEngine, tiny_model_dir: Path, max_episode_tokens: int
) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    limits = EpisodeLimits(max_turns=4, max_new_tokens=5, max_episode_tokens=max_episode_tokens)
    calls = engine.kv.hits
    in_call = run_episodes(engine, tok, True, limits)
    assert engine.kv.hits == calls  # nothing left the loop to come back
    by_turn = run_episodes(engine, tok, False, limits)
    reasons = set()
    for a, b in zip(in_call, by_turn, strict=True):
        for x, y in zip(a.episodes, b.episodes, strict=True):
            tx, mx, lx = x.trajectory()
            ty, my, ly = y.trajectory()
            np.testing.assert_array_equal(tx, ty)
            np.testing.assert_array_equal(mx, my)
            np.testing.assert_allclose(lx, ly, atol=1e-4)
            assert (x.finish_reason, x.num_turns, x.reward) == (
                y.finish_reason,
                y.num_turns,
                y.reward,
            )
            reasons.add(x.finish_reason)
            if max_episode_tokens:
                assert len(mx) <= max_episode_tokens
            else:
                assert x.num_turns == 3 and x.finish_reason in ("stop", "length")
    if max_episode_tokens:  # the budget ended episodes before their third turn
        assert "length" in reasons and min(ep.num_turns for g in in_call for ep in g.episodes) < 3
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batch = collate([episode_group(g, str(g.tag)) for g in in_call], pad_id=int(tok.pad_token_id))
    with torch.no_grad():
        learner_lps, _ = token_logprobs(model, batch, 1.0, share_prompt=False)
    on = batch.mask.bool()
    np.testing.assert_allclose(
        learner_lps[on].numpy(), batch.behavior_logprobs[on].numpy(), atol=2e-3
    )
