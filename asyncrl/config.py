"""The run configuration: one frozen dataclass per component, composed into `RunConfig`.

```
  run.toml ──tomllib──> nested dicts ──(--set section.key=value, section.key.name=value)──┐
                                                                                         v
  RunConfig(run, model, task, replay, actor, loss, learner, weights, launch, metrics, eval,
            alarms, trajectories, reward_model, reward, judge)   <── from_dict: strict coercion
```

TOML is the source of truth; `--set` overrides one field (or one entry of a table field).
Loading is strict: an unknown section or key, a value of the wrong type, or a value out of range
raises `ValueError` naming the key (``replay.max_staleness: must be >= 0, got -1``). Lists are
TOML arrays (``tools = ["calculator", "lookup"]``) and maps are TOML tables
(``weights = {task = 1, format = 0.2}`` or a ``[reward.weights]`` table); the comma-separated
string forms of those keys are refused with the TOML to write instead. Derived values are
properties, never written back. `config_hash` covers the fields that processes must agree on
(the `Hello` handshake compares it); `to_toml` writes the resolved config into the run
directory.

The sections, by owner: every process (run, model, task, replay, actor), the learner (loss,
learner, weights), watching and launching a run (metrics, eval, alarms, trajectories, launch),
rewards (reward_model, reward, judge).

This module imports no torch and no vllm: the hub loads it.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "ALARM_NAMES",
    "ActorConfig",
    "AlarmsConfig",
    "EvalConfig",
    "JudgeConfig",
    "LaunchConfig",
    "LearnerConfig",
    "LossConfig",
    "MetricsConfig",
    "ModelConfig",
    "ReplayConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RunConfig",
    "RunSection",
    "TaskConfig",
    "TrajectoriesConfig",
    "WeightsConfig",
    "from_dict",
    "load_config",
    "require",
    "to_toml",
]


def require(ok: bool, key: str, rule: str, value: object) -> None:
    """The one rule every section states its limits with: a `ValueError` naming the key."""
    if not ok:
        raise ValueError(f"{key}: {rule}, got {value!r}")


def _require_names(key: str, names: object) -> None:
    """A list-of-names field holds a tuple of non-empty strings (a TOML array of strings)."""
    require(
        isinstance(names, tuple) and all(isinstance(n, str) and n.strip() for n in names),
        key,
        "must be an array of non-empty strings",
        names,
    )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --- every process: run, model, task, replay, actor -----------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RunSection:
    """Where a run lives and how long it may take."""

    run_dir: str = "runs/latest"
    """Directory that receives the resolved config, metrics, checkpoints and plots."""
    seed: int = 0
    """Base seed: actors use seed + actor index, the learner uses seed."""
    num_actors: int = 1
    """Rollout actors in the run: `asyncrl run` starts this many, and the learner waits for this
    many to connect before its first step (at most learner.wait_actors_s)."""
    max_wall_s: float = 0.0
    """Wall-clock budget of `asyncrl run` in seconds; 0 means no limit (stop at max_steps)."""
    progress_every_s: float = 1.0
    """Seconds between progress lines of `asyncrl run`."""
    learner_threads: int = 0
    """torch threads of the learner process; 0 = half the cores (at least 1)."""
    actor_threads: int = 0
    """torch threads of each actor process; 0 = the remaining cores shared among actors."""
    max_restarts: int = 10
    """`asyncrl run`: how often one crashed process (hub, an actor, the learner) is restarted
    before the run ends; 0 = never restart."""
    restart_backoff_s: float = 1.0
    """`asyncrl run`: wait before the first restart of a process, doubled for each further
    restart of it (at most 30 s)."""

    def __post_init__(self) -> None:
        require(self.num_actors >= 1, "run.num_actors", "must be >= 1", self.num_actors)
        require(self.max_wall_s >= 0, "run.max_wall_s", "must be >= 0", self.max_wall_s)
        require(
            self.learner_threads >= 0, "run.learner_threads", "must be >= 0", self.learner_threads
        )
        require(self.actor_threads >= 0, "run.actor_threads", "must be >= 0", self.actor_threads)
        require(self.max_restarts >= 0, "run.max_restarts", "must be >= 0", self.max_restarts)
        require(
            self.restart_backoff_s >= 0,
            "run.restart_backoff_s",
            "must be >= 0",
            self.restart_backoff_s,
        )
        require(
            self.progress_every_s > 0, "run.progress_every_s", "must be > 0", self.progress_every_s
        )


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The policy model. Empty `path` builds the tiny embedded Llama (never downloaded)."""

    path: str = ""
    """Hugging Face model directory; empty builds the tiny model into `cache_dir`."""
    cache_dir: str = "~/.cache/asyncrl/models"
    """Where built tiny models are kept, keyed by the hash of their settings."""
    hidden_size: int = 128
    """Tiny model: width (head_dim = hidden_size / num_heads must be >= 32 for vLLM on CPU)."""
    num_layers: int = 2
    """Tiny model: decoder layers."""
    num_heads: int = 4
    """Tiny model: attention heads."""
    num_kv_heads: int = 2
    """Tiny model: key/value heads (grouped-query attention)."""
    intermediate_size: int = 256
    """Tiny model: MLP width."""
    init_seed: int = 0
    """Tiny model: seed of the random initialisation."""
    extra_chars: str = ""
    """Tiny model: characters added to its alphabet (a task's call syntax, say), one token
    each; empty keeps the default alphabet (and the same build)."""
    arch: Literal["llama", "qwen2", "mistral", "qwen3", "qwen3_moe"] = "llama"
    """Tiny model: the model family to build (asyncrl/models/families.py)."""
    num_experts: int = 4
    """Tiny model, `qwen3_moe` only: experts per MoE layer (2 active per token)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for training and generation."""

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "num_experts",
        ):
            require(getattr(self, name) >= 1, f"model.{name}", "must be >= 1", getattr(self, name))
        require(
            self.hidden_size % self.num_heads == 0,
            "model.hidden_size",
            f"must be divisible by model.num_heads={self.num_heads}",
            self.hidden_size,
        )
        require(
            self.num_heads % self.num_kv_heads == 0,
            "model.num_kv_heads",
            f"must divide model.num_heads={self.num_heads}",
            self.num_kv_heads,
        )
        require(
            len(set(self.extra_chars)) == len(self.extra_chars),
            "model.extra_chars",
            "must not repeat a character",
            self.extra_chars,
        )


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """The environment (task), its data and the limits of one episode."""

    name: str = "sort"
    """Registered task (actors/envs/registry.py): `sort` (answer the prompt's digits in
    ascending order), `lookup` (call a lookup tool, answer with its value), `tools` (chat with
    calculator / python / lookup tools over `data` rows), `humaneval`, `math`."""
    module: str = ""
    """A task of your own instead of `name`: "pkg.mod:make_env" (make_env(task) -> Env)."""
    data: str = ""
    """JSONL file of rows (`prompt` or chat `messages`, plus `answer` / `tests` / `info`);
    empty = the task's generated rows (`num_prompts` of them, from `seed`)."""
    num_digits: int = 4
    """sort: digits per prompt."""
    num_prompts: int = 10000
    """Rows a task generates when `data` is empty."""
    dataset: str = ""
    """A prompts file already in the hub's format (prompt_id, prompt, info), used as is;
    empty = written into the run directory from `data` or the task's generated rows."""
    seed: int = 1234
    """Seed of the generated rows."""
    max_turns: int = 8
    """Model turns per episode; an episode still going after this many ends as turn_limit."""
    max_episode_tokens: int = 0
    """Tokens after the prompt (model and environment together) per episode; an episode that
    reaches it ends as length. 0 = no limit but actor.max_new_tokens per turn."""
    episode_timeout_s: float = 0.0
    """Wall-clock limit of one episode in seconds (ends it as timeout); 0 = none."""
    tools: tuple[str, ...] = ()
    """Tools offered, a TOML array (`["calculator", "python", "lookup"]`); empty = the task's
    own."""
    max_tool_calls: int = 4
    """Tool budget: calls one episode may make; a call beyond it is answered with an error."""
    max_tool_errors: int = 3
    """Failed calls (malformed, unknown tool, tool error, over budget) that end an episode as
    tool_error."""

    def __post_init__(self) -> None:
        require(bool(self.name), "task.name", "must not be empty", self.name)
        require(
            not self.module or ":" in self.module,
            "task.module",
            'must look like "pkg.mod:make_env"',
            self.module,
        )
        require(
            1 <= self.num_digits <= 32, "task.num_digits", "must be in [1, 32]", self.num_digits
        )
        require(self.num_prompts >= 1, "task.num_prompts", "must be >= 1", self.num_prompts)
        require(self.max_turns >= 1, "task.max_turns", "must be >= 1", self.max_turns)
        require(
            self.max_episode_tokens >= 0,
            "task.max_episode_tokens",
            "must be >= 0",
            self.max_episode_tokens,
        )
        require(
            self.episode_timeout_s >= 0,
            "task.episode_timeout_s",
            "must be >= 0",
            self.episode_timeout_s,
        )
        require(
            self.max_tool_calls >= 0, "task.max_tool_calls", "must be >= 0", self.max_tool_calls
        )
        require(
            self.max_tool_errors >= 1, "task.max_tool_errors", "must be >= 1", self.max_tool_errors
        )
        _require_names("task.tools", self.tools)


@dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    """The hub: admission, staleness bound, storage and sockets."""

    bind: str = "tcp://127.0.0.1:0"
    """Endpoint to bind (port 0 = OS-chosen; `ipc://path` works too). Non-loopback needs auth."""
    max_staleness: int = 4
    """η: no group is handed out with policy_version - min_policy_version > η. 0 = synchronous."""
    capacity_groups: int = 4096
    """Most groups stored at once; pushes beyond it are refused with an Error (never dropped)."""
    sampling: Literal["fifo", "freshest"] = "fifo"
    """Which eligible groups a batch takes first: oldest inserted, or newest policy version."""
    max_times_sampled: int = 1
    """How often one group may be handed out (1 = on-policy style, consumed once)."""
    samples_per_insert: float = 0.0
    """Reverb-style rate limit for reuse (0 = off): target sampled / inserted groups."""
    samples_per_insert_tolerance: float = 64.0
    """Allowed deviation from samples_per_insert, in groups; must exceed one batch."""
    heartbeat_interval_s: float = 1.0
    """How often clients heartbeat."""
    heartbeat_timeout_s: float = 10.0
    """A client silent this long is dead: its credits expire and prompts are re-issued."""
    max_message_bytes: int = 256 * 1024 * 1024
    """Largest message accepted (ZMQ_MAXMSGSIZE and codec check)."""
    hwm: int = 10000
    """ZeroMQ send/receive high-water marks, in messages."""
    io_threads: int = 2
    """ZeroMQ I/O threads of the hub's socket. Each connection's reads and writes run on one
    of them (the least busy when it connects), so with two the groups coming in from actors
    and the batches going out to the learner are moved in parallel: on two CPUs, 1.2x the
    groups per second at 256 KB and 1.1x at 2 MB against one thread (bench/transport.py)."""
    pack_frames_below: int = 128 * 1024
    """A `Batch` whose frames average fewer bytes than this goes to the learner as one frame
    (a copy of its bytes instead of ZeroMQ's work per frame: asyncrl/protocol/codec.py); 0 =
    never. 32 KB and 256 KB groups are packed by default, 2 MB groups are not."""
    auth_dir: str = ""
    """Directory with CURVE keys (`asyncrl keygen`); empty = no auth, loopback only."""
    durability: Literal["volatile", "durable"] = "volatile"
    """`volatile`: state in memory only, acks after store. `durable`: every state change goes to
    a write-ahead log in `state_dir`, acks and batches leave only after their records are
    written, and a restarted hub recovers buffer, credits, cursor, dedup and version."""
    state_dir: str = ""
    """Directory of the durable hub's log and snapshot (`asyncrl run`: <run_dir>/replay)."""
    fsync: Literal["commit", "off"] = "commit"
    """Durable mode: `commit` fsyncs each group commit before its acks (survives power loss);
    `off` leaves flushing to the OS (survives a killed hub, not a crashed machine)."""
    snapshot_log_bytes: int = 256 * 1024 * 1024
    """Durable mode: log size that triggers a snapshot and a fresh log (bounds disk and
    recovery time)."""
    snapshot_keep_segments: int = 4
    """Durable mode: a snapshot references groups still buffered in the newest this many
    closed log segments (kept on disk while referenced) and copies older ones into itself. A
    buffer larger than a segment is then not rewritten by every snapshot; disk use is bounded
    by this many segments, the current one, a spare and the snapshot. 1: only the segment the
    snapshot closes."""

    def __post_init__(self) -> None:
        require(
            self.durability in ("volatile", "durable"),
            "replay.durability",
            "must be 'volatile' or 'durable'",
            self.durability,
        )
        require(
            self.fsync in ("commit", "off"), "replay.fsync", "must be 'commit' or 'off'", self.fsync
        )
        require(
            self.snapshot_log_bytes >= 1024,
            "replay.snapshot_log_bytes",
            "must be >= 1024",
            self.snapshot_log_bytes,
        )
        require(
            self.snapshot_keep_segments >= 1,
            "replay.snapshot_keep_segments",
            "must be >= 1",
            self.snapshot_keep_segments,
        )
        require(self.max_staleness >= 0, "replay.max_staleness", "must be >= 0", self.max_staleness)
        require(
            self.capacity_groups >= 1,
            "replay.capacity_groups",
            "must be >= 1",
            self.capacity_groups,
        )
        require(
            self.max_times_sampled >= 1,
            "replay.max_times_sampled",
            "must be >= 1",
            self.max_times_sampled,
        )
        require(
            self.samples_per_insert >= 0,
            "replay.samples_per_insert",
            "must be >= 0",
            self.samples_per_insert,
        )
        require(
            self.heartbeat_interval_s > 0,
            "replay.heartbeat_interval_s",
            "must be > 0",
            self.heartbeat_interval_s,
        )
        require(
            self.heartbeat_timeout_s > self.heartbeat_interval_s,
            "replay.heartbeat_timeout_s",
            f"must exceed replay.heartbeat_interval_s={self.heartbeat_interval_s}",
            self.heartbeat_timeout_s,
        )
        require(
            self.max_message_bytes >= 1024,
            "replay.max_message_bytes",
            "must be >= 1024",
            self.max_message_bytes,
        )
        require(self.hwm >= 1, "replay.hwm", "must be >= 1", self.hwm)
        require(
            1 <= self.io_threads <= 64, "replay.io_threads", "must be in [1, 64]", self.io_threads
        )
        require(
            self.pack_frames_below >= 0,
            "replay.pack_frames_below",
            "must be >= 0 (0 = never)",
            self.pack_frames_below,
        )


