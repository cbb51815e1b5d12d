"""The messages asyncrl processes exchange: one frozen dataclass per message type, and what
they all share (the protocol version, limits, enumerations, `ProtocolError`, the field markers).

What travels is defined here; how (msgpack header + raw array frames) is
asyncrl/protocol/codec.py. Fields are only appended, with defaults; one made with
`appended_field` stays off the wire at its default, so the bytes of every existing message stay
as they were (golden bytes in tests/unit/golden_wire.py).

- `array_field` marks an array carried in a frame of its own (dtype and rank checked on decode);
  `appended_field` a field appended to an existing message, off the wire at its default.
- `Trajectory` (one sample, as an actor builds it) and `Group` (all samples of one prompt, the
  unit of storage and sampling) are columnar: token-level arrays concatenated over the
  trajectories, scalars as lists.
- The hub's messages (Hello, Credits, Batch, Version, weights, control, status) follow, then the
  reward-model server's (`ScoreRequest`, `Scores`, `StatsRequest`, `Stats`): a client sends texts
  and gets one float32 per sample back, or an `Error` carrying the same `request_id`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

PROTOCOL_VERSION = 3  # 2: a Batch embeds its groups as whole Group messages; 3: packed Batch
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
FINISH_REASONS = ("stop", "length", "abort", "error", "turn_limit", "tool_error", "timeout")
ROLES = ("actor", "learner", "client")


class ProtocolError(Exception):
    """A message that cannot be accepted; `field` names the offending part."""

    def __init__(self, field: str, detail: str, code: str = "bad_message") -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail
        self.code = code


def array_field(dtype: str, ndim: int = 1) -> Any:
    """An array field: sent in a frame of its own, its dtype and number of dimensions checked on
    decode."""
    return field(metadata={"dtype": dtype, "ndim": ndim})


def appended_field(default: Any = None, *, factory: Any = None) -> Any:
    """A field appended to an existing message: off the wire while it holds its default."""
    if factory is not None:
        return field(default_factory=factory, metadata={"omit_default": True})
    return field(default=default, metadata={"omit_default": True})


@dataclass(frozen=True, kw_only=True)
class Trajectory:
    """One sample of a group, as the actor builds it (not a wire message by itself)."""

    tokens: np.ndarray  # int32 [L]: prompt + completion
    prompt_len: int
    loss_mask: np.ndarray  # uint8 [L - prompt_len]: 1 where the model produced the token
    behavior_logprobs: np.ndarray  # float32 [L - prompt_len]: 0 where loss_mask is 0
    reward: float
    min_policy_version: int
    max_policy_version: int
    finish_reason: str
    trajectory_id: str = ""
    reward_failed: str = ""  # why the reward could not be computed ("" = it was)
    num_turns: int = 1  # model turns of the episode
    tool_s: float = 0.0  # seconds the episode spent in tool calls
    env_s: float = 0.0  # seconds the episode spent in the environment (tools included)
    version_spans: tuple[int, ...] = ()
    """Flat (first completion token, policy version) pairs, one per version the trajectory
    spans, in order; empty = not recorded: every token counts as `min_policy_version`'s (the
    oldest, as the hub's bound does)."""

    @property
    def completion_tokens(self) -> np.ndarray:
        return self.tokens[self.prompt_len :]

    def token_versions(self) -> np.ndarray:
        """int32 [L - prompt_len]: the policy version behind each completion token (tokens an
        environment added carry the version of the model turn before them)."""
        out = np.full(len(self.tokens) - self.prompt_len, self.min_policy_version, np.int32)
        spans = self.version_spans
        for i in range(0, len(spans), 2):
            out[spans[i] :] = spans[i + 1]
        return out


