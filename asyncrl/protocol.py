"""The wire protocol: every message asyncrl processes exchange, and its codec.

A message is a ZeroMQ multipart message. Frame 0 is a msgpack map, the header:
``{"type": <name>, "protocol": PROTOCOL_VERSION, <field>: <value>, ...}``. Array fields are
not in the header; the header holds a reference ``{"dtype", "shape", "frame"}`` and frames
1..k carry the raw contiguous buffers (sent with ``copy=False``; decoded with
``np.frombuffer``, so a decoded array is a read-only view of the received frame). Nothing is
ever pickled.

Evolution: fields are only appended, with defaults; a decoder ignores header keys it does not
know and fills defaults for keys it does not get. Anything else bumps `PROTOCOL_VERSION`.
Golden bytes of each message are pinned by tests/unit/test_protocol.py.

Decoding validates everything and raises `ProtocolError` naming the field: the header type,
field types, array dtypes and shapes, the consistency of a group's token arrays with its
prompt lengths, finite floats, and the total size against the configured limit.

A `Group` is columnar: the token-level arrays of all its trajectories are concatenated (one
frame each), per-trajectory scalars are header lists. `Group.trajectories()` gives per-sample
views without copying.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

PROTOCOL_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
FINISH_REASONS = ("stop", "length", "abort", "error")
ROLES = ("actor", "learner", "client")
_LOGPROB_SLACK = 1e-3  # behaviour logprobs are <= 0 up to float rounding


class ProtocolError(Exception):
    """A message that cannot be accepted; `field` names the offending part."""

    def __init__(self, field: str, detail: str, code: str = "bad_message") -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail
        self.code = code


def _array(dtype: str, ndim: int = 1) -> Any:
    return field(metadata={"dtype": dtype, "ndim": ndim})


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


@dataclass(frozen=True, kw_only=True)
class Welcome:
    """The hub accepted a `Hello`."""

    TYPE: ClassVar[str] = "Welcome"
    client_id: str
    policy_version: int
    heartbeat_interval_s: float
    max_staleness: int


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

    @property
    def completion_tokens(self) -> np.ndarray:
        return self.tokens[self.prompt_len :]


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
    tokens: np.ndarray = _array("int32")  # concat over trajectories of L_i tokens
    loss_mask: np.ndarray = _array("uint8")  # concat of completion masks
    behavior_logprobs: np.ndarray = _array("float32")  # concat of completion logprobs
    metadata: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

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
        )


@dataclass(frozen=True, kw_only=True)
class Ack:
    """The hub stored (or had already stored) the group with this per-actor `seq`."""

    TYPE: ClassVar[str] = "Ack"
    seq: int
    credit_id: int = -1


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


@dataclass(frozen=True, kw_only=True)
class Bye:
    """A client leaves (its outstanding credits are re-issued)."""

    TYPE: ClassVar[str] = "Bye"
    client_id: str
    reason: str = ""


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
)


# --------------------------------------------------------------------------------------------
# Field specs, computed once per class
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    name: str
    kind: str  # int float str bool map ints floats strs array msgs
    required: bool
    default: Any
    dtype: str = ""
    ndim: int = 0
    nested: type | None = None


_SCALAR_KINDS = {int: "int", float: "float", str: "str", bool: "bool"}
_LIST_KINDS = {int: "ints", float: "floats", str: "strs"}


def _specs_of(cls: type) -> tuple[_Spec, ...]:
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        nested = None
        if hint in _SCALAR_KINDS:
            kind = _SCALAR_KINDS[hint]
        elif hint is np.ndarray:
            kind = "array"
        elif origin is dict:
            kind = "map"
        elif origin is list and args[0] in _LIST_KINDS:
            kind = _LIST_KINDS[args[0]]
        elif origin is tuple and dataclasses.is_dataclass(args[0]):
            kind, nested = "msgs", args[0]
        else:
            raise AssertionError(f"{cls.__name__}.{f.name}: unsupported wire type {hint!r}")
        has_default = (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        )
        required = not has_default or kind == "array"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory
        specs.append(
            _Spec(
                f.name,
                kind,
                required,
                default,
                dtype=f.metadata.get("dtype", ""),
                ndim=f.metadata.get("ndim", 0),
                nested=nested,
            )
        )
    return tuple(specs)


_SPECS: dict[type, tuple[_Spec, ...]] = {
    cls: _specs_of(cls) for cls in (*MESSAGE_TYPES, CreditItem)
}
_BY_NAME: dict[str, type] = {cls.TYPE: cls for cls in MESSAGE_TYPES}


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """What encoding changes in a message's field dict (everything else goes out as is)."""

    floats: tuple[str, ...]
    arrays: tuple[tuple[str, str], ...]  # (name, dtype)
    msgs: tuple[str, ...]


