"""Multi-turn episodes on the real tiny model: token in, token out.

A trajectory must be exactly what the engine saw and produced: every model turn's context is
the trajectory up to that turn, its tokens and behaviour log-probs are the engine's own, the
environment's text is tokenized on its own with loss_mask 0, and the learner's recomputed
log-probs on the same weights agree with the behaviour log-probs. Checked under two chat
templates written over the tiny tokenizer's characters: a Llama-3-style one (a header per
message, end-of-turn token after each) and a Qwen-style one (a separator after the end-of-turn
token, and past reasoning stripped from earlier assistant turns when the chat is re-rendered;
re-rendering is exactly what the episode runner never does). Also: seeded episodes repeat, a
slow environment step does not hold up other episodes, and each finish reason is reached.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from token_checks import episode_group
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from actors.engines.base import GenerationRequest, Sample
from actors.engines.torch_engine import TorchEngine
from actors.envs.base import Observation, Row, Step
from actors.episodes import Episode, EpisodeGroup, EpisodeLimits, EpisodeRunner
from asyncrl.config import ModelConfig, TaskConfig
from learner.step import collate, token_logprobs

EXTRA = "?=!<>|SUATX"
ROLE = "{{ {'system': 'S', 'user': 'U', 'assistant': 'A', 'tool': 'T'}[m['role']] }}"
LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}<|" + ROLE + "|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|A|>{% endif %}"
)
QWEN_STYLE = (  # `X` closes reasoning: earlier assistant turns keep only what follows it
    "{% for m in messages %}<" + ROLE + ">"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('X')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}:{% endfor %}"
    "{% if add_generation_prompt %}<A>{% endif %}"
)
TEMPLATES = {"llama3_style": LLAMA3_STYLE, "qwen_style": QWEN_STYLE}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl.models.tiny import ensure_model

    cache = tmp_path_factory.mktemp("models")
    return ensure_model(ModelConfig(cache_dir=str(cache), extra_chars=EXTRA), TaskConfig())


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[TorchEngine]:
    eng = TorchEngine(model_dir, seed=0)
    yield eng
    eng.close()


class Recording:
    """An Engine that remembers every request and what came back (wraps a real one)."""

    def __init__(self, inner: TorchEngine) -> None:
        self.inner = inner
        self.calls: list[tuple[GenerationRequest, list[Sample]]] = []
        self.supports_kv_reuse = True  # the runner keeps each episode's cache between turns

    def release(self, keys: Sequence[str]) -> None:
        self.inner.release(keys)

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        out = self.inner.generate(requests)
        self.calls += list(zip(requests, out, strict=True))
        return out


class Chat:
    """A scripted multi-turn environment: tool messages for two turns, done on the third."""

    def __init__(self, block: threading.Event | None = None, turns: int = 3) -> None:
        self.block, self.turns, self.seen = block, turns, 0

    def reset(self, row: Row, seed: int) -> Observation:
        self.seen = 0
        return Observation(messages=row.messages or ())

    def step(self, model_text: str) -> Step:
        self.seen += 1
        if self.block is not None:
            self.block.wait(timeout=60)
        if self.seen >= self.turns:
            return Step(done=True, reward=float(len(model_text) % 2), finish_reason="stop")
        return Step(observation=Observation(messages=({"role": "tool", "content": "42"},)))


def chat_row(i: int) -> Row:
    messages = ({"role": "system", "content": "7"}, {"role": "user", "content": f"{i}3:"})
    return Row(prompt_id=f"r{i}", messages=messages)


def run_all(runner: EpisodeRunner) -> list[EpisodeGroup]:
    done: list[EpisodeGroup] = []
    for _ in range(200):
        done += runner.advance(wait_s=0.5)
        if not runner.num_groups:
            return done
    raise AssertionError("episodes did not finish in 200 rounds")


def with_template(model_dir: Path, template: str) -> PreTrainedTokenizerFast:
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = template
    return tok


def check_turns(ep: Episode, calls: list[tuple[GenerationRequest, list[Sample]]]) -> None:
    """Each model turn: its context is the trajectory so far; its tokens and log-probs are the
    engine's; loss_mask is 1 on them and 0 on everything the environment added."""
    tokens, mask, logprobs = ep.trajectory()
    plen = len(ep.prompt)
    model_spans = []
    at = plen
    for chunk, lps in ep.chunks:
        if lps is not None:
            model_spans.append((at, chunk, lps))
        at += len(chunk)
    assert len(model_spans) == ep.num_turns >= 1
    for start, chunk, lps in model_spans:
        context = tokens[:start].tolist()
        found = [
            s
            for req, samples in calls
            if list(req.prompt_tokens) == context
            for s in samples
            if np.array_equal(s.completion_tokens, chunk)
        ]
        assert found, "a model turn whose context/tokens the engine never saw"
        np.testing.assert_array_equal(found[0].logprobs, lps)
        assert mask[start - plen : start - plen + len(chunk)].all()
    assert int(mask.sum()) == sum(len(c) for _, c, _ in model_spans)
    np.testing.assert_array_equal(logprobs[mask == 0], 0.0)


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_trajectories_are_the_engines_tokens_under_chat_templates(
    model_dir: Path, engine: TorchEngine, template: str
) -> None:
    tok = with_template(model_dir, TEMPLATES[template])
    recording = Recording(engine)
    limits = EpisodeLimits(max_turns=5, max_new_tokens=6, temperature=1.0)
    runner = EpisodeRunner(recording, tok, Chat, limits, workers=2)
    for i in range(3):
        runner.start(i, chat_row(i), seed=100 + i, n=4)
    hits = engine.kv.hits
    groups = run_all(runner)
    runner.close()
    assert len(groups) == 3
    assert engine.kv.hits > hits and len(engine.kv) == 0  # turns continued kept caches
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for group in groups:
        first = tok.apply_chat_template(
            list(group.row.messages or ()), add_generation_prompt=True, tokenize=False
        )
        for ep in group.episodes:
            assert ep.finish_reason in ("stop", "length")
            assert ep.prompt == tok(first, add_special_tokens=False)["input_ids"]
            check_turns(ep, recording.calls)
            obs_tokens = [c for c, lps in ep.chunks if lps is None]
            delta = tok.apply_chat_template(
                [
                    {"role": "user", "content": "7"},
                    {"role": "assistant", "content": "7"},
                    {"role": "tool", "content": "42"},
                ],
                add_generation_prompt=True,
                tokenize=False,
            )
            tail = tok(delta.split(tok.eos_token, 2)[-1], add_special_tokens=False)["input_ids"]
            for chunk in obs_tokens:  # (after a cut turn, the closing eos comes first)
                assert chunk.tolist()[-len(tail) :] == tail
        batch = collate([episode_group(group)], pad_id=int(tok.pad_token_id))
        for share in (False, True):
            with torch.no_grad():
                learner_lps, _ = token_logprobs(model, batch, 1.0, share_prompt=share)
            on = batch.mask.bool()
            np.testing.assert_allclose(
                learner_lps[on].numpy(), batch.behavior_logprobs[on].numpy(), atol=2e-3
            )