@dataclass(frozen=True, kw_only=True)
class Group:
    """All samples of one prompt, the unit of storage and sampling (columnar on the wire)."""

    TYPE: ClassVar[str] = "Group"
    group_id: str
    prompt_id: str
    credit_id: int
    actor_id: str
    seq: int  # per-actor monotonic, for dedup of resends
    trajectory_ids: list[str]
    seq_lens: list[int]  # L_i = prompt_len_i + completion_len_i
    prompt_lens: list[int]
    rewards: list[float]
    min_policy_versions: list[int]
    max_policy_versions: list[int]
    finish_reasons: list[str]
    reward_failed: list[str]
    tokens: np.ndarray = array_field("int32")  # concat over trajectories of L_i tokens
    loss_mask: np.ndarray = array_field("uint8")  # concat of completion masks
    behavior_logprobs: np.ndarray = array_field("float32")  # concat of completion logprobs
    metadata: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    # per trajectory, or empty = not recorded (single-turn groups leave them off the wire)
    num_turns: list[int] = appended_field(factory=list)
    tool_s: list[float] = appended_field(factory=list)
    env_s: list[float] = appended_field(factory=list)
    # trajectories made by several policy versions (in-flight updates, multi-turn episodes):
    # flat (trajectory index, first completion token, version) triples; see Trajectory
    version_spans: list[int] = appended_field(factory=list)
    # reward component name -> one value per trajectory (finite floats); {} = not recorded
    reward_components: dict[str, list[float]] = appended_field(factory=dict)

    @property
    def size(self) -> int:
        return len(self.seq_lens)

    @property
    def min_policy_version(self) -> int:
        """The oldest policy that contributed a token: staleness is measured from it."""
        return min(self.min_policy_versions)

    @property
    def max_policy_version(self) -> int:
        return max(self.max_policy_versions)

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.loss_mask.nbytes + self.behavior_logprobs.nbytes

    def trajectories(self) -> list[Trajectory]:
        """Per-sample views into the columnar arrays (no copies)."""
        spans: dict[int, list[int]] = {}
        flat = self.version_spans
        for i in range(0, len(flat), 3):
            spans.setdefault(flat[i], []).extend(flat[i + 1 : i + 3])
        out: list[Trajectory] = []
        tok = comp = 0
        for i, (length, plen) in enumerate(zip(self.seq_lens, self.prompt_lens, strict=True)):
            clen = length - plen
            out.append(
                Trajectory(
                    tokens=self.tokens[tok : tok + length],
                    prompt_len=plen,
                    loss_mask=self.loss_mask[comp : comp + clen],
                    behavior_logprobs=self.behavior_logprobs[comp : comp + clen],
                    reward=self.rewards[i],
                    min_policy_version=self.min_policy_versions[i],
                    max_policy_version=self.max_policy_versions[i],
                    finish_reason=self.finish_reasons[i],
                    trajectory_id=self.trajectory_ids[i],
                    reward_failed=self.reward_failed[i],
                    num_turns=self.num_turns[i] if self.num_turns else 1,
                    tool_s=self.tool_s[i] if self.tool_s else 0.0,
                    env_s=self.env_s[i] if self.env_s else 0.0,
                    version_spans=tuple(spans.get(i, ())),
                )
            )
            tok += length
            comp += clen
        return out

    @classmethod
    def build(
        cls,
        *,
        group_id: str,
        prompt_id: str,
        credit_id: int,
        actor_id: str,
        seq: int,
        trajectories: Sequence[Trajectory],
        metadata: dict[str, Any] | None = None,
        timings: dict[str, float] | None = None,
        reward_components: dict[str, list[float]] | None = None,
    ) -> Group:
        """Concatenate per-sample trajectories into the columnar group."""
        if not trajectories:
            raise ValueError("a group needs at least one trajectory")
        return cls(
            group_id=group_id,
            prompt_id=prompt_id,
            credit_id=credit_id,
            actor_id=actor_id,
            seq=seq,
            trajectory_ids=[
                t.trajectory_id or f"{group_id}/{i}" for i, t in enumerate(trajectories)
            ],
            seq_lens=[int(t.tokens.shape[0]) for t in trajectories],
            prompt_lens=[int(t.prompt_len) for t in trajectories],
            rewards=[float(t.reward) for t in trajectories],
            min_policy_versions=[int(t.min_policy_version) for t in trajectories],
            max_policy_versions=[int(t.max_policy_version) for t in trajectories],
            finish_reasons=[t.finish_reason for t in trajectories],
            reward_failed=[t.reward_failed for t in trajectories],
            tokens=np.concatenate([np.asarray(t.tokens, np.int32) for t in trajectories]),
            loss_mask=np.concatenate([np.asarray(t.loss_mask, np.uint8) for t in trajectories]),
            behavior_logprobs=np.concatenate(
                [np.asarray(t.behavior_logprobs, np.float32) for t in trajectories]
            ),
            metadata=dict(metadata or {}),
            timings=dict(timings or {}),
            **_episode_lists(trajectories),
            version_spans=[
                x
                for i, t in enumerate(trajectories)
                for j in range(0, len(t.version_spans), 2)
                for x in (i, *t.version_spans[j : j + 2])
            ],
            reward_components={
                k: [float(v) for v in vs] for k, vs in (reward_components or {}).items()
            },
        )