def _plan_of(cls: type) -> _Plan:
    specs = _SPECS[cls]
    arrays = tuple((s.name, s.dtype) for s in specs if s.kind == "array")
    msgs = tuple(s.name for s in specs if s.kind == "msgs")
    # frames are numbered in field order; no message mixes array and nested-message fields,
    # so handling arrays before nested messages keeps that order
    assert not (arrays and msgs), f"{cls.__name__}: arrays and nested messages together"
    assert not hasattr(cls, "__post_init__"), f"{cls.__name__}: decode bypasses __init__"
    return _Plan(tuple(s.name for s in specs if s.kind == "float"), arrays, msgs)


_PLANS: dict[type, _Plan] = {cls: _plan_of(cls) for cls in _SPECS}


def encode(msg: Message) -> list[Any]:
    """Message -> frames: [msgpack header, raw array buffers...]. Arrays are not copied."""
    frames: list[Any] = [b""]
    header = _encode_obj(msg, frames)
    header["type"] = msg.TYPE
    header["protocol"] = PROTOCOL_VERSION
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


def _encode_obj(obj: Any, frames: list[Any]) -> dict[str, Any]:
    out = dict(obj.__dict__)  # the fields, in declaration order
    plan = _PLANS[type(obj)]
    for name in plan.floats:
        out[name] = float(out[name])
    for name, dtype in plan.arrays:
        arr = np.ascontiguousarray(out[name], dtype=dtype)
        out[name] = {"dtype": dtype, "shape": list(arr.shape), "frame": len(frames)}
        frames.append(_payload(arr))
    for name in plan.msgs:
        out[name] = [_encode_obj(item, frames) for item in out[name]]
    return out


def _payload(arr: np.ndarray) -> Any:
    """The frame to send for an array: a received frame it views whole is forwarded as is
    (ZeroMQ then shares that message's buffer: no copy, no Python reference tracking)."""
    if not arr.size:
        return b""
    base = arr.base
    if type(base) is memoryview and base.nbytes == arr.nbytes and hasattr(base.obj, "more"):
        whole = getattr(base.obj, "buffer", None)  # a zmq.Frame; only if the array is all of it
        if whole is not None and whole.nbytes == arr.nbytes:
            return base.obj
    return arr.data


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------

# field kinds as small ints, compared in the hot loop of _decode_obj
_K_INT, _K_FLOAT, _K_STR, _K_BOOL, _K_MAP, _K_INTS, _K_FLOATS, _K_STRS, _K_ARRAY, _K_MSGS = range(
    10
)
_KIND_CODE = {"int": _K_INT, "float": _K_FLOAT, "str": _K_STR, "bool": _K_BOOL, "map": _K_MAP,
              "ints": _K_INTS, "floats": _K_FLOATS, "strs": _K_STRS, "array": _K_ARRAY,
              "msgs": _K_MSGS}  # fmt: skip
_TYPE_WORD = {_K_INT: "an integer", _K_STR: "a string", _K_BOOL: "a boolean", _K_MAP: "a map"}
_EXACT_TYPE = {_K_INT: int, _K_STR: str, _K_BOOL: bool, _K_MAP: dict}


def _fields_of(cls: type) -> tuple[tuple[Any, ...], ...]:
    out = []
    for s in _SPECS[cls]:
        factory = callable(s.default) and not s.required
        itemsize = np.dtype(s.dtype).itemsize if s.dtype else 0
        out.append((s.name, _KIND_CODE[s.kind], s.required, factory, s.default, s.dtype, s.ndim,
                    s.nested, itemsize))  # fmt: skip
    return tuple(out)


