"""Many episodes in flight over one engine; each episode becomes one trajectory.

```
   start(credit) --> group_size episodes: make_env(), env.reset(row, seed) -> prompt tokens
                         |
   advance():            v
     1. expire:    episodes past task.episode_timeout_s end as timeout
     2. generate:  every episode awaiting the model, in ONE engine.generate call
                   (episodes with the same context share a request with n = their number:
                   a single-turn round is one call with n = group_size per credit)
     3. dispatch:  each turn's text -> env.step on the worker pool (or inline when the env
                   says its steps are quick); nothing waits for a slow tool but its episode
     4. collect:   steps that finished (waiting at most wait_s for the rest): observation
                   tokens appended with loss_mask 0, or the episode ends
     -> groups whose episodes have all ended
```

Engines that continue sequences within a call (`supports_turns`: the torch engine) hand each
turn over as it ends (`on_turn`); an episode whose environment steps inline (quick steps, or no
worker pool) gets its observation right there and goes on in the same decoding loop, its
observation tokens fed with its next decoding step (continuous batching across turns: no
episode waits for the slowest of a round, no context is prefilled twice). An episode whose
step goes to a worker thread leaves the loop and comes back in a later call. Engines that keep
KV caches between calls keep such an episode's cache between its turns
(`GenerationRequest.cache_keys` / `resume_key`), so a turn prefills only the tokens added since
the last one; an episode's cache is released when it ends.

A trajectory is the prompt's tokens, then per turn the engine's own ids (loss_mask 1, the
engine's behaviour logprobs) and the next observation tokenized on its own (loss_mask 0,
logprob 0; see "observations as tokens" below). A turn cut by the per-turn token limit is
closed with the stop token (loss_mask 0) before the observation, so the context stays well
formed.

Every episode ends with a finish reason: `stop` (the environment ended it), `length` (a token
limit: the last turn was cut, or the episode's budget is spent), `turn_limit`, `tool_error`
(the environment gave up on failing tool calls), `timeout`, or `error` (the environment
raised; reward 0, `reward_failed` says why). Sampling is seeded: the first turn of a credit
uses the credit's seed (as single-turn generation always has), later turns a seed derived from
it, the member and the turn; with the same model outputs an episode repeats exactly.

One episode and its group (`Episode`, `EpisodeGroup`): the token context built turn by turn
(the engine's own ids with loss_mask 1 and their logprobs, observations with loss_mask 0), the
policy version of every turn, how it ended, and the trajectory it becomes; `EpisodeLimits`
holds the task's bounds on turns and tokens and the sampling settings.

Observations as tokens (`ChatTokens`): the first rendered whole, every later one on its own
(a delta). Token in, token out: an episode's tokens are the prompt's tokens, then the engine's
own ids for each model turn and the tokens of each later observation, tokenized by itself.
Nothing is ever re-rendered or re-tokenized as a whole chat, so BPE merges across a turn
boundary and chat templates that rewrite past turns (dropping earlier reasoning, say) cannot
make the trajectory differ from what the engine saw and produced.

```
  first observation   messages + tools --chat template (add_generation_prompt)--> text --> ids
                      raw text        --tokenizer (bos as the tokenizer adds it)--------> ids
  model turn          engine ids, as generated (stop token included)
  later observation   delta of the chat template (below) or raw text --> ids (no bos)
```

The delta of new messages is what the template writes after an assistant turn's end token and
up to the next generation prompt. It is taken from renders of a fixed stand-in conversation
(system, user, assistant "x"): render it with the new messages and a generation prompt, cut
right after the stand-in assistant's end-of-turn token (the tokenizer's eos). Templates that
add a default system prompt or treat past reasoning specially see the same stand-in in both
renders. A template whose render does not continue the stand-in's text up to that cut is
refused with a `ValueError` (it cannot be rendered incrementally).

Without a chat template, messages are their contents joined by newlines (tool schemas, if any,
as JSON lines before them).
"""

from __future__ import annotations

import collections
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.engines.base import Continue, Engine, GenerationRequest, Sample
from actors.envs.base import Env, Observation, Row, Step
from asyncrl.config import RunConfig