def _episode_lists(trajectories: Sequence[Trajectory]) -> dict[str, list]:
    """The per-trajectory episode fields, or none when every trajectory has the defaults."""
    if all(t.num_turns == 1 and t.tool_s == 0.0 and t.env_s == 0.0 for t in trajectories):
        return {}
    return {
        "num_turns": [int(t.num_turns) for t in trajectories],
        "tool_s": [float(t.tool_s) for t in trajectories],
        "env_s": [float(t.env_s) for t in trajectories],
    }


SCORE_ERROR_CODES = ("bad_message", "bad_request", "overloaded", "timeout", "model_error")
"""`Error.code` values of the reward-model server; `overloaded` and `timeout` are worth a retry."""


@dataclass(frozen=True, kw_only=True)
class ScoreRequest:
    """Score `prompts[i] + completions[i]` for every i with the served reward model."""

    TYPE: ClassVar[str] = "ScoreRequest"
    request_id: int  # chosen by the client; echoed by the reply (Scores or Error)
    prompts: list[str]
    completions: list[str]  # as many as prompts
    timeout_s: float = 0.0  # longest wait in the server's queue; 0 = the server's default


@dataclass(frozen=True, kw_only=True)
class Scores:
    """The reward model's scalar for every sample of a `ScoreRequest`, in request order."""

    TYPE: ClassVar[str] = "Scores"
    request_id: int
    scores: np.ndarray = field(metadata={"dtype": "float32", "ndim": 1})  # float32 [n], finite
    model_dir: str  # the checkpoint that scored (provenance)
    model_hash: str  # sha256 prefix of its config.json and weight files
    queue_s: float = 0.0  # longest time one of the samples waited for a batch
    compute_s: float = 0.0  # model time of the batches that carried the samples


@dataclass(frozen=True, kw_only=True)
class Hello:
    """First message of every client: who it is and what it speaks. Answered by `Welcome`."""

    TYPE: ClassVar[str] = "Hello"
    role: str
    client_id: str
    protocol_version: int
    config_hash: str
    concurrency: int = 0  # groups an actor generates at once (its credit window)
    batched_acks: bool = appended_field(False)  # the client understands `Ack.seqs`
    session: int = appended_field(0)  # random per connection object; a new one = a restarted client
    acks_batches: bool = appended_field(
        False
    )  # a learner that sends BatchAck once it trained a batch


@dataclass(frozen=True, kw_only=True)
class Welcome:
    """The hub accepted a `Hello`."""

    TYPE: ClassVar[str] = "Welcome"
    client_id: str
    policy_version: int
    heartbeat_interval_s: float
    max_staleness: int
    next_seq: int = appended_field(0)  # the lowest seq this hub has not taken from this client id


