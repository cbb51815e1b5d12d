"""The wire protocol: how asyncrl's messages (asyncrl/protocol/messages.py) travel. This module
owns the codec: the wire schema of every message, the encoder, the decoder, and Batch frame
packing. The hot paths for groups and credits are asyncrl/protocol/group_codec.py.

A message is a ZeroMQ multipart message. Frame 0 is a msgpack map, the header:
``{"type": <name>, "protocol": PROTOCOL_VERSION, <field>: <value>, ...}``. Array fields are
not in the header; the header holds a reference ``{"dtype", "shape", "frame"}`` and frames
1..k carry the raw contiguous buffers (sent with ``copy=False``; decoded with
``np.frombuffer``, so a decoded array is a read-only view of the received frame). A message
that carries groups (a `Batch`) embeds each as a whole Group message: its header lists how
many frames each group takes (``"groups": [4, 4, ...]``) and those frames follow, each group's
header first, its array references counted from its own header (protocol 2; a hub forwards
the frames it received). A Batch may come packed: all its frames after the header in one,
their sizes in the header's ``"packed"`` (protocol 3; frame packing, below). Nothing
is ever pickled.

Evolution: fields are only appended, with defaults; a decoder ignores header keys it does not
know and fills defaults for keys it does not get. An appended field marked `omit_default` is
left out of the header while it holds its default, so older peers see the bytes they always
saw. Anything else bumps `PROTOCOL_VERSION`. Golden bytes of each message are pinned by
tests/unit/test_protocol.py.

Decoding validates everything and raises `ProtocolError` naming the field: the header type,
field types, array dtypes and shapes, the consistency of a group's token arrays with its
prompt lengths, finite floats, and the total size against the configured limit. Groups, the bulk of the traffic, take a
compiled fast path first (asyncrl/protocol/group_codec.py) that accepts only what the generic path
accepts, and hands anything unusual to it.
`decode(..., check_values=False)` skips what the hub checked when a group arrived: the values
of its arrays and the rules between its fields (see group_codec: for batches from the hub).

The wire schema (`SPECS`) of every message is computed once from its dataclass: each field's
kind (int, float, str, bool, map, lists, array, nested messages), whether it is required, its
default, and for arrays their dtype and rank. `encode` and `decode` work by these specs. The
decoder: frames in, a validated message out, or `ProtocolError` naming the field. Groups and
credits, most of the traffic, take the compiled fast paths first; anything unusual comes down to
the generic path here, which checks every field against its spec and names whatever is wrong.

Frame packing: the buffers of a `Batch` in one frame instead of four per group.

ZeroMQ moves every frame of a multipart message as a message of its own, and both sides pay
for each: the sending I/O thread writes each large frame with system calls of its own, the
receiving one reads it so, and the receiving Python code makes a `zmq.Frame` and a memoryview
of it (bench/zmq_framing.py: four frames per 32 KB group cost the sender 1.7x and the receiver
1.5x the CPU of one frame). A `Batch` of 64 groups of 32 KB is 257 frames.

So a sender may pack frames 1..n of a Batch into one: the buffers back to back, each starting
at the next multiple of `ALIGN` bytes (arrays stay aligned), their sizes listed in the header
under `"packed"`. The receiver restores frames 1..n as memoryviews of the frame it got before
it decodes anything else, so a packed Batch decodes exactly as the unpacked one (the arrays
of its groups are views of that frame, which lives as long as one of them does).

Packing costs a copy of the batch's bytes, which pays while frames are small: the hub packs a
Batch when its frames average fewer than `replay.pack_frames_below` bytes (bench/transport.py
`--variants hub,hub_unpacked` measures both ways side by side). Only a Batch is packed: groups
travel as the actor framed them, so the hub can forward and log the frames it received.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import msgspec
import numpy as np

from asyncrl.protocol.group_codec import (
    check_group,
    decode_credits,
    decode_group,
    encode_group,
    new_message,
    payload,
    remember_frames,
    wire_frames,
)
from asyncrl.protocol.messages import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Batch,
    CreditItem,
    Group,
    Message,
    ProtocolError,
)


@dataclass(frozen=True)
class _Spec:
    name: str
    kind: str  # int float str bool map ints floats strs array msgs
    required: bool
    default: Any
    dtype: str = ""
    ndim: int = 0
    nested: type | None = None
    omit: bool = False  # an appended field left off the wire at its default


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
                omit=f.metadata.get("omit_default", False),
            )
        )
    return tuple(specs)


SPECS: dict[type, tuple[_Spec, ...]] = {cls: _specs_of(cls) for cls in (*MESSAGE_TYPES, CreditItem)}
BY_NAME: dict[str, type] = {cls.TYPE: cls for cls in MESSAGE_TYPES}


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
    (asyncrl/py)."""
    frames: list[Any] = [b""]
    header = encode_group(msg, frames) if type(msg) is Group else _encode_obj(msg, frames)
    header["type"] = msg.TYPE
    header["protocol"] = PROTOCOL_VERSION
    packed = pack(frames, pack_below) if type(msg) is Batch else None
    if packed is not None:
        header[PACKED], body = packed
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


