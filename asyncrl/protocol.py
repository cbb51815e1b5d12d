"""The wire protocol: how asyncrl's messages (asyncrl/messages.py) travel, and its codec.

A message is a ZeroMQ multipart message. Frame 0 is a msgpack map, the header:
``{"type": <name>, "protocol": PROTOCOL_VERSION, <field>: <value>, ...}``. Array fields are
not in the header; the header holds a reference ``{"dtype", "shape", "frame"}`` and frames
1..k carry the raw contiguous buffers (sent with ``copy=False``; decoded with
``np.frombuffer``, so a decoded array is a read-only view of the received frame). A message
that carries groups (a `Batch`) embeds each as a whole Group message: its header lists how
many frames each group takes (``"groups": [4, 4, ...]``) and those frames follow, each group's
header first, its array references counted from its own header (protocol 2; a hub forwards
the frames it received). A Batch may come packed: all its frames after the header in one,
their sizes in the header's ``"packed"`` (protocol 3; asyncrl/frame_packing.py). Nothing is
ever pickled. Every name of asyncrl/messages.py is
re-exported here.

Evolution: fields are only appended, with defaults; a decoder ignores header keys it does not
know and fills defaults for keys it does not get. An appended field marked `omit_default` is
left out of the header while it holds its default, so older peers see the bytes they always
saw. Anything else bumps `PROTOCOL_VERSION`. Golden bytes of each message are pinned by
tests/unit/test_protocol.py.

Decoding validates everything and raises `ProtocolError` naming the field: the header type,
field types, array dtypes and shapes, the consistency of a group's token arrays with its
prompt lengths, finite floats, and the total size against the configured limit (the decoder
lives in asyncrl/wire_decode.py; this module encodes). Groups, the bulk of the traffic, take a
compiled fast path first (asyncrl/group_codec.py) that accepts only what the generic path
accepts, and hands anything unusual to it.
`decode(..., check_values=False)` skips what the hub checked when a group arrived: the values
of its arrays and the rules between its fields (see group_codec: for batches from the hub).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from asyncrl import frame_packing
from asyncrl.group_codec import (
    encode_group,
    payload,
    wire_frames,
)
from asyncrl.messages import (
    DEFAULT_MAX_MESSAGE_BYTES,
    FINISH_REASONS,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    ROLES,
    Ack,
    AlarmRaised,
    Batch,
    BatchAck,
    Bye,
    Control,
    CreditItem,
    CreditReturn,
    Credits,
    Error,
    EvalRequest,
    EvalResult,
    Group,
    Heartbeat,
    Hello,
    Members,
    Message,
    ProtocolError,
    SampleRequest,
    ScoreRequest,
    Scores,
    Stats,
    StatsRequest,
    Status,
    StatusRequest,
    Trajectory,
    Version,
    WeightsAnnounce,
    WeightsLoaded,
    Welcome,
    check_hello,
)
from asyncrl.wire_decode import decode
from asyncrl.wire_specs import SPECS

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "FINISH_REASONS",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "ROLES",
    "Ack",
    "Batch",
    "BatchAck",
    "Bye",
    "CreditItem",
    "CreditReturn",
    "Credits",
    "Error",
    "Group",
    "Heartbeat",
    "Hello",
    "Members",
    "Message",
    "ProtocolError",
    "SampleRequest",
    "ScoreRequest",
    "Scores",
    "Stats",
    "StatsRequest",
    "Trajectory",
    "Version",
    "WeightsAnnounce",
    "WeightsLoaded",
    "Welcome",
    "check_hello",
    "decode",
    "encode",
    "AlarmRaised",
    "Control",
    "EvalRequest",
    "EvalResult",
    "Status",
    "StatusRequest",
]


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """What encoding changes in a message's field dict (everything else goes out as is)."""

    floats: tuple[str, ...]
    arrays: tuple[tuple[str, str], ...]  # (name, dtype)
    msgs: tuple[str, ...]
    omitted: tuple[tuple[str, Any], ...]  # (name, default): off the wire at the default
    nested: dict[str, type]  # message fields: the type of their items
    plain: bool  # none of the above: the field dict goes out as it is


def _plan_of(cls: type) -> _Plan:
    specs = SPECS[cls]
    arrays = tuple((s.name, s.dtype) for s in specs if s.kind == "array")
    msgs = tuple(s.name for s in specs if s.kind == "msgs")
    # frames are numbered in field order; no message mixes array and nested-message fields,
    # so handling arrays before nested messages keeps that order
    assert not (arrays and msgs), f"{cls.__name__}: arrays and nested messages together"
    assert not hasattr(cls, "__post_init__"), f"{cls.__name__}: decode bypasses __init__"
    omitted = tuple(
        (s.name, s.default() if callable(s.default) else s.default) for s in specs if s.omit
    )
    nested = {s.name: s.nested for s in specs if s.kind == "msgs"}
    floats = tuple(s.name for s in specs if s.kind == "float")
    plain = not (floats or arrays or msgs or omitted)
    return _Plan(floats, arrays, msgs, omitted, nested, plain)


def _embed(group: Group, frames: list[Any]) -> int:
    """Append a group's own message frames (the frames it was decoded from, when it was: a hub
    forwards what it received) and return how many there are."""
    own = wire_frames(group) or encode(group)
    frames.extend(own)
    return len(own)


_PLANS: dict[type, _Plan] = {cls: _plan_of(cls) for cls in SPECS}


def encode(msg: Message, pack_below: int = 0) -> list[Any]:
    """Message -> frames: [msgpack header, raw array buffers...]. Arrays are not copied, unless
    a `Batch` whose frames average fewer than `pack_below` bytes is packed into one frame
    (asyncrl/frame_packing.py)."""
    frames: list[Any] = [b""]
    header = encode_group(msg, frames) if type(msg) is Group else _encode_obj(msg, frames)
    header["type"] = msg.TYPE
    header["protocol"] = PROTOCOL_VERSION
    packed = frame_packing.pack(frames, pack_below) if type(msg) is Batch else None
    if packed is not None:
        header[frame_packing.PACKED], body = packed
        frames[1:] = [body]
    frames[0] = _pack(header)
    return frames


# msgspec writes the same msgpack bytes as msgpack.packb(use_bin_type=True) (the golden bytes
# pin it) in a quarter of the time
_pack = msgspec.msgpack.Encoder().encode


def _encode_obj(obj: Any, frames: list[Any]) -> dict[str, Any]:
    out = dict(obj.__dict__)  # the fields, in declaration order
    plan = _PLANS[type(obj)]
    if plan.plain:  # nothing to convert (a CreditItem, most small messages)
        return out
    for name in plan.floats:
        out[name] = float(out[name])
    for name, dtype in plan.arrays:
        arr = np.ascontiguousarray(out[name], dtype=dtype)
        out[name] = {"dtype": dtype, "shape": list(arr.shape), "frame": len(frames)}
        frames.append(payload(arr))
    for name in plan.msgs:
        items = out[name]
        if plan.nested[name] is Group:  # embedded whole: the header lists their frame counts
            out[name] = [_embed(g, frames) for g in items]
        else:
            out[name] = [_encode_obj(item, frames) for item in items]
    for name, default in plan.omitted:
        if out[name] == default:
            del out[name]
    return out
