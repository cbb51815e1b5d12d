"""The sections every process reads: where a run lives (`run`), the model, the task, the replay hub
and the actors. Loaded and composed by asyncrl/config.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from asyncrl.config_checks import require


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
    """Tiny model: the model family to build (asyncrl/model_families.py)."""
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
    tools: str = ""
    """Tools offered, comma-separated (calculator, python, lookup); empty = the task's own."""
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

    @property
    def tool_names(self) -> tuple[str, ...]:
        """`tools` as a tuple of names (empty: the task decides)."""
        return tuple(t.strip() for t in self.tools.split(",") if t.strip())


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
    (a copy of its bytes instead of ZeroMQ's work per frame: asyncrl/frame_packing.py); 0 =
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