# field kinds as small ints, compared in the hot loop of _decode_obj
_K_INT, _K_FLOAT, _K_STR, _K_BOOL, _K_MAP, _K_INTS, _K_FLOATS, _K_STRS, _K_ARRAY, _K_MSGS = range(
    10
)
_KIND_CODE = {
    "int": _K_INT,
    "float": _K_FLOAT,
    "str": _K_STR,
    "bool": _K_BOOL,
    "map": _K_MAP,
    "ints": _K_INTS,
    "floats": _K_FLOATS,
    "strs": _K_STRS,
    "array": _K_ARRAY,
    "msgs": _K_MSGS,
}
_TYPE_WORD = {_K_INT: "an integer", _K_STR: "a string", _K_BOOL: "a boolean", _K_MAP: "a map"}
_EXACT_TYPE = {_K_INT: int, _K_STR: str, _K_BOOL: bool, _K_MAP: dict}


def _fields_of(cls: type) -> tuple[tuple[Any, ...], ...]:
    out = []
    for s in SPECS[cls]:
        factory = callable(s.default) and not s.required
        itemsize = np.dtype(s.dtype).itemsize if s.dtype else 0
        out.append(
            (
                s.name,
                _KIND_CODE[s.kind],
                s.required,
                factory,
                s.default,
                s.dtype,
                s.ndim,
                s.nested,
                itemsize,
            )
        )
    return tuple(out)


_FIELDS: dict[type, tuple[tuple[Any, ...], ...]] = {cls: _fields_of(cls) for cls in SPECS}


def decode(
    frames: Sequence[Any],
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    *,
    check_values: bool = True,
) -> Message:
    """Frames -> message, validating everything. Raises `ProtocolError` naming the field.

    `check_values=False` is for groups the hub has already checked (asyncrl/protocol/group_codec.py):
    the values of their arrays are not scanned again, nor the rules between their fields;
    types, list lengths and array sizes still are.
    """
    if not frames:
        raise ProtocolError("frames", "empty message")
    # zmq.Frames, bytes, memoryviews, arrays: anything with the buffer protocol. A Frame's own
    # `.buffer` would also make (and keep) a weak reference: twice the cost of the memoryview
    bufs = list(map(memoryview, frames))
    total = sum([b.nbytes for b in bufs])
    if total > max_message_bytes:
        raise ProtocolError(
            "message", f"{total} bytes exceeds the limit of {max_message_bytes}", "too_large"
        )
    return _decode_message(frames, bufs, check_values)