ROUND_RECORDS = 4096  # generate calls whose time the runner keeps (the latest ones)
COUNTS = ("tool_calls", "tool_errors", "malformed_calls")
"""Per-episode tool counters (summed into the runner's stats)."""
KNOWN_TEXTS = 4096  # texts whose ids are remembered

STAND_IN: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "x"},
    {"role": "user", "content": "x"},
    {"role": "assistant", "content": "x"},
)


# --- one episode, its group and its limits -------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class EpisodeLimits:
    """Sampling and the limits of one episode (from `actor` and `task` config)."""

    max_turns: int = 8
    max_new_tokens: int = 8
    max_episode_tokens: int = 0
    timeout_s: float = 0.0
    temperature: float = 1.0
    top_p: float = 1.0

    @classmethod
    def from_config(cls, cfg: RunConfig) -> EpisodeLimits:
        return cls(
            max_turns=cfg.task.max_turns,
            max_new_tokens=cfg.actor.max_new_tokens,
            max_episode_tokens=cfg.task.max_episode_tokens,
            timeout_s=cfg.task.episode_timeout_s,
            temperature=cfg.actor.temperature,
            top_p=cfg.actor.top_p,
        )


@dataclass(eq=False, kw_only=True)
class Episode:
    """One conversation between the model and its environment, and its token record."""

    group: EpisodeGroup
    index: int
    env: Env
    prompt: list[int]
    deadline: float
    chunks: list[tuple[np.ndarray, np.ndarray | None]] = field(default_factory=list)
    """(token ids, behaviour logprobs) per stretch: logprobs for model turns, None for env text."""
    versions: list[np.ndarray | None] = field(default_factory=list)
    """Per chunk: the policy version of each model token (None for environment text)."""
    num_tokens: int = 0
    model_texts: list[str] = field(default_factory=list)
    num_turns: int = 0
    min_version: int = -1
    max_version: int = -1
    truncated: bool = False
    last_step: Step | None = None
    finish_reason: str = ""
    reward_failed: str = ""
    env_s: float = 0.0
    tool_s: float = 0.0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    pending: Future[tuple[Step | Exception, float]] | None = None

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    @property
    def cache_key(self) -> str:
        """Where the engine keeps this episode's KV cache between turns."""
        return f"ep{id(self)}"

    @property
    def awaiting_model(self) -> bool:
        return not self.finish_reason and self.pending is None

    @property
    def reward(self) -> float:
        """The task reward: the last step's (0 before any, or when the environment failed)."""
        return 0.0 if self.last_step is None or self.reward_failed else self.last_step.reward

    def context(self) -> list[int]:
        return self.prompt + [int(t) for tokens, _ in self.chunks for t in tokens]

    def version_spans(self) -> tuple[int, ...]:
        """Flat (first completion token, version) pairs where the producing version changes
        (environment tokens carry the version before them); () when one version made it all."""
        spans: list[int] = []
        at, current = 0, -1
        for (tokens, _), versions in zip(self.chunks, self.versions, strict=True):
            if versions is None:
                at += len(tokens)
                continue
            for offset in np.flatnonzero(np.diff(versions, prepend=current)):
                current = int(versions[offset])
                spans += [at + int(offset), current]
            at += len(tokens)
        return tuple(spans) if len(spans) > 2 else ()

    def trajectory(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens [L], loss_mask [L - prompt_len], behaviour logprobs [L - prompt_len])."""
        prompt = np.asarray(self.prompt, dtype=np.int32)
        if len(self.chunks) == 1 and self.chunks[0][1] is not None:  # one model turn
            tokens, logprobs = self.chunks[0]
            mask = np.ones(len(tokens), dtype=np.uint8)
            return np.concatenate([prompt, tokens]), mask, logprobs
        tokens = [prompt] + [c for c, _ in self.chunks]
        masks = [np.full(len(c), lp is not None, dtype=np.uint8) for c, lp in self.chunks]
        lps = [np.zeros(len(c), np.float32) if lp is None else lp for c, lp in self.chunks]
        if not self.chunks:
            return prompt, np.zeros(0, np.uint8), np.zeros(0, np.float32)
        return np.concatenate(tokens), np.concatenate(masks), np.concatenate(lps)


@dataclass(eq=False, kw_only=True)
class EpisodeGroup:
    """The episodes of one credit (one prompt, `group_size` samples)."""

    tag: Any
    row: Row
    seed: int
    episodes: list[Episode] = field(default_factory=list)
    generate_s: float = 0.0

    @property
    def done(self) -> bool:
        return all(e.done for e in self.episodes)


# --- observations as tokens ----------------------------------------------------------------------


class ChatTokens:
    """Tokens of observations for one tokenizer (with or without a chat template)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        eos = tokenizer.eos_token_id
        self.stop_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, list) else (int(eos),)
        self._cut: tuple[str, int] | None = None  # (stand-in prefix, cut position)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        """The fast tokenizer's own encoder (what `tokenizer(text)` runs, without its
        per-call overhead), when the tokenizer has one."""
        self._known: dict[tuple[str, bool], list[int]] = {}
        """Ids of texts seen before (observations repeat: template deltas, tool results)."""

    def first(self, obs: Observation) -> list[int]:
        """Token ids of the prompt (the episode's first observation)."""
        if obs.messages:
            if self.chat:
                text = self.tokenizer.apply_chat_template(
                    list(obs.messages),
                    tools=list(obs.tools) or None,
                    add_generation_prompt=True,
                    tokenize=False,
                )
                return self.encode(text)
            return self.encode(_tools_text(obs.tools) + _joined(obs.messages), special=True)
        if obs.text:
            return self.encode(obs.text, special=True)
        raise ValueError("the first observation has neither messages nor text")

    def next(self, obs: Observation) -> list[int]:
        """Token ids of a later observation, tokenized on its own (no bos)."""
        if obs.messages:
            text = self.delta(obs.messages) if self.chat else "\n" + _joined(obs.messages)
            return self.encode(text)
        return self.encode(obs.text or "")

    def encode(self, text: str, special: bool = False) -> list[int]:
        if not text:
            return []
        known = self._known.get((text, special))
        if known is not None:
            return list(known)
        if self._backend is not None:
            ids = list(self._backend.encode(text, add_special_tokens=special).ids)
        else:
            ids = list(self.tokenizer(text, add_special_tokens=special)["input_ids"])
        if len(self._known) < KNOWN_TEXTS:
            self._known[(text, special)] = ids
        return list(ids)

    def delta(self, messages: Sequence[dict[str, str]]) -> str:
        """Template text of `messages` after an assistant turn, generation prompt included."""
        prefix, cut = self._stand_in_cut()
        full = self.tokenizer.apply_chat_template(
            [*STAND_IN, *messages], add_generation_prompt=True, tokenize=False
        )
        if full[:cut] != prefix[:cut]:
            raise ValueError(
                "chat template: adding messages rewrites the turns before them, so it cannot be "
                "rendered turn by turn"
            )
        return full[cut:]

    def _stand_in_cut(self) -> tuple[str, int]:
        if self._cut is None:
            prefix = self.tokenizer.apply_chat_template(list(STAND_IN), tokenize=False)
            ends = [prefix.rfind(t) for t in self._stop_texts()]
            end = max(ends)
            if end < 0:
                raise ValueError(
                    "chat template: no end-of-turn token (the tokenizer's eos) after an "
                    "assistant message; set the tokenizer's eos_token to the template's"
                )
            token = self._stop_texts()[ends.index(end)]
            self._cut = (prefix, end + len(token))
        return self._cut

    def _stop_texts(self) -> list[str]:
        return [self.tokenizer.convert_ids_to_tokens(i) for i in self.stop_ids]


def _tools_text(tools: Sequence[dict[str, Any]]) -> str:
    """Tool schemas as plain text, for a tokenizer without a chat template to render them."""
    if not tools:
        return ""
    return "Tools (JSON schemas):\n" + "\n".join(json.dumps(t) for t in tools) + "\n"


def _joined(messages: Sequence[dict[str, str]]) -> str:
    return "\n".join(m["content"] for m in messages)


# --- many episodes over one engine ---------------------------------------------------------------


class EpisodeRunner:
    """Drives episodes turn by turn over one engine (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        make_env: Callable[[], Env],
        limits: EpisodeLimits,
        workers: int = 4,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.render = ChatTokens(tokenizer)
        self.make_env = make_env
        self.limits = limits
        self.pool = ThreadPoolExecutor(workers, "env-step") if workers > 0 else None
        self.groups: list[EpisodeGroup] = []
        self.round_generate_s: collections.deque[float] = collections.deque(maxlen=ROUND_RECORDS)
        self.stats: dict[str, float] = {
            "rounds": 0,
            "generate_s": 0.0,
            "episodes": 0,
            "env_s": 0.0,
            "tool_s": 0.0,
            "turns": 0,
            **dict.fromkeys(COUNTS, 0),
        }
        self.finish_counts: collections.Counter[str] = collections.Counter()
        self.reuse_kv = bool(getattr(engine, "supports_kv_reuse", False)) and limits.max_turns > 1
        """Keep each episode's KV cache in the engine between its turns (engines that can)."""
        self.turns_in_call = bool(getattr(engine, "supports_turns", False)) and limits.max_turns > 1
        """Episodes continue inside one engine call (see the module docstring)."""

    @property
    def num_groups(self) -> int:
        """Groups in flight."""
        return len(self.groups)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    # --- the loop --------------------------------------------------------------------------

    def start(self, tag: Any, row: Row, seed: int, n: int) -> EpisodeGroup:
        """Begin `n` episodes of `row` (environments reset with `seed`)."""
        group = EpisodeGroup(tag=tag, row=row, seed=seed)
        deadline = time.monotonic() + self.limits.timeout_s if self.limits.timeout_s else 0.0
        first, prompt = None, None
        for i in range(n):
            env = self.make_env()
            start = time.perf_counter()
            try:
                obs = env.reset(row, seed)
                if obs != first:  # a group's members normally share their prompt: render once
                    first, prompt = obs, self.render.first(obs)
                failed = ""
            except Exception as exc:  # a bad row or an environment's bug: data, not a crash
                obs, failed = None, f"environment reset raised {type(exc).__name__}: {exc}"
            tokens = list(prompt) if obs is not None else self.fallback_prompt(row)
            ep = Episode(group=group, index=i, env=env, prompt=tokens, deadline=deadline)
            ep.env_s += time.perf_counter() - start
            group.episodes.append(ep)
            if failed:
                self.finish(ep, "error", failed)
        self.groups.append(group)
        self.stats["episodes"] += n
        return group

    def fallback_prompt(self, row: Row) -> list[int]:
        """Prompt tokens for an episode whose environment failed to start (it has no turns)."""
        return self.render.encode(row.prompt or "", special=True) or [self.render.stop_ids[0]]

    def advance(self, wait_s: float = 0.05) -> list[EpisodeGroup]:
        """One generation wave and the environment steps it leads to; the groups now done."""
        self.expire()
        ready = [e for g in self.groups for e in g.episodes if e.awaiting_model]
        if ready:
            self.generate(ready)
        self.collect(wait_s)
        done = [g for g in self.groups if g.done]
        self.groups = [g for g in self.groups if not g.done]
        return done

    # --- named steps -----------------------------------------------------------------------

    def expire(self) -> None:
        """End episodes past their wall-clock deadline (an env step still running is left to
        finish on its thread; its result is ignored)."""
        now = time.monotonic()
        for group in self.groups:
            for ep in group.episodes:
                if ep.deadline and not ep.done and now > ep.deadline:
                    self.finish(ep, "timeout")

    def generate(self, ready: Sequence[Episode]) -> None:
        """One engine call for every episode awaiting the model; then hand each turn over."""
        batches = self.requests(ready)
        requests = [request for request, _ in batches]
        start = time.perf_counter()
        if self.turns_in_call:
            self.engine.generate(  # type: ignore[call-arg]
                requests, on_turn=lambda i, j, sample: self.on_turn(batches[i][1][j], sample)
            )
        else:
            outputs = self.engine.generate(requests)
        gen_s = time.perf_counter() - start
        self.stats["rounds"] += 1
        self.stats["generate_s"] += gen_s
        self.round_generate_s.append(gen_s)
        for group in {id(ep.group): ep.group for ep in ready}.values():
            group.generate_s += gen_s
        if self.turns_in_call:
            return
        turns = [
            (ep, s)
            for (_, eps), samples in zip(batches, outputs, strict=True)
            for ep, s in zip(eps, samples, strict=True)
        ]
        texts = self.tokenizer.batch_decode(
            [_without_stop(s, self.render.stop_ids) for _, s in turns], skip_special_tokens=False
        )
        for (ep, sample), text in zip(turns, texts, strict=True):
            self.add_turn(ep, sample, text)
        self.dispatch([(ep, text) for (ep, _), text in zip(turns, texts, strict=True)])

    def on_turn(self, ep: Episode, sample: Sample) -> Continue | str:
        """A turn that just ended inside the engine's call: step an inline environment now and
        continue the episode in the same call, or hand the step to a worker thread."""
        text = self.tokenizer.decode(
            _without_stop(sample, self.render.stop_ids), skip_special_tokens=False
        )
        self.add_turn(ep, sample, text)
        if self.pool is not None and not getattr(ep.env, "inline_steps", False):
            ep.pending = self.pool.submit(run_step, ep.env, text)
            return "keep" if self.reuse_kv else "end"
        self.on_step(ep, *run_step(ep.env, text))
        if ep.deadline and not ep.done and time.monotonic() > ep.deadline:
            self.finish(ep, "timeout")
        if not ep.awaiting_model:
            return "end"
        observation, logprobs = ep.chunks[-1]
        assert logprobs is None, "an episode awaiting the model ends with environment tokens"
        seed = turn_seed(ep.group.seed, ep.index, ep.num_turns)
        return Continue(tokens=observation.tolist(), max_new_tokens=self.budget(ep), seed=seed)

    def budget(self, ep: Episode) -> int:
        """The token limit of the episode's next turn."""
        if self.limits.max_episode_tokens:
            return min(self.limits.max_new_tokens, self.limits.max_episode_tokens - ep.num_tokens)
        return self.limits.max_new_tokens

    def requests(self, ready: Sequence[Episode]) -> list[tuple[GenerationRequest, list[Episode]]]:
        """One request per distinct (group, context, turn): its episodes sample n = len(...)."""
        same: dict[tuple, list[Episode]] = {}
        for ep in ready:
            context = ep.context()
            key = (id(ep.group), ep.num_turns, tuple(context))
            same.setdefault(key, []).append(ep)
        out = []
        for (_, turn, context), eps in same.items():
            first = eps[0]
            budget = self.budget(first)
            seed = (
                first.group.seed
                if turn == 0 and first.index == 0
                else turn_seed(first.group.seed, first.index, turn)
            )
            keys = tuple(e.cache_key for e in eps) if self.reuse_kv else ()
            request = GenerationRequest(
                prompt_tokens=list(context),
                n=len(eps),
                temperature=self.limits.temperature,
                top_p=self.limits.top_p,
                max_new_tokens=budget,
                stop_token_ids=self.render.stop_ids,
                seed=seed,
                cache_keys=keys,
                resume_key=first.cache_key if keys and turn else "",
            )
            out.append((request, eps))
        return out

    def add_turn(self, ep: Episode, sample: Sample, text: str) -> None:
        tokens = np.asarray(sample.completion_tokens, dtype=np.int32)
        ep.chunks.append((tokens, np.asarray(sample.logprobs, dtype=np.float32)))
        versions = sample.token_versions()
        ep.versions.append(versions)
        ep.num_tokens += len(tokens)
        ep.model_texts.append(text)
        ep.num_turns += 1
        ep.truncated = sample.finish_reason == "length"
        low, high = (int(versions.min()), int(versions.max())) if len(versions) else (-1, -1)
        if low >= 0:
            ep.min_version = low if ep.min_version < 0 else min(ep.min_version, low)
        ep.max_version = max(ep.max_version, high)
        self.stats["turns"] += 1

    def dispatch(self, turns: Sequence[tuple[Episode, str]]) -> None:
        """Each turn to its environment: inline when it says its steps are quick, else a
        worker thread (the result is picked up by `collect`)."""
        for ep, text in turns:
            if self.pool is None or getattr(ep.env, "inline_steps", False):
                self.on_step(ep, *run_step(ep.env, text))
            else:
                ep.pending = self.pool.submit(run_step, ep.env, text)

    def collect(self, wait_s: float) -> None:
        """Apply finished steps; wait up to `wait_s` for the rest (all of them, or, when no
        episode could generate meanwhile, the first one)."""
        pending = [e.pending for g in self.groups for e in g.episodes if e.pending is not None]
        if pending:
            idle = not any(e.awaiting_model for g in self.groups for e in g.episodes)
            wait(pending, timeout=wait_s, return_when=FIRST_COMPLETED if idle else ALL_COMPLETED)
        for group in self.groups:
            for ep in group.episodes:
                if ep.pending is not None and ep.pending.done():
                    future, ep.pending = ep.pending, None
                    self.on_step(ep, *future.result())

    def on_step(self, ep: Episode, step: Step | Exception, env_s: float) -> None:
        """The environment's answer: the episode ends, or its observation is appended."""
        ep.env_s += env_s
        if ep.done:  # timed out while the step ran
            return
        if isinstance(step, Exception):
            self.finish(ep, "error", f"environment raised {type(step).__name__}: {step}")
            return
        ep.last_step = step
        ep.tool_s += float(step.info.get("tool_s", 0.0))
        for key in COUNTS:
            ep.counts[key] += int(step.info.get(key, 0))
        if step.done:
            reason = step.finish_reason or "stop"
            self.finish(ep, "length" if reason == "stop" and ep.truncated else reason)
        elif ep.num_turns >= self.limits.max_turns:
            self.finish(ep, "turn_limit")
        elif step.observation is None:
            self.finish(ep, "error", "environment gave neither an observation nor done")
        else:
            self.add_observation(ep, self.render.next(step.observation))

    def add_observation(self, ep: Episode, obs_tokens: list[int]) -> None:
        close = [self.render.stop_ids[0]] if ep.truncated else []
        tokens = np.asarray(close + obs_tokens, dtype=np.int32)
        limit = self.limits.max_episode_tokens
        if limit and ep.num_tokens + len(tokens) >= limit:
            self.finish(ep, "length")  # no room left for another model turn
            return
        ep.chunks.append((tokens, None))
        ep.versions.append(None)
        ep.num_tokens += len(tokens)

    def finish(self, ep: Episode, reason: str, failed: str = "") -> None:
        if self.reuse_kv:
            self.engine.release([ep.cache_key])  # type: ignore[attr-defined]
        ep.finish_reason = reason
        ep.reward_failed = failed or (
            str(ep.last_step.info.get("reward_failed", "")) if ep.last_step else ""
        )
        ep.pending = None
        self.finish_counts[reason] += 1
        self.stats["env_s"] += ep.env_s
        self.stats["tool_s"] += ep.tool_s
        for key in COUNTS:
            self.stats[key] += ep.counts[key]


def run_step(env: Env, text: str) -> tuple[Step | Exception, float]:
    """`env.step(text)` and its seconds; an exception is returned, not raised (it ends the
    episode as `error` on the actor's thread)."""
    start = time.perf_counter()
    try:
        step: Step | Exception = env.step(text)
    except Exception as exc:  # an environment's bug must not kill the actor
        step = exc
    return step, time.perf_counter() - start


def turn_seed(seed: int, member: int, turn: int) -> int:
    """A 31-bit sampling seed for `member`'s turn `turn` of a credit with `seed`."""
    digest = hashlib.blake2b(f"{seed}\0{member}\0{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def _without_stop(sample: Sample, stop_ids: tuple[int, ...]) -> list[int]:
    tokens = sample.completion_tokens.tolist()
    if sample.finish_reason == "stop" and tokens and tokens[-1] in stop_ids:
        tokens.pop()
    return tokens
