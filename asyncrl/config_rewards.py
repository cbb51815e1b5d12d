"""The reward sections: the reward-model server and client (`reward_model`), the reward
composition (`reward`) and the LLM judge (`judge`). Loaded and composed by asyncrl/config.py."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from asyncrl.config_checks import name_value_pairs, require


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
    """A served reward model (`asyncrl reward-server`, actors/rewards/rm_server.py) and how
    actors call it (actors/rewards/rm_client.py)."""

    serve: bool = False
    """`asyncrl run` starts `asyncrl reward-server` for the run and points the actors at it."""
    model: str = ""
    """Hugging Face sequence-classification directory (one scalar head); empty with `serve`
    builds the tiny sort reward model (actors/rewards/tiny_reward_model.py) into model.cache_dir."""
    endpoint: str = ""
    """Where actors reach the server (`asyncrl run` fills it in with `serve`)."""
    bind: str = "tcp://127.0.0.1:0"
    """Endpoint the server binds (port 0 = OS-chosen). Non-loopback needs `auth_dir`."""
    auth_dir: str = ""
    """CURVE key directory (`asyncrl keygen`) for server and clients; empty = no auth."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the server runs the model: `auto` = the first GPU when CUDA is present."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the served model (bfloat16 on a GPU box)."""
    max_batch: int = 64
    """Most samples in one forward pass."""
    max_wait_ms: float = 5.0
    """Longest a queued sample waits for its batch to fill before the batch runs anyway."""
    max_queue_samples: int = 4096
    """Bound of the server's queue, in samples; a request that does not fit is refused with
    Error(code="overloaded") and retried by the client after a backoff."""
    max_length_tokens: int = 1024
    """Samples are cut to their last this-many tokens (the score reads the last token)."""
    timeout_s: float = 30.0
    """Per request: the server drops it past this long in its queue; the client stops waiting
    for an attempt after this long and retries."""
    retries: int = 3
    """Client: further attempts after a timeout, an overloaded server or a lost connection."""
    backoff_s: float = 0.2
    """Client: wait before the first retry, doubled for each further one."""
    max_in_flight: int = 64
    """Client: requests outstanding at once (more wait in the client)."""

    def __post_init__(self) -> None:
        require(self.max_batch >= 1, "reward_model.max_batch", "must be >= 1", self.max_batch)
        require(self.max_wait_ms >= 0, "reward_model.max_wait_ms", "must be >= 0", self.max_wait_ms)
        require(
            self.max_queue_samples >= self.max_batch,
            "reward_model.max_queue_samples",
            "must be >= reward_model.max_batch",
            self.max_queue_samples,
        )
        require(
            self.max_length_tokens >= 1,
            "reward_model.max_length_tokens",
            "must be >= 1",
            self.max_length_tokens,
        )
        require(self.timeout_s > 0, "reward_model.timeout_s", "must be > 0", self.timeout_s)
        require(self.retries >= 0, "reward_model.retries", "must be >= 0", self.retries)
        require(self.backoff_s >= 0, "reward_model.backoff_s", "must be >= 0", self.backoff_s)
        require(
            self.max_in_flight >= 1,
            "reward_model.max_in_flight",
            "must be >= 1",
            self.max_in_flight,
        )


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """How a trajectory's reward is composed from named components (actors/rewards/)."""

    weights: str = "task=1"
    """Components and weights, "name=weight, ...": the reward is their weighted sum. Built-in:
    task (the environment's verifier), format, overlong, repetition, judge, reward_model. A
    component at weight 0 is computed and logged but does not count."""
    gates: str = ""
    """Components that must pass, comma-separated: "name" (passes when > 0) or "name>=x"; when
    one fails the reward is `gate_reward` whatever the others say (e.g. "format"). A gate not
    in `weights` is computed and logged with weight 0."""
    gate_reward: float = 0.0
    """The reward of a trajectory that fails a gate."""
    clip_min: float = 0.0
    """Lower clip of the composed reward (clipping is on when clip_max > clip_min)."""
    clip_max: float = 0.0
    """Upper clip of the composed reward; equal to clip_min (the default) = no clipping."""
    on_failure: Literal["zero", "drop_group", "retry"] = "zero"
    """A component that fails: reward 0 with the reason recorded (zero), the whole group not
    pushed and its prompt re-issued (drop_group), or scored again up to max_retries times and
    then reward 0 with the reason (retry)."""
    max_retries: int = 2
    """Re-scoring attempts of the failed items of a component under on_failure = "retry"."""
    component_timeout_s: float = 120.0
    """A component that has not answered a batch within this many seconds fails it (timeout)."""
    modules: str = ""
    """Components of your own, "name=pkg.mod:make_component, ..." (make_component(cfg))."""
    format_regex: str = ""
    """format: the completion must match this regex (re.search, DOTALL); empty = any text."""
    overlong_max_tokens: int = 0
    """overlong: L_max in tokens; 0 = actor.max_new_tokens."""
    overlong_buffer_tokens: int = 0
    """overlong: the soft band before L_max in which the penalty grows from 0 to -1 (DAPO's
    L_cache); 0 = a quarter of L_max."""
    repetition_ngram: int = 4
    """repetition: n of the word n-grams counted (characters when the text has no spaces)."""
    repetition_threshold: float = 0.2
    """repetition: share of repeated n-grams tolerated; above it the penalty falls to -1."""
    disagree_margin: float = 0.5
    """task vs judge: a trajectory counts as a disagreement when the two values (the judge's
    scaled to [0, 1]) lie on different sides of this margin."""
    canary_every: int = 0
    """Score the canary set through the live pipeline every this many policy versions (the
    first round included); 0 = never."""
    canary_file: str = ""
    """JSONL of canaries ({"row": {...}, "completion", "expect": "right"|"wrong", "label"});
    empty = the task's built-in set (its module's `make_canaries`), if it has one."""
    canary_margin: float = 0.5
    """A known-wrong canary whose reward exceeds this raises an alarm (a known-right one at or
    below it is reported as missed)."""
    alarm_window_steps: int = 5
    """Run-level alarms (learner): compare the mean of the last this-many steps with the mean
    of the this-many before them."""
    alarm_reward_jump: float = 0.5
    """Alarm when the reward rises by more than this (absolute) between the two windows while
    the response length or the entropy falls by more than `alarm_collapse_ratio`."""
    alarm_collapse_ratio: float = 0.5
    """A fall to below (1 - this) of the earlier window's mean counts as a collapse."""
    alarm_saturate_steps: int = 10
    """Alarm when a component's per-step mean sits at one value with no spread across
    trajectories for this many steps in a row (0 = off)."""

    def __post_init__(self) -> None:
        require(bool(self.weight_map), "reward.weights", "must name at least one component", "")
        _ = self.gate_list
        require(
            self.clip_max >= self.clip_min,
            "reward.clip_max",
            "must be >= reward.clip_min",
            self.clip_max,
        )
        require(self.max_retries >= 0, "reward.max_retries", "must be >= 0", self.max_retries)
        require(
            self.component_timeout_s > 0,
            "reward.component_timeout_s",
            "must be > 0",
            self.component_timeout_s,
        )
        require(
            self.overlong_max_tokens >= 0,
            "reward.overlong_max_tokens",
            "must be >= 0",
            self.overlong_max_tokens,
        )
        require(
            self.overlong_buffer_tokens >= 0,
            "reward.overlong_buffer_tokens",
            "must be >= 0",
            self.overlong_buffer_tokens,
        )
        require(
            self.repetition_ngram >= 1,
            "reward.repetition_ngram",
            "must be >= 1",
            self.repetition_ngram,
        )
        require(
            0 <= self.repetition_threshold < 1,
            "reward.repetition_threshold",
            "must be in [0, 1)",
            self.repetition_threshold,
        )
        require(self.canary_every >= 0, "reward.canary_every", "must be >= 0", self.canary_every)
        require(
            self.alarm_window_steps >= 1,
            "reward.alarm_window_steps",
            "must be >= 1",
            self.alarm_window_steps,
        )
        require(
            0 < self.alarm_collapse_ratio < 1,
            "reward.alarm_collapse_ratio",
            "must be in (0, 1)",
            self.alarm_collapse_ratio,
        )
        require(
            self.alarm_saturate_steps >= 0,
            "reward.alarm_saturate_steps",
            "must be >= 0",
            self.alarm_saturate_steps,
        )
        _ = self.module_targets
        if self.format_regex:
            try:
                re.compile(self.format_regex)
            except re.error as exc:
                raise ValueError(f"reward.format_regex: not a regex ({exc})") from None

    @property
    def weight_map(self) -> dict[str, float]:
        """`weights` parsed: component name -> weight, in the order written."""
        out: dict[str, float] = {}
        for name, value in name_value_pairs(self.weights, "reward.weights"):
            try:
                out[name] = float(value)
            except ValueError:
                raise ValueError(f"reward.weights: {name}={value!r} is not a number") from None
            require(math.isfinite(out[name]), "reward.weights", "weights must be finite", value)
        return out

    @property
    def gate_list(self) -> list[tuple[str, str, float]]:
        """`gates` parsed: (component, ">" or ">=", threshold) each."""
        out = []
        for part in filter(None, (p.strip() for p in self.gates.split(","))):
            match = re.fullmatch(r"([\w.-]+)\s*(?:(>=|>)\s*(\S+))?", part)
            require(match is not None, "reward.gates", 'each must be "name" or "name>=x"', part)
            assert match is not None
            name, op, value = match.groups()
            try:
                out.append((name, op or ">", float(value) if value is not None else 0.0))
            except ValueError:
                raise ValueError(f"reward.gates: {part!r}: threshold is not a number") from None
        return out

    @property
    def module_targets(self) -> dict[str, str]:
        """`modules` parsed: component name -> "pkg.mod:function"."""
        out = dict(name_value_pairs(self.modules, "reward.modules"))
        for name, target in out.items():
            require(":" in target, "reward.modules", f'{name} must be "pkg.mod:function"', target)
        return out