def test_past_reasoning_stays_in_the_trajectory_where_a_re_render_would_drop_it(
    model_dir: Path, engine: TorchEngine
) -> None:
    tok = with_template(model_dir, QWEN_STYLE)
    runner = EpisodeRunner(engine, tok, Chat, EpisodeLimits(max_turns=3, max_new_tokens=4))
    group = runner.start(0, chat_row(0), seed=1, n=1)
    ep = group.episodes[0]
    ep.chunks.append(
        (
            np.asarray(
                tok("5X6", add_special_tokens=False)["input_ids"] + [tok.eos_token_id], np.int32
            ),
            np.zeros(4, np.float32),
        )
    )
    ep.versions.append(np.zeros(4, np.int32))
    ep.num_turns = 1
    runner.on_step(
        ep, Step(observation=Observation(messages=({"role": "tool", "content": "42"},))), 0.0
    )
    text = tok.decode(ep.trajectory()[0])
    assert "5X6" in text  # what the model produced, as it produced it
    rerender = tok.apply_chat_template(
        [
            *chat_row(0).messages,
            {"role": "assistant", "content": "5X6"},  # type: ignore[misc]
            {"role": "tool", "content": "42"},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "5X6" not in rerender and text == rerender.replace("<A>6", "<A>5X6")
    runner.close()


def test_same_row_seed_and_weights_give_the_same_episode(
    model_dir: Path, engine: TorchEngine
) -> None:
    tok = with_template(model_dir, LLAMA3_STYLE)
    trajectories = []
    for _ in range(2):
        runner = EpisodeRunner(engine, tok, Chat, EpisodeLimits(max_turns=4, max_new_tokens=5))
        runner.start(0, chat_row(5), seed=77, n=3)
        (group,) = run_all(runner)
        runner.close()
        trajectories.append([ep.trajectory()[0].tolist() for ep in group.episodes])
    assert trajectories[0] == trajectories[1]
    assert len({tuple(t) for t in trajectories[0]}) > 1  # members differ from each other


def test_a_slow_step_holds_up_only_its_own_episode(model_dir: Path, engine: TorchEngine) -> None:
    tok = with_template(model_dir, LLAMA3_STYLE)
    release = threading.Event()
    made = iter([Chat(block=release)] + [Chat() for _ in range(20)])
    runner = EpisodeRunner(engine, tok, lambda: next(made), EpisodeLimits(max_turns=4), workers=4)
    slow = runner.start("slow", chat_row(1), seed=1, n=1)
    runner.start("fast", chat_row(2), seed=2, n=4)
    finished: list[EpisodeGroup] = []
    for _ in range(100):
        finished += runner.advance(wait_s=0.2)
        if finished:
            break
    assert [g.tag for g in finished] == ["fast"]  # while the slow step still blocks
    assert slow.episodes[0].pending is not None and not slow.done
    release.set()
    assert [g.tag for g in run_all(runner)] == ["slow"]
    runner.close()


class Forever:
    """Never ends an episode by itself; raises when told to."""

    def __init__(self, raise_on_step: bool = False) -> None:
        self.raise_on_step = raise_on_step

    def reset(self, row: Row, seed: int) -> Observation:
        return Observation(text=row.prompt)

    def step(self, model_text: str) -> Step:
        if self.raise_on_step:
            raise RuntimeError("broken environment")
        return Step(observation=Observation(text="12:"), reward=0.5)


@pytest.mark.parametrize(
    ("limits", "env", "reason"),
    [
        (EpisodeLimits(max_turns=2, max_new_tokens=3), Forever, "turn_limit"),
        (EpisodeLimits(max_turns=9, max_new_tokens=3, max_episode_tokens=10), Forever, "length"),
        (EpisodeLimits(max_turns=2), lambda: Forever(raise_on_step=True), "error"),
    ],
)
def test_finish_reasons(
    engine: TorchEngine, model_dir: Path, limits: EpisodeLimits, env: type, reason: str
) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    runner = EpisodeRunner(engine, tok, env, limits, workers=0)
    runner.start(0, Row(prompt_id="p", prompt="31:"), seed=3, n=2)
    (group,) = run_all(runner)
    runner.close()
    for ep in group.episodes:
        assert ep.finish_reason == reason
        tokens, mask, _ = ep.trajectory()
        assert len(mask) == len(tokens) - len(ep.prompt)
        if limits.max_episode_tokens:
            assert len(mask) <= limits.max_episode_tokens
        if reason == "error":
            assert "broken environment" in ep.reward_failed and ep.reward == 0.0
        else:
            assert ep.reward == 0.5 and not ep.reward_failed


def test_timeout_ends_an_episode_whose_step_never_returns(
    engine: TorchEngine, model_dir: Path
) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    never = threading.Event()
    limits = EpisodeLimits(max_turns=4, max_new_tokens=3, timeout_s=0.5)
    runner = EpisodeRunner(engine, tok, lambda: Chat(block=never), limits, workers=2)
    runner.start(0, chat_row(3), seed=3, n=2)
    (group,) = run_all(runner)
    never.set()
    runner.close()
    assert [ep.finish_reason for ep in group.episodes] == ["timeout", "timeout"]
