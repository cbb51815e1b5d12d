"""The wire protocol's decoder (`decode`, re-exported by asyncrl/protocol.py, which says what
the bytes look like): frames in, a validated message out, or `ProtocolError` naming the field.

Groups and credits, most of the traffic, take compiled fast paths first (asyncrl/group_codec.py,
asyncrl/credit_codec.py); anything unusual comes down to the generic path here, which checks
every field against its spec (asyncrl/wire_specs.py) and names whatever is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from asyncrl import frame_packing
from asyncrl.credit_codec import decode_credits
from asyncrl.group_codec import check_group, decode_group, new_message, remember_frames
from asyncrl.messages import (
    DEFAULT_MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Batch,
    Group,
    Message,
    ProtocolError,
)
from asyncrl.wire_specs import BY_NAME, SPECS

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

    `check_values=False` is for groups the hub has already checked (asyncrl/group_codec.py):
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
    if frame_packing.PACKED in header:
        if cls is not Batch or prefix:
            raise ProtocolError(prefix + frame_packing.PACKED, "only a whole Batch may be packed")
        bufs = frame_packing.unpack(header.pop(frame_packing.PACKED), bufs)
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