@dataclass(frozen=True, kw_only=True)
class CreditItem:
    """One credit: permission to generate and push one group for this prompt."""

    TYPE: ClassVar[str] = "CreditItem"
    credit_id: int
    prompt_id: str
    prompt: str
    seed: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Credits:
    """Credits granted to an actor (several per message to keep the hub's send rate low)."""

    TYPE: ClassVar[str] = "Credits"
    group_size: int
    policy_version: int
    items: tuple[CreditItem, ...]
    min_weights_version: int = appended_field(0)
    """The oldest weights the actor may generate these credits with (the hub's floor: v - η
    rounded down to a published version, replay/core.py `weights_floor`); 0 = any."""


@dataclass(frozen=True, kw_only=True)
class CreditReturn:
    """An actor hands back credits it will not use (shutdown); their prompts are re-issued."""

    TYPE: ClassVar[str] = "CreditReturn"
    credit_ids: list[int]


@dataclass(frozen=True, kw_only=True)
class Ack:
    """The hub stored (or had already stored) the group with this per-actor `seq`, and the
    groups with the `seqs` (one Ack per burst, only to clients whose Hello set batched_acks)."""

    TYPE: ClassVar[str] = "Ack"
    seq: int
    credit_id: int = -1
    seqs: list[int] = appended_field(factory=list)


@dataclass(frozen=True, kw_only=True)
class SampleRequest:
    """The learner asks for a batch of `num_groups` groups for training at `policy_version`."""

    TYPE: ClassVar[str] = "SampleRequest"
    request_id: int
    policy_version: int
    num_groups: int


@dataclass(frozen=True, kw_only=True)
class Batch:
    """Groups handed to the learner; none staler than η at `policy_version`."""

    TYPE: ClassVar[str] = "Batch"
    request_id: int
    policy_version: int
    groups: tuple[Group, ...]
    dropped_stale: int = 0  # groups dropped as too stale since the previous batch
    wait_s: float = 0.0  # how long the request waited at the hub for eligible groups


@dataclass(frozen=True, kw_only=True)
class Version:
    """The learner finished an optimizer step: this is the new policy version."""

    TYPE: ClassVar[str] = "Version"
    policy_version: int


@dataclass(frozen=True, kw_only=True)
class Members:
    """The hub's answer to `Version`: the actors alive now (weight broadcast membership)."""

    TYPE: ClassVar[str] = "Members"
    policy_version: int
    actor_ids: list[str]
    # each actor's session (Hello.session), so a restarted actor under the same id shows up
    sessions: list[int] = appended_field(factory=list)


@dataclass(frozen=True, kw_only=True)
class WeightsAnnounce:
    """New weights are on the way; `announcement` holds the broadcast rendezvous."""

    TYPE: ClassVar[str] = "WeightsAnnounce"
    policy_version: int
    plan_hash: str
    announcement: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class WeightsLoaded:
    """An actor swapped in the weights of `policy_version`."""

    TYPE: ClassVar[str] = "WeightsLoaded"
    actor_id: str
    policy_version: int


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    """A client is alive (sent every heartbeat_interval_s)."""

    TYPE: ClassVar[str] = "Heartbeat"
    client_id: str
    policy_version: int = 0


@dataclass(frozen=True, kw_only=True)
class StatsRequest:
    """Ask the hub for its counters."""

    TYPE: ClassVar[str] = "StatsRequest"


@dataclass(frozen=True, kw_only=True)
class Stats:
    """The hub's counters and gauges (see replay/server.py for the keys)."""

    TYPE: ClassVar[str] = "Stats"
    stats: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class Error:
    """A message was refused; `field` names what was wrong. The connection stays usable."""

    TYPE: ClassVar[str] = "Error"
    code: str
    field: str
    detail: str
    request_id: int = appended_field(
        -1
    )  # the ScoreRequest refused (reward-model server); -1 = none


@dataclass(frozen=True, kw_only=True)
class Bye:
    """A client leaves (its outstanding credits are re-issued)."""

    TYPE: ClassVar[str] = "Bye"
    client_id: str
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class BatchAck:
    """The learner trained on the batch of `request_id` and on every batch it requested
    before (cumulative): the hub forgets their groups. Until then it lends them, and gives
    them out again if this learner's session ends."""

    TYPE: ClassVar[str] = "BatchAck"
    request_id: int