@dataclass(frozen=True, kw_only=True)
class JudgeConfig:
    """The LLM judge of the `judge` reward component (actors/rewards/judge.py)."""

    backend: Literal["http", "torch", "vllm"] = "http"
    """Who answers: an OpenAI-compatible HTTP endpoint (`url`), or an engine in this process
    loading `model` (torch = the embedded engine, vllm)."""
    url: str = ""
    """http: base URL of an OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1."""
    model: str = ""
    """http: the model name sent with each request; torch/vllm: a Hugging Face model directory."""
    api_key_env: str = ""
    """http: name of the environment variable holding the API key (empty = none sent)."""
    rubric: str = ""
    """File with the rubric template ({prompt}, {response}, {reference}; pairwise: {response_a},
    {response_b}); empty = the built-in rubric of the mode."""
    mode: Literal["pointwise", "pairwise"] = "pointwise"
    """pointwise: grade each response on 0..max_grade; pairwise: compare it with the row's
    reference answer in both orders (position bias cancels), value in [-1, 1]."""
    max_grade: float = 10.0
    """Top of the grade scale; the component's value is grade / max_grade."""
    max_concurrency: int = 8
    """Judge requests in flight at once (http), or prompts per engine call (torch/vllm)."""
    max_new_tokens: int = 256
    """Longest judge answer in tokens."""
    timeout_s: float = 60.0
    """http: per-request timeout in seconds."""
    cache_entries: int = 65536
    """Grades kept, keyed by hash of (rubric, prompt, response); 0 = no cache."""

    def __post_init__(self) -> None:
        require(self.max_grade > 0, "judge.max_grade", "must be > 0", self.max_grade)
        require(
            self.max_concurrency >= 1, "judge.max_concurrency", "must be >= 1", self.max_concurrency
        )
        require(
            self.max_new_tokens >= 1, "judge.max_new_tokens", "must be >= 1", self.max_new_tokens
        )
        require(self.timeout_s > 0, "judge.timeout_s", "must be > 0", self.timeout_s)
        require(self.cache_entries >= 0, "judge.cache_entries", "must be >= 0", self.cache_entries)