@dataclass(frozen=True, kw_only=True)
class ActorConfig:
    """A rollout actor: engine and sampling."""

    engine: Literal["torch", "vllm"] = "torch"
    """Generation engine: `torch` (embedded default) or `vllm`."""
    group_size: int = 8
    """Samples per prompt (the GRPO group)."""
    concurrency: int = 4
    """Groups one actor generates together as one batch (at most)."""
    credit_window: int = 0
    """Credits the actor asks the hub to keep it supplied with; 0 = 2 × concurrency, so the
    next batch's credits are at hand when a batch ends (no hub round trip between batches).
    Must be 0 or >= concurrency; admission (η) still bounds what the hub grants."""
    max_new_tokens: int = 8
    """Token limit of one model turn (the whole completion of a single-turn task)."""
    temperature: float = 1.0
    """Sampling temperature in (0, 2] (vLLM's range); logprobs are under this distribution."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; logprobs are under the truncated distribution."""
    vllm_kv_cache_gib: float = 1.0
    """vLLM on CPU: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    env_workers: int = 4
    """Threads that run environment steps and tool calls, so a slow tool never holds up the
    generation of other episodes; 0 = run every step on the actor's main thread."""
    weight_update: Literal["between_groups", "in_flight"] = "between_groups"
    """When received weights are loaded: `between_groups` at generation boundaries (between
    engine calls: a round, or a turn of multi-turn episodes); `in_flight` also between the
    decoding steps of the sequences being generated, which continue under the new weights
    (each token records its version; the KV cache is recomputed). The hub's staleness bound
    counts from a trajectory's oldest token."""

    @property
    def num_window_credits(self) -> int:
        """The credit window the actor announces to the hub (resolves the 0 default)."""
        return self.credit_window or 2 * self.concurrency

    def __post_init__(self) -> None:
        require(self.group_size >= 1, "actor.group_size", "must be >= 1", self.group_size)
        require(self.concurrency >= 1, "actor.concurrency", "must be >= 1", self.concurrency)
        require(
            self.credit_window == 0 or self.credit_window >= self.concurrency,
            "actor.credit_window",
            "must be 0 or >= actor.concurrency",
            self.credit_window,
        )
        require(
            self.max_new_tokens >= 1, "actor.max_new_tokens", "must be >= 1", self.max_new_tokens
        )
        require(
            0 < self.temperature <= 2, "actor.temperature", "must be in (0, 2]", self.temperature
        )
        require(0 < self.top_p <= 1, "actor.top_p", "must be in (0, 1]", self.top_p)
        require(self.env_workers >= 0, "actor.env_workers", "must be >= 0", self.env_workers)


