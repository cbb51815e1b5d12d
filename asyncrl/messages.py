"""The messages asyncrl processes exchange: one frozen dataclass per message type.

What travels is defined here; how (msgpack header + raw array frames) is asyncrl/protocol.py,
which re-exports every name of this module (`from asyncrl.protocol import Group`). Fields are
only appended, with defaults; one made with `appended_field` stays off the wire at its default,
so the bytes of every existing message stay as they were (golden bytes in
tests/unit/golden_wire.py). `Group` and `Trajectory` live in asyncrl/group_messages.py, the
protocol version, limits and `ProtocolError` in asyncrl/message_fields.py; both are
importable from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from asyncrl.group_messages import Group as Group
from asyncrl.group_messages import Trajectory as Trajectory
from asyncrl.message_fields import DEFAULT_MAX_MESSAGE_BYTES as DEFAULT_MAX_MESSAGE_BYTES
from asyncrl.message_fields import FINISH_REASONS as FINISH_REASONS
from asyncrl.message_fields import PROTOCOL_VERSION, ROLES, ProtocolError, appended_field
from asyncrl.score_messages import ScoreRequest, Scores

# --------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------


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
    """The learner's stability alarm fired (asyncrl/alarms.py); `action` is warn, pause (the
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