@dataclass(frozen=True, kw_only=True)
class StatusRequest:
    """Ask the hub for a live summary (`asyncrl status`); answered by `Status`. Needs no Hello:
    any peer the socket admits (loopback, or a CURVE key on the allow-list) may ask."""

    TYPE: ClassVar[str] = "StatusRequest"


@dataclass(frozen=True, kw_only=True)
class Status:
    """The hub's live summary: clients, versions, staleness, throughput, errors, alarms, evals
    (see replay/observer.py for the keys)."""

    TYPE: ClassVar[str] = "Status"
    status: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class AlarmRaised:
    """The learner's stability alarm fired (learner/alarms.py); `action` is warn, pause (the
    hub grants no more credits until resumed) or stop (the learner checkpoints and stops)."""

    TYPE: ClassVar[str] = "AlarmRaised"
    name: str
    step: int
    policy_version: int
    message: str
    action: str
    evidence: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class Control:
    """An operator's command to the hub: `pause` or `resume` the actors' credits. Like
    `StatusRequest`, it needs no Hello."""

    TYPE: ClassVar[str] = "Control"
    action: str
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class EvalRequest:
    """The hub asks one actor to evaluate the held-out prompts with weights at least as new as
    `policy_version`: `num_samples` samples each, outside the training stream."""

    TYPE: ClassVar[str] = "EvalRequest"
    eval_id: int
    policy_version: int
    items: tuple[CreditItem, ...]
    num_samples: int
    temperature: float  # 0 = greedy
    max_new_tokens: int
    pass_threshold: float  # a sample passes when its reward is at least this


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    """An actor's answer to `EvalRequest`, forwarded by the hub to the learner. Per-sample lists
    are prompt-major: the `num_samples` samples of prompt_ids[0] first."""

    TYPE: ClassVar[str] = "EvalResult"
    eval_id: int
    actor_id: str
    policy_version: int  # the weights every sample was generated with
    requested_version: int
    num_samples: int
    pass_threshold: float
    prompt_ids: list[str]
    rewards: list[float]
    lengths: list[int]
    finish_reasons: list[str]
    reward_failed: list[str]
    generate_s: float


MESSAGE_TYPES: tuple[type, ...] = (
    Hello,
    Welcome,
    Credits,
    CreditReturn,
    Group,
    Ack,
    SampleRequest,
    Batch,
    Version,
    Members,
    WeightsAnnounce,
    WeightsLoaded,
    Heartbeat,
    StatsRequest,
    Stats,
    Error,
    Bye,
    BatchAck,
    StatusRequest,
    Status,
    AlarmRaised,
    Control,
    EvalRequest,
    EvalResult,
    ScoreRequest,
    Scores,
)
Message = (
    Hello
    | Welcome
    | Credits
    | CreditReturn
    | Group
    | Ack
    | SampleRequest
    | Batch
    | Version
    | Members
    | WeightsAnnounce
    | WeightsLoaded
    | Heartbeat
    | StatsRequest
    | Stats
    | Error
    | Bye
    | BatchAck
    | StatusRequest
    | Status
    | AlarmRaised
    | Control
    | EvalRequest
    | EvalResult
    | ScoreRequest
    | Scores
)


def check_hello(hello: Hello, config_hash: str) -> None:
    """Refuse a client that speaks another protocol or runs another configuration."""
    if hello.protocol_version != PROTOCOL_VERSION:
        raise ProtocolError(
            "protocol_version",
            f"client speaks {hello.protocol_version}, hub speaks {PROTOCOL_VERSION}",
            "protocol_mismatch",
        )
    if hello.config_hash != config_hash:
        raise ProtocolError(
            "config_hash",
            f"client config {hello.config_hash} != hub config {config_hash}",
            "config_mismatch",
        )
    if hello.role not in ROLES:
        raise ProtocolError("role", f"must be one of {list(ROLES)}, got {hello.role!r}")
    if not hello.client_id:
        raise ProtocolError("client_id", "must not be empty")