# --- the learner: loss, learner, weights ----------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The policy loss family of DESIGN §5 behind one signature."""

    name: Literal[
        "ppo", "decoupled_ppo", "truncated_is", "masked_is", "gspo", "cispo", "m2po", "stale_clip"
    ] = "decoupled_ppo"
    """Which objective: plain PPO/GRPO clip, AReaL's decoupled PPO, truncated IS, masked IS
    (IcePop-style two-sided mask), sequence-level geometric-mean ratio (GSPO), CISPO, M2PO's
    second-moment masking, or PPO with a clip range that shrinks with each token's staleness."""
    clip_low: float = 0.2
    """ε_low: the ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.28
    """ε_high (clip-higher): the ratio is clipped above at 1 + clip_high."""
    is_cap: float = 2.0
    """C: truncated IS weight min(π_prox/μ, C); decoupled PPO masks tokens with π_prox/μ > C."""
    mask_low: float = 0.5
    """α of masked IS: tokens with ratio < α are masked."""
    mask_high: float = 2.0
    """β of masked IS: tokens with ratio > β are masked."""
    m2_bound: float = 0.04
    """τ of m2po: the fewest tokens of largest (log π_prox/μ)² are masked so that the kept
    tokens' mean of (log π_prox/μ)² stays <= τ (M2PO's value: 0.04)."""
    clip_lag_scale: float = 0.1
    """κ of stale_clip: a token made `lag` versions before the one trained has its clip ranges
    multiplied by 1 + κ·lag (κ >= 0: wider for staler tokens) or divided by 1 + |κ|·lag
    (κ < 0: narrower); 0 = plain ppo."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "dr_grpo"] = "token_mean"
    """How token losses become one number."""
    adv_std_norm: bool = True
    """Divide group-centred rewards by the group's std (GRPO); off = Dr.GRPO style."""

    def __post_init__(self) -> None:
        require(0 <= self.clip_low < 1, "loss.clip_low", "must be in [0, 1)", self.clip_low)
        require(self.clip_high >= 0, "loss.clip_high", "must be >= 0", self.clip_high)
        require(self.is_cap >= 1, "loss.is_cap", "must be >= 1", self.is_cap)
        require(0 <= self.mask_low <= 1, "loss.mask_low", "must be in [0, 1]", self.mask_low)
        require(self.mask_high >= 1, "loss.mask_high", "must be >= 1", self.mask_high)
        require(self.m2_bound > 0, "loss.m2_bound", "must be > 0", self.m2_bound)
        require(
            math.isfinite(self.clip_lag_scale),
            "loss.clip_lag_scale",
            "must be a finite number",
            self.clip_lag_scale,
        )


@dataclass(frozen=True, kw_only=True)
class LearnerConfig:
    """The training loop."""

    groups_per_step: int = 8
    """Groups (prompts) per optimizer step; the hub's admission rule uses it too."""
    micro_batch_samples: int = 64
    """Samples per forward/backward micro-batch (gradients accumulate across them)."""
    share_prompt: bool = True
    """Score each group's prompt once: pack it with its completions into one row, each
    completion attending to the prompt and to itself only (same log-probs and gradients as one
    row per sample; the prompt's share of the learner's compute drops by the group size)."""
    packed_row_tokens: int = 256
    """Longest packed row (tokens) with share_prompt: completions that do not fit start another
    row with the prompt again. Attention in a row costs its length squared."""
    minibatches: int = 1
    """Optimizer steps per batch (PPO minibatches, AReaL's ppo_n_minibatches): the batch's rows
    are split into this many parts, one AdamW step each. π_prox is the policy at the batch's
    start (one extra no-grad forward when > 1), so from the second minibatch on the clip on
    π_θ/π_prox binds; with 1, π_prox = π_θ.detach() and costs nothing."""
    max_steps: int = 200
    """Optimizer steps before the learner stops."""
    lr: float = 1e-3
    """AdamW learning rate."""
    lr_staleness_decay: float = 0.0
    """κ: each step's learning rate is lr / (1 + κ·ℓ), ℓ = the mean version lag of the batch's
    produced tokens (the version trained minus the one that made the token); 0 = constant."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 = off)."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps (0 = only at the end)."""
    publish_every: int = 1
    """Publish weights to actors every N steps."""
    world: int = 1
    """Learner ranks (torch.distributed world size): FSDP2 over gloo on CPU, nccl on GPU.
    `asyncrl learner` starts this many local ranks itself, or joins the ranks a launcher
    (torchrun, srun) started through RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the learner trains: `auto` = this rank's GPU (LOCAL_RANK) when CUDA is present,
    else the CPU."""
    dist_timeout_s: float = 3600.0
    """Timeout of the learner ranks' collectives (s); ranks > 0 wait in one while rank 0
    waits for data, so it must exceed the longest wait for a batch."""
    wait_actors_s: float = 600.0
    """Before its first step the learner waits up to this long for run.num_actors actors to
    connect, so that every actor holds the starting weights and a short run does not end before
    an actor that is still loading its engine has joined. Past it, the learner starts with the
    actors connected by then and says how many are missing (0 = do not wait)."""

    def __post_init__(self) -> None:
        require(
            self.groups_per_step >= 1,
            "learner.groups_per_step",
            "must be >= 1",
            self.groups_per_step,
        )
        require(
            self.micro_batch_samples >= 1,
            "learner.micro_batch_samples",
            "must be >= 1",
            self.micro_batch_samples,
        )
        require(
            1 <= self.minibatches <= self.groups_per_step,
            "learner.minibatches",
            "must be between 1 and learner.groups_per_step",
            self.minibatches,
        )
        require(
            self.packed_row_tokens >= 1,
            "learner.packed_row_tokens",
            "must be >= 1",
            self.packed_row_tokens,
        )
        require(self.max_steps >= 1, "learner.max_steps", "must be >= 1", self.max_steps)
        require(self.lr > 0, "learner.lr", "must be > 0", self.lr)
        require(self.grad_clip >= 0, "learner.grad_clip", "must be >= 0", self.grad_clip)
        require(
            self.checkpoint_every >= 0,
            "learner.checkpoint_every",
            "must be >= 0",
            self.checkpoint_every,
        )
        require(
            self.publish_every >= 1, "learner.publish_every", "must be >= 1", self.publish_every
        )
        require(self.world >= 1, "learner.world", "must be >= 1", self.world)
        require(
            self.dist_timeout_s > 0, "learner.dist_timeout_s", "must be > 0", self.dist_timeout_s
        )
        require(
            self.groups_per_step >= self.world,
            "learner.groups_per_step",
            f"must be >= learner.world ({self.world}): every rank trains on whole groups",
            self.groups_per_step,
        )
        require(
            self.wait_actors_s >= 0, "learner.wait_actors_s", "must be >= 0", self.wait_actors_s
        )
        require(
            self.lr_staleness_decay >= 0,
            "learner.lr_staleness_decay",
            "must be >= 0",
            self.lr_staleness_decay,
        )