_FIELDS: dict[type, tuple[tuple[Any, ...], ...]] = {cls: _fields_of(cls) for cls in _SPECS}


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame: already a memoryview
    return memoryview(frame) if buf is None else buf


def decode(frames: Sequence[Any], max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Frames -> message, validating everything. Raises `ProtocolError` naming the field."""
    if not frames:
        raise ProtocolError("frames", "empty message")
    bufs = [_buffer(f) for f in frames]
    total = sum([b.nbytes for b in bufs])
    if total > max_message_bytes:
        raise ProtocolError(
            "message", f"{total} bytes exceeds the limit of {max_message_bytes}", "too_large"
        )
    try:
        header = msgpack.unpackb(bufs[0], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError("header", f"not a msgpack map ({type(exc).__name__})") from None
    if type(header) is not dict:
        raise ProtocolError("header", f"must be a map, got {type(header).__name__}")
    protocol = header.get("protocol")
    if type(protocol) is not int or protocol != PROTOCOL_VERSION:
        raise ProtocolError(
            "protocol", f"version {protocol!r} is not {PROTOCOL_VERSION}", "protocol_mismatch"
        )
    name = header.get("type")
    cls = _BY_NAME.get(name) if type(name) is str else None
    if cls is None:
        raise ProtocolError("type", f"unknown message type {name!r}")
    used: set[int] = set()
    msg = _decode_obj(cls, header, bufs, used, "")
    if len(used) != len(bufs) - 1:
        raise ProtocolError("frames", f"{len(bufs) - 1} array frames sent, {len(used)} referenced")
    return msg


def _decode_obj(
    cls: type, data: dict[str, Any], bufs: list[memoryview], used: set[int], prefix: str
) -> Any:
    if cls is Group:  # the hot path; anything unusual falls through to the generic checks
        fast = _fast_group(data, bufs, used)
        if fast is not None:
            _check_group(fast, prefix)
            return _new(Group, fast)
    kwargs: dict[str, Any] = {}
    for name, kind, required, factory, default, dtype, ndim, nested, itemsize in _FIELDS[cls]:
        if name not in data:
            if required:
                raise ProtocolError(prefix + name, "missing")
            kwargs[name] = default() if factory else default
            continue
        value = data[name]
        if kind <= _K_MAP:
            if kind == _K_FLOAT:
                value = _decode_float(value, prefix + name)
            elif type(value) is not _EXACT_TYPE[kind]:
                word = _TYPE_WORD[kind]
                raise ProtocolError(prefix + name, f"must be {word}, got {type(value).__name__}")
        elif kind <= _K_STRS:
            value = _decode_list(kind, value, prefix + name)
        elif kind == _K_ARRAY:
            value = _decode_array(dtype, ndim, itemsize, value, bufs, used, prefix + name)
        else:
            value = _decode_msgs(nested, value, bufs, used, prefix + name)
        kwargs[name] = value
    if cls is Group:
        _check_group(kwargs, prefix)
    return _new(cls, kwargs)


def _new(cls: type, fields: dict[str, Any]) -> Any:
    """A frozen dataclass instance from its complete fields, in order, without __init__."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


_GROUP_SCALARS = operator.itemgetter("group_id", "prompt_id", "credit_id", "actor_id", "seq")
_GROUP_LISTS_IN_ORDER = operator.itemgetter(
    "trajectory_ids", "seq_lens", "prompt_lens", "rewards", "min_policy_versions",
    "max_policy_versions", "finish_reasons", "reward_failed",
)  # fmt: skip
_GROUP_ARRAYS = operator.itemgetter("tokens", "loss_mask", "behavior_logprobs")


def _fast_group(data: dict[str, Any], bufs: list[memoryview], used: set[int]) -> dict | None:
    """A well-formed group's fields with a few bulk type checks, or None to take the generic
    path (which finds and names whatever is wrong). Same result as the generic path."""
    try:
        gid, pid, cid, aid, seq = _GROUP_SCALARS(data)
        tids, seq_lens, prompt_lens, rewards, lo, hi, finish, failed = _GROUP_LISTS_IN_ORDER(data)
        refs = _GROUP_ARRAYS(data)
    except KeyError:
        return None
    if {type(gid), type(pid), type(aid)} != _STR or {type(cid), type(seq)} != _INT:
        return None
    if {type(tids), type(seq_lens), type(prompt_lens), type(rewards), type(lo), type(hi),
            type(finish), type(failed)} != _LIST:  # fmt: skip
        return None
    if not set(map(type, tids + finish + failed)) <= _STR:
        return None
    if not set(map(type, seq_lens + prompt_lens + lo + hi)) <= _INT:
        return None
    kinds = set(map(type, rewards))
    if kinds != _FLOAT:
        if not kinds <= _NUM:
            return None
        rewards = list(map(float, rewards))
    if not all(map(math.isfinite, rewards)):
        return None
    metadata, timings = data.get("metadata", {}), data.get("timings", {})
    if type(metadata) is not dict or type(timings) is not dict:
        return None
    arrays, indices = [], []
    for ref, dtype, itemsize in zip(refs, _GROUP_DTYPES, _GROUP_ITEMSIZES, strict=True):
        index = _fast_ref(ref, dtype, itemsize, bufs)
        if index is None or index in used or index in indices:
            return None
        indices.append(index)
        arrays.append(np.frombuffer(bufs[index], dtype))
    used.update(indices)
    return {
        "group_id": gid, "prompt_id": pid, "credit_id": cid, "actor_id": aid, "seq": seq,
        "trajectory_ids": tids, "seq_lens": seq_lens, "prompt_lens": prompt_lens,
        "rewards": rewards, "min_policy_versions": lo, "max_policy_versions": hi,
        "finish_reasons": finish, "reward_failed": failed, "tokens": arrays[0],
        "loss_mask": arrays[1], "behavior_logprobs": arrays[2], "metadata": metadata,
        "timings": timings,
    }  # fmt: skip


_GROUP_DTYPES = ("int32", "uint8", "float32")
_GROUP_ITEMSIZES = (4, 1, 4)


def _fast_ref(ref: Any, dtype: str, itemsize: int, bufs: list[memoryview]) -> int | None:
    """The frame index of a well-formed 1-d array reference whose frame fits, else None."""
    if type(ref) is not dict or len(ref) != 3:
        return None
    shape, index = ref.get("shape"), ref.get("frame")
    if ref.get("dtype") != dtype or type(shape) is not list or len(shape) != 1:
        return None
    n = shape[0]
    if type(n) is not int or n < 0 or type(index) is not int or not 0 < index < len(bufs):
        return None
    return index if bufs[index].nbytes == n * itemsize else None


def _decode_float(value: Any, path: str) -> float:
    if type(value) is float:
        if not math.isfinite(value):
            raise ProtocolError(path, f"must be finite, got {value}")
        return value
    if type(value) is int:
        return float(value)
    raise ProtocolError(path, f"must be a number, got {type(value).__name__}")


def _decode_msgs(
    nested: type, value: Any, bufs: list[memoryview], used: set[int], path: str
) -> tuple:
    if type(value) is not list:
        raise ProtocolError(path, f"must be a list, got {type(value).__name__}")
    items = []
    for i, item in enumerate(value):
        if type(item) is not dict:
            raise ProtocolError(f"{path}[{i}]", "must be a map")
        items.append(_decode_obj(nested, item, bufs, used, f"{path}[{i}]."))
    return tuple(items)


def _decode_list(kind: int, value: Any, path: str) -> list[Any]:
    if type(value) is not list:
        raise ProtocolError(path, f"must be a list, got {type(value).__name__}")
    kinds = set(map(type, value))
    if kind == _K_INTS:
        if not kinds <= _INT:
            raise ProtocolError(path, "must hold integers only")
    elif kind == _K_STRS:
        if not kinds <= _STR:
            raise ProtocolError(path, "must hold strings only")
    else:
        if not kinds <= _NUM:
            raise ProtocolError(path, "must hold numbers only")
        if int in kinds:
            value = list(map(float, value))
        if not all(map(math.isfinite, value)):
            raise ProtocolError(path, "must hold finite numbers only")
    return value


_INT, _STR, _NUM, _FLOAT, _LIST = {int}, {str}, {int, float}, {float}, {list}
_REF_KEYS = {"dtype", "shape", "frame"}


def _decode_array(dtype: str, ndim: int, itemsize: int, ref: Any, bufs: list[memoryview],
                  used: set[int], path: str) -> np.ndarray:  # fmt: skip
    if type(ref) is not dict or ref.keys() != _REF_KEYS:
        raise ProtocolError(path, "must be an array reference {dtype, shape, frame}")
    shape, index = ref["shape"], ref["frame"]
    if ref["dtype"] != dtype:
        raise ProtocolError(path, f"dtype must be {dtype}, got {ref['dtype']!r}")
    if (
        type(shape) is not list
        or len(shape) != ndim
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise ProtocolError(path, f"shape must be {ndim} non-negative integers, got {shape!r}")
    if type(index) is not int or not 1 <= index < len(bufs) or index in used:
        raise ProtocolError(path, f"frame index {index!r} is invalid or reused")
    used.add(index)
    buf = bufs[index]
    expected = math.prod(shape) * itemsize
    if buf.nbytes != expected:
        raise ProtocolError(
            path, f"frame holds {buf.nbytes} bytes, shape {shape} needs {expected}", "truncated"
        )
    arr = np.frombuffer(buf, dtype=dtype)
    return arr if ndim == 1 else arr.reshape(shape)


_MIN, _MAX = np.minimum.reduce, np.maximum.reduce
_GROUP_LISTS = ("trajectory_ids", "prompt_lens", "rewards", "min_policy_versions",
                "max_policy_versions", "finish_reasons", "reward_failed")  # fmt: skip


def _check_group(g: dict[str, Any], prefix: str) -> None:
    """Cross-field consistency of a group: lengths, masks, finite logprobs, versions."""
    seq_lens = g["seq_lens"]
    n = len(seq_lens)
    if n == 0:
        raise ProtocolError(prefix + "seq_lens", "a group needs at least one trajectory")
    for name in _GROUP_LISTS:
        if len(g[name]) != n:
            raise ProtocolError(prefix + name, f"has {len(g[name])} entries for {n} trajectories")
    prompt_lens = g["prompt_lens"]
    if min(prompt_lens) < 0 or any(map(int.__lt__, seq_lens, prompt_lens)):
        raise ProtocolError(prefix + "prompt_lens", "each must be in [0, seq_len]")
    tokens, mask, lp = g["tokens"], g["loss_mask"], g["behavior_logprobs"]
    num_tokens = sum(seq_lens)
    if tokens.shape[0] != num_tokens:
        raise ProtocolError(
            prefix + "tokens", f"holds {tokens.shape[0]} tokens, seq_lens sum to {num_tokens}"
        )
    num_completion = num_tokens - sum(prompt_lens)
    for name, arr in (("loss_mask", mask), ("behavior_logprobs", lp)):
        if arr.shape[0] != num_completion:
            raise ProtocolError(
                prefix + name,
                f"holds {arr.shape[0]} entries for {num_completion} completion tokens",
            )
    # ufunc.reduce directly: ndarray.min/max add a Python-level wrapper per call
    if num_tokens and _MIN(tokens) < 0:
        raise ProtocolError(prefix + "tokens", "token ids must be >= 0")
    if num_completion:
        if _MAX(mask) > 1:
            raise ProtocolError(prefix + "loss_mask", "must hold 0 or 1")
        # NaN propagates into max (and fails the comparison); -inf shows up in min
        if not (_MAX(lp) <= _LOGPROB_SLACK and _MIN(lp) > -math.inf):
            raise ProtocolError(prefix + "behavior_logprobs", "must be finite and <= 0")
    lo, hi = g["min_policy_versions"], g["max_policy_versions"]
    if min(lo) < 0 or any(map(int.__gt__, lo, hi)):
        raise ProtocolError(prefix + "min_policy_versions", "need 0 <= min <= max per trajectory")
    if not _FINISH.issuperset(g["finish_reasons"]):
        bad = sorted(set(g["finish_reasons"]) - _FINISH)[0]
        raise ProtocolError(
            prefix + "finish_reasons", f"{bad!r} is not one of {list(FINISH_REASONS)}"
        )
    timings = g["timings"]
    if timings and not (
        set(map(type, timings.values())) <= _NUM and all(map(math.isfinite, timings.values()))
    ):
        raise ProtocolError(prefix + "timings", "must map names to finite numbers")


_FINISH = set(FINISH_REASONS)


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