def _decode_message(
    frames: Sequence[Any], bufs: list[memoryview], values: bool, path: str = "", index: int = -1
) -> Message:
    """One whole message: a top-level one, or the `index`-th embedded in field `path` of
    another (the prefix of its error fields is built only if the generic path needs it)."""
    group = decode_group(bufs, values)  # the usual message, on its compiled fast path
    if group is not None:
        remember_frames(group, frames)
        return group
    credits = None if index >= 0 else decode_credits(bufs)  # what actors decode most
    if credits is not None:
        return credits
    prefix = f"{path}[{index}]." if index >= 0 else ""
    try:
        header = msgpack.unpackb(bufs[0], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(
            prefix + "header", f"not a msgpack map ({type(exc).__name__})"
        ) from None
    if type(header) is not dict:
        raise ProtocolError(prefix + "header", f"must be a map, got {type(header).__name__}")
    protocol = header.get("protocol")
    if type(protocol) is not int or protocol != PROTOCOL_VERSION:
        raise ProtocolError(
            prefix + "protocol",
            f"version {protocol!r} is not {PROTOCOL_VERSION}",
            "protocol_mismatch",
        )
    name = header.get("type")
    cls = BY_NAME.get(name) if type(name) is str else None
    if cls is None or (prefix and cls is not Group):  # only groups are embedded
        raise ProtocolError(prefix + "type", f"unknown message type {name!r}")
    if PACKED in header:
        if cls is not Batch or prefix:
            raise ProtocolError(prefix + PACKED, "only a whole Batch may be packed")
        bufs = unpack(header.pop(PACKED), bufs)
    used: set[int] = set()
    msg = _decode_obj(cls, header, bufs, used, prefix, values)
    if len(used) != len(bufs) - 1:
        raise ProtocolError(
            prefix + "frames", f"{len(bufs) - 1} array frames sent, {len(used)} referenced"
        )
    if cls is Group:
        remember_frames(msg, frames)
    return msg


def _decode_obj(
    cls: type,
    data: dict[str, Any],
    bufs: list[memoryview],
    used: set[int],
    prefix: str,
    values: bool,
) -> Any:
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
            value = _decode_msgs(nested, value, bufs, used, prefix + name, values)
        kwargs[name] = value
    if cls is Group:
        check_group(kwargs, prefix, values)
    return new_message(cls, kwargs)


def _decode_float(value: Any, path: str) -> float:
    if type(value) is float:
        if not math.isfinite(value):
            raise ProtocolError(path, f"must be finite, got {value}")
        return value
    if type(value) is int:
        return float(value)
    raise ProtocolError(path, f"must be a number, got {type(value).__name__}")


def _decode_msgs(
    nested: type, value: Any, bufs: list[memoryview], used: set[int], path: str, values: bool
) -> tuple:
    if type(value) is not list:
        raise ProtocolError(path, f"must be a list, got {type(value).__name__}")
    if nested is Group:
        return _decode_embedded(value, bufs, used, path, values)
    items = []
    for i, item in enumerate(value):
        if type(item) is not dict:
            raise ProtocolError(f"{path}[{i}]", "must be a map")
        items.append(_decode_obj(nested, item, bufs, used, f"{path}[{i}].", values))
    return tuple(items)


def _decode_embedded(
    counts: list[Any], bufs: list[memoryview], used: set[int], path: str, values: bool
) -> tuple[Group, ...]:
    """Groups embedded whole: `counts[i]` frames each (header first), in order, right after
    the frames the outer message's own fields took."""
    start = pos = len(used) + 1
    groups, num_bufs, outer = [], len(bufs), bool(used)  # outer: frames the outer fields took
    for i, count in enumerate(counts):
        if type(count) is not int or count < 1:
            raise ProtocolError(f"{path}[{i}]", f"must be a frame count >= 1, got {count!r}")
        end = pos + count
        if end > num_bufs or (outer and not used.isdisjoint(range(pos, end))):
            raise ProtocolError(
                f"{path}[{i}]", f"{count} frames from frame {pos}: not sent", "truncated"
            )
        frames = bufs[pos:end]
        groups.append(_decode_message(frames, frames, values, path, i))
        pos = end
    used.update(range(start, pos))
    return tuple(groups)


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


_INT, _STR, _NUM = {int}, {str}, {int, float}
_REF_KEYS = {"dtype", "shape", "frame"}


def _decode_array(
    dtype: str,
    ndim: int,
    itemsize: int,
    ref: Any,
    bufs: list[memoryview],
    used: set[int],
    path: str,
) -> np.ndarray:
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


ALIGN = 8
PACKED = "packed"  # the header key
_PAD = [b"\0" * (-r % ALIGN) for r in range(ALIGN)]


def pack(frames: list[Any], below: int) -> tuple[list[int], bytes] | None:
    """(sizes, body) for frames[1:] packed into one, or None when there is nothing to gain:
    fewer than two buffers, or buffers of `below` bytes or more on average."""
    bufs = frames[1:]
    if len(bufs) < 2:
        return None
    sizes = [memoryview(b).nbytes for b in bufs]
    if sum(sizes) >= below * len(sizes):
        return None
    parts: list[Any] = []
    for buf, size in zip(bufs, sizes, strict=True):
        parts.append(buf)
        if size % ALIGN:
            parts.append(_PAD[size % ALIGN])
    if parts[-1] is not bufs[-1]:
        parts.pop()  # no padding after the last buffer
    return sizes, b"".join(parts)


def unpack(sizes: Any, bufs: list[memoryview]) -> list[memoryview]:
    """The frames of a packed message, [header, buffer 1, ..., buffer n], from [header, body];
    raises ProtocolError naming `packed` when the sizes do not describe the body."""
    if type(sizes) is not list or not sizes or not all(type(n) is int and n >= 0 for n in sizes):
        raise ProtocolError(PACKED, "must be a non-empty list of buffer sizes (integers >= 0)")
    if len(bufs) != 2:
        raise ProtocolError(
            PACKED, f"a packed message has one frame after its header, got {len(bufs) - 1}"
        )
    body, out, pos = bufs[1], [bufs[0]], 0
    for size in sizes:
        pos += -pos % ALIGN
        out.append(body[pos : pos + size])
        pos += size
    if pos != body.nbytes:
        raise ProtocolError(
            PACKED, f"sizes need {pos} bytes, the frame holds {body.nbytes}", "truncated"
        )
    return out