@dataclass(frozen=True, kw_only=True)
class WeightsConfig:
    """Weight broadcast from the learner to the actors."""

    backend: Literal["gloo", "nccl"] = "gloo"
    """Transfer backend: gloo (CPU, torch.distributed) or nccl (GPU, cupy)."""
    bucket_bytes: int = 64 * 1024 * 1024
    """Largest flat bucket in bytes; parameters are packed by dtype in a fixed order."""
    timeout_s: float = 60.0
    """A broadcast or group formation slower than this aborts and re-forms without laggards."""
    host: str = "127.0.0.1"
    """Address the learner's rendezvous store listens on (announced through the hub)."""

    def __post_init__(self) -> None:
        require(
            self.bucket_bytes >= 1024, "weights.bucket_bytes", "must be >= 1024", self.bucket_bytes
        )
        require(self.timeout_s > 0, "weights.timeout_s", "must be > 0", self.timeout_s)


# --- watching and launching a run: metrics, eval, alarms, trajectories, launch --------------------


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """Live Prometheus endpoints (asyncrl/metrics.py); 0 = off."""

    hub_port: int = 0
    """Port of the hub's /metrics endpoint."""
    actor_port: int = 0
    """Port of actor 0's endpoint; actor i serves on actor_port + i."""
    learner_port: int = 0
    """Port of the learner's endpoint (rank 0)."""
    wandb_project: str = ""
    """Weights & Biases project the learner logs its step metrics and evaluations to; empty =
    off (then wandb is never imported). Needs the `wandb` package (the `wandb` extra): set
    without it, the learner refuses to start, naming this key."""
    wandb_mode: Literal["online", "offline"] = "online"
    """`offline` keeps the W&B run on disk (`wandb sync` uploads it later)."""

    def __post_init__(self) -> None:
        for name in ("hub_port", "actor_port", "learner_port"):
            port = getattr(self, name)
            require(0 <= port <= 65535, f"metrics.{name}", "must be in [0, 65535]", port)


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Evaluation during a run (an actor generates a held-out prompt set every K versions,
    outside the training stream) and by `asyncrl eval CHECKPOINT`."""

    every_versions: int = 0
    """K: evaluate the policy at every K-th policy version (0 = no evaluation during the run)."""
    at_start: bool = True
    """Also evaluate version 0 (the starting weights), as the baseline of the curve."""
    num_prompts: int = 32
    """Held-out prompts per evaluation."""
    num_samples: int = 4
    """n: samples per prompt (pass@1 is averaged over them; pass@n is reported too)."""
    temperature: float = 0.0
    """Sampling temperature of evaluation; 0 = greedy (then every sample is the same)."""
    max_new_tokens: int = 0
    """Completion length limit in tokens; 0 = actor.max_new_tokens."""
    pass_threshold: float = 1.0
    """A sample passes (for pass@k) when its reward is at least this."""
    dataset: str = ""
    """Held-out prompts (JSONL rows like the training set); empty = generated by the task with
    `eval.seed`, prompts that are also in the training set left out."""
    seed: int = 4321
    """Seed of the generated held-out set and of evaluation sampling."""
    timeout_s: float = 300.0
    """An evaluation not answered within this many seconds goes to another actor."""

    def __post_init__(self) -> None:
        require(
            self.every_versions >= 0, "eval.every_versions", "must be >= 0", self.every_versions
        )
        require(self.num_prompts >= 1, "eval.num_prompts", "must be >= 1", self.num_prompts)
        require(self.num_samples >= 1, "eval.num_samples", "must be >= 1", self.num_samples)
        require(
            0 <= self.temperature <= 2, "eval.temperature", "must be in [0, 2]", self.temperature
        )
        require(
            self.max_new_tokens >= 0, "eval.max_new_tokens", "must be >= 0", self.max_new_tokens
        )
        require(self.timeout_s > 0, "eval.timeout_s", "must be > 0", self.timeout_s)


ALARM_NAMES = (
    "nan",
    "ess_collapse",
    "is_weight_blowup",
    "kl_spike",
    "entropy_collapse",
    "reward_jump_length",
    "reward_jump_entropy",
    "grad_norm_spike",
    "staleness_drift",
    "component_saturation",
)
"""Detectors of learner/alarms.py, by the names `alarms.pause_on` / `alarms.stop_on` take."""


@dataclass(frozen=True, kw_only=True)
class AlarmsConfig:
    """Stability alarms over the learner's step metrics (learner/alarms.py). Windows are in
    learner steps; a detector compares the last `window_steps` with what came before."""

    enabled: bool = True
    """Run the detectors (they only read metrics; a fired alarm is logged to alarms.jsonl)."""
    window_steps: int = 20
    """Length of the recent window (and of the earlier window it is compared with)."""
    warmup_steps: int = 20
    """Steps before anything but `nan` may fire (the first steps set the baselines)."""
    cooldown_steps: int = 100
    """After firing, a detector stays quiet this many steps (one alarm per episode)."""
    ess_min: float = 0.2
    """ess_collapse: the window's median effective sample size (fraction) fell below this."""
    is_weight_max: float = 50.0
    """is_weight_blowup: the window's median of the step's largest IS weight exceeds this."""
    spike_steps: int = 3
    """Spikes (kl_spike, grad_norm_spike) compare the median of this many latest steps, so one
    noisy step does not fire (healthy tiny runs have single steps at 15x the KL median)."""
    kl_spike_factor: float = 10.0
    """kl_spike: the latest steps' mismatch KL exceeds this multiple of the earlier median..."""
    kl_min: float = 1.0
    """... and is at least this large (tiny KLs are noise)."""
    entropy_collapse_frac: float = 0.1
    """entropy_collapse: the window's median entropy fell below this fraction of the warm-up's."""
    reward_jump: float = 0.3
    """reward_jump_*: the window's mean reward rose by at least this over the earlier window..."""
    length_collapse_ratio: float = 0.5
    """... together with the mean response length shrinking below this ratio of the earlier one,"""
    length_blowup_ratio: float = 2.0
    """... or growing above this ratio, (reward_jump_length)"""
    entropy_drop_ratio: float = 0.5
    """... or the mean entropy shrinking below this ratio of the earlier one (reward_jump_entropy)."""
    grad_norm_spike_factor: float = 20.0
    """grad_norm_spike: the latest steps' gradient norm exceeds this multiple of the earlier
    median..."""
    grad_norm_min: float = 50.0
    """... and is at least this large (a converged policy's norms near 0 make ratios noise)."""
    staleness_drift: float = 2.0
    """staleness_drift: the window's mean staleness rose by this many versions over the
    warm-up's (actors falling behind the learner)."""
    saturation_eps: float = 0.01
    """component_saturation: a `reward/<name>` component flat (range below this fraction of its
    run-long range) at the top of its range for a whole window, after having varied."""
    pause_on: tuple[str, ...] = ()
    """Alarms that pause the actors, a TOML array of names (`["ess_collapse"]`, or `["all"]`):
    the hub grants no more credits until `asyncrl status ENDPOINT --resume`."""
    stop_on: tuple[str, ...] = ()
    """Alarms that stop the run with a checkpoint, a TOML array of names (or `["all"]`)."""

    def __post_init__(self) -> None:
        for name in ("window_steps", "warmup_steps", "cooldown_steps", "spike_steps"):
            require(getattr(self, name) >= 1, f"alarms.{name}", "must be >= 1", getattr(self, name))
        for name in (
            "ess_min",
            "kl_min",
            "grad_norm_min",
            "entropy_collapse_frac",
            "reward_jump",
            "length_collapse_ratio",
            "entropy_drop_ratio",
            "saturation_eps",
            "staleness_drift",
        ):
            require(getattr(self, name) > 0, f"alarms.{name}", "must be > 0", getattr(self, name))
        for name in (
            "is_weight_max",
            "kl_spike_factor",
            "length_blowup_ratio",
            "grad_norm_spike_factor",
        ):
            require(getattr(self, name) > 1, f"alarms.{name}", "must be > 1", getattr(self, name))
        for key in ("pause_on", "stop_on"):
            _require_names(f"alarms.{key}", getattr(self, key))
            bad = sorted(set(getattr(self, key)) - {"all", *ALARM_NAMES})
            require(
                not bad,
                f"alarms.{key}",
                f"unknown alarms {bad} (known: all, {', '.join(ALARM_NAMES)})",
                getattr(self, key),
            )

    def names(self, key: Literal["pause_on", "stop_on"]) -> tuple[str, ...]:
        """The alarm names `pause_on` or `stop_on` lists (`all` expanded)."""
        items: tuple[str, ...] = getattr(self, key)
        return ALARM_NAMES if "all" in items else items


@dataclass(frozen=True, kw_only=True)
class TrajectoriesConfig:
    """The trajectory store (learner/trajectory_store.py): a bounded sample of trained
    trajectories, plus every one that scores an outlier or is trained in a step that fires an
    alarm, kept in run_dir/trajectories/ for `asyncrl inspect` and `asyncrl report`."""

    sample_every_steps: int = 10
    """Keep one group of every N-th learner step (0 = no regular sample)."""
    max_sampled_steps: int = 200
    """Most sampled steps kept: beyond it the stride doubles and every other sampled step is
    deleted, so the sample stays spread over the whole run."""
    outlier_z: float = 4.0
    """Keep a trajectory whose reward or length is this many standard deviations from the
    recent steps' mean (0 = off)."""
    on_alarm: bool = True
    """Keep the whole batch of a step that fires an alarm."""
    max_flagged: int = 5000
    """Most outlier and alarm trajectories kept (later ones are counted, not stored)."""

    def __post_init__(self) -> None:
        require(
            self.sample_every_steps >= 0,
            "trajectories.sample_every_steps",
            "must be >= 0",
            self.sample_every_steps,
        )
        require(
            self.max_sampled_steps >= 2,
            "trajectories.max_sampled_steps",
            "must be >= 2",
            self.max_sampled_steps,
        )
        require(self.outlier_z >= 0, "trajectories.outlier_z", "must be >= 0", self.outlier_z)
        require(self.max_flagged >= 0, "trajectories.max_flagged", "must be >= 0", self.max_flagged)


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """Placement of the roles on a cluster by `asyncrl launch --ray` (launch/ray_cluster.py)."""

    hub_cpus: float = 1.0
    """CPUs the hub reserves."""
    actor_cpus: float = 1.0
    """CPUs each actor reserves."""
    actor_gpus: float = 0.0
    """GPUs each actor reserves (its engine)."""
    actor_memory_gb: float = 0.0
    """Memory each actor reserves, GB (0 = no reservation)."""
    actor_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each actor needs, a TOML table of name = amount (e.g.
    `actor_resources = {env_worker = 1}`)."""
    actor_max_restarts: int = 3
    """How often a failed actor is restarted (its process or its whole Ray worker)."""
    learner_cpus: float = 1.0
    """CPUs each learner rank reserves."""
    learner_gpus: float = 0.0
    """GPUs each learner rank reserves (1 with nccl)."""
    learner_memory_gb: float = 0.0
    """Memory each learner rank reserves, GB (0 = no reservation)."""
    allow_insecure: bool = False
    """Let the hub bind a non-loopback address without CURVE auth (replay.auth_dir)."""

    def __post_init__(self) -> None:
        for name in (
            "hub_cpus",
            "actor_cpus",
            "actor_gpus",
            "actor_memory_gb",
            "learner_cpus",
            "learner_gpus",
            "learner_memory_gb",
        ):
            require(getattr(self, name) >= 0, f"launch.{name}", "must be >= 0", getattr(self, name))
        require(
            self.actor_max_restarts >= 0,
            "launch.actor_max_restarts",
            "must be >= 0",
            self.actor_max_restarts,
        )
        require(
            isinstance(self.actor_resources, dict),
            "launch.actor_resources",
            "must be a table of name = amount",
            self.actor_resources,
        )
        for name, amount in self.actor_resources.items():
            require(
                _is_number(amount) and amount >= 0,
                f"launch.actor_resources.{name}",
                "must be a number >= 0",
                amount,
            )


# --- rewards: reward_model, reward, judge ---------------------------------------------------------


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

    weights: dict[str, float] = field(default_factory=lambda: {"task": 1.0})
    """Components and weights, a TOML table of name = weight (`weights = {task = 1, format =
    0.2}`, or a `[reward.weights]` table): the reward is their weighted sum, in the order
    written. Built-in: task (the environment's verifier), format, overlong, repetition, judge,
    reward_model. A component at weight 0 is computed and logged but does not count."""
    gates: tuple[str, ...] = ()
    """Components that must pass, a TOML array of "name" (passes when > 0) or "name>=x" (e.g.
    `["format", "judge>=0.6"]`); when one fails the reward is `gate_reward` whatever the
    others say. A gate not in `weights` is computed and logged with weight 0."""
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
    modules: dict[str, str] = field(default_factory=dict)
    """Components of your own, a TOML table of name = "pkg.mod:make_component"
    (make_component(cfg) -> the component), e.g. `modules = {mine = "my_pkg.scorers:make"}`."""
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
        require(
            isinstance(self.weights, dict) and bool(self.weights),
            "reward.weights",
            "must be a table naming at least one component",
            self.weights,
        )
        for name, weight in self.weights.items():
            require(
                _is_number(weight) and math.isfinite(weight),
                f"reward.weights.{name}",
                "must be a finite number",
                weight,
            )
        _require_names("reward.gates", self.gates)
        _ = self.gate_list
        require(
            isinstance(self.modules, dict),
            "reward.modules",
            'must be a table of name = "pkg.mod:function"',
            self.modules,
        )
        for name, target in self.modules.items():
            require(
                isinstance(target, str) and ":" in target,
                f"reward.modules.{name}",
                'must look like "pkg.mod:function"',
                target,
            )
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
        if self.format_regex:
            try:
                re.compile(self.format_regex)
            except re.error as exc:
                raise ValueError(f"reward.format_regex: not a regex ({exc})") from None

    @property
    def gate_list(self) -> list[tuple[str, str, float]]:
        """`gates` parsed: (component, ">" or ">=", threshold) each."""
        out = []
        for gate in self.gates:
            match = re.fullmatch(r"([\w.-]+)\s*(?:(>=|>)\s*(\S+))?", gate.strip())
            require(match is not None, "reward.gates", 'each must be "name" or "name>=x"', gate)
            assert match is not None
            name, op, value = match.groups()
            try:
                out.append((name, op or ">", float(value) if value is not None else 0.0))
            except ValueError:
                raise ValueError(f"reward.gates: {gate!r}: threshold is not a number") from None
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


# --- the run --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one run needs; each section belongs to one component."""

    run: RunSection = field(default_factory=RunSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    alarms: AlarmsConfig = field(default_factory=AlarmsConfig)
    trajectories: TrajectoriesConfig = field(default_factory=TrajectoriesConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)

    def __post_init__(self) -> None:
        # The learner at version v takes only groups made with weights >= v - η, and actors
        # only ever hold published versions: every publish_every-th. A gap wider than η + 1
        # leaves a version no actor can serve, and the learner would wait for it forever.
        require(
            self.learner.publish_every <= self.replay.max_staleness + 1,
            "learner.publish_every",
            f"must be <= replay.max_staleness + 1 = {self.replay.max_staleness + 1} (actors hold "
            "only published weights, and the learner takes nothing staler than η)",
            self.learner.publish_every,
        )

    @property
    def samples_per_step(self) -> int:
        """Trajectories per optimizer step."""
        return self.learner.groups_per_step * self.actor.group_size

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict, as written to the run directory."""
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        """Hash of the settings all processes must agree on (model, task, sampling shape)."""
        task = dataclasses.asdict(self.task)
        # Hashed as the comma-joined string `tools` was before it became an array, so that a
        # config naming no tools keeps the hash it had.
        task["tools"] = ",".join(self.task.tools)
        shared = {
            "model": dataclasses.asdict(self.model),
            "task": task,
            "group_size": self.actor.group_size,
            "groups_per_step": self.learner.groups_per_step,
            "max_staleness": self.replay.max_staleness,
            "weights": {"backend": self.weights.backend, "bucket_bytes": self.weights.bucket_bytes},
        }
        blob = json.dumps(shared, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# --- loading: TOML, --set overrides, strict coercion ----------------------------------------------


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Read a TOML file (or defaults when `path` is None) and apply `--set` overrides:
    `section.key=value` sets a field, `section.key.name=value` one entry of a table field
    (merged into the file's table, or into the default one)."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file not found: {p}")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{p}: invalid TOML: {exc}") from exc
    for item in overrides:
        _apply_override(raw, item)
    return from_dict(raw)


def from_dict(raw: dict[str, Any]) -> RunConfig:
    """Build a `RunConfig` from nested dicts, strictly (unknown keys and bad types fail)."""
    sections = {f.name: f for f in dataclasses.fields(RunConfig)}
    kwargs: dict[str, Any] = {}
    for name, values in raw.items():
        if name not in sections:
            raise ValueError(f"{name}: unknown config section (known: {', '.join(sections)})")
        if not isinstance(values, dict):
            raise ValueError(f"{name}: must be a table, got {values!r}")
        cls = _section_class(name)
        kwargs[name] = _build_section(name, cls, values)
    return RunConfig(**kwargs)


def _section_class(name: str) -> type:
    hints = typing.get_type_hints(RunConfig)
    return hints[name]


def _build_section(section: str, cls: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            raise ValueError(f"{section}.{key}: unknown key (known: {', '.join(sorted(known))})")
        kwargs[key] = _coerce(f"{section}.{key}", hints[key], value)
    return cls(**kwargs)


def _coerce(key: str, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ValueError(f"{key}: must be one of {list(choices)}, got {value!r}")
        return value
    if origin in (types.UnionType, typing.Union):
        raise AssertionError(f"{key}: union config fields are not supported")
    if origin is tuple:
        item, ellipsis = typing.get_args(hint)
        assert ellipsis is Ellipsis, f"{key}: only tuple[X, ...] config fields are supported"
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}: must be a TOML array, {_write_instead(key, hint, value)}")
        return tuple(_coerce(f"{key}[{i}]", item, v) for i, v in enumerate(value))
    if origin is dict:
        key_hint, value_hint = typing.get_args(hint)
        assert key_hint is str, f"{key}: only dict[str, X] config fields are supported"
        if not isinstance(value, dict):
            raise ValueError(f"{key}: must be a TOML table, {_write_instead(key, hint, value)}")
        return {name: _coerce(f"{key}.{name}", value_hint, v) for name, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}: must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}: must be an integer, got {value!r}")
        return value
    if hint is float:
        if not _is_number(value):
            raise ValueError(f"{key}: must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{key}: must be a string, got {value!r}")
        return value
    raise AssertionError(f"{key}: unsupported config type {hint!r}")


def _write_instead(key: str, hint: Any, value: Any) -> str:
    """The TOML to write for an array or table field given `value`: the old comma-separated
    string ("a=1, b=2" or "a, b") converted where it parses, else an example."""
    section, _, name = key.partition(".")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    parts = [p.strip() for p in value.split(",") if p.strip()] if isinstance(value, str) else []
    if origin is tuple:
        shown: Any = parts if parts else ["name", "other"]
    else:
        pairs = [p.partition("=") for p in parts]
        shown = {k.strip(): v.strip() for k, sep, v in pairs if sep and k.strip()}
        if len(shown) != len(parts) or not shown:
            shown = {"name": "pkg.mod:function" if args[1] is str else 1.0}
        elif args[1] is float:
            shown = {k: _number_or_text(v) for k, v in shown.items()}
    toml = _toml_value(shown)
    return f"write {name} = {toml} under [{section}] (--set '{key}={toml}'); got {value!r}"


def _number_or_text(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def _apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `--set` item to the raw tables: `section.key=value` or, for a table field,
    `section.key.name=value`. The value is TOML (`0.5`, `"x"`, `["a", "b"]`, `{a = 1}`); a
    bare word that is not TOML (`vllm`, `pkg.mod:fn`) is a string."""
    if "=" not in item:
        raise ValueError(f"--set {item!r}: expected section.key=value")
    dotted, text = item.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"--set {item!r}: expected section.key=value or section.key.name=value")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word such as `vllm` is a string
    section = raw.setdefault(parts[0], {})
    if not isinstance(section, dict):
        raise ValueError(f"{parts[0]}: must be a table, got {section!r}")
    if len(parts) == 2:
        section[parts[1]] = value
        return
    key, entry = parts[1], parts[2]
    hint, default = _field_of(parts[0], key)
    if hint is None:  # unknown section or key: from_dict names it
        section[key] = {entry: value}
        return
    if typing.get_origin(hint) is not dict:
        raise ValueError(
            f"--set {item!r}: {parts[0]}.{key} is not a table; write --set {parts[0]}.{key}=VALUE"
        )
    current = section[key] if key in section else default
    table = dict(_coerce(f"{parts[0]}.{key}", hint, current))
    table[entry] = value
    section[key] = table


def _field_of(section: str, key: str) -> tuple[Any, Any]:
    """(type hint, default value) of `section.key`, or (None, None) when there is no such field."""
    sections = {f.name for f in dataclasses.fields(RunConfig)}
    if section not in sections:
        return None, None
    cls = _section_class(section)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if key not in fields:
        return None, None
    f = fields[key]
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return typing.get_type_hints(cls)[key], copy.deepcopy(default)


# --- writing the resolved config ------------------------------------------------------------------


def to_toml(config: RunConfig) -> str:
    """Render the resolved config as TOML (written into the run directory)."""
    lines: list[str] = []
    for section, values in config.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    """One TOML value: scalars as JSON writes them (valid TOML), arrays, inline tables."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    return json.dumps(value)


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)
