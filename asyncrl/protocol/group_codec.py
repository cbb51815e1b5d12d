"""The codec's hot paths: `Group` headers in and out with the group consistency rules, and
`Credits`, the message an actor decodes most; compiled where asyncrl/protocol/_hotpath.c was
built, with a Python reference where it was not.

Groups are nearly all the bytes and most of the messages asyncrl moves, and every one is
decoded at least twice (the hub on arrival, the learner inside a `Batch`), so they get a
decoder of their own. `decode_group` takes a whole Group message in the canonical layout that
`encode` writes (header with exactly the known keys, array frames 1, 2, 3 in field order): the
header is parsed and type-checked in compiled code (msgspec, into `_Head`), then the rules
between fields take a handful of bulk checks. Anything else (an unknown key, an odd layout, a
refusal) answers None, and the caller takes the generic path of asyncrl/protocol/codec.py, which
finds and names whatever is wrong. The fast path never accepts what the generic path refuses
(tests/unit/test_protocol_fast_path.py pins it: typed parsing is at least as strict as msgpack
with strict map keys, and `metadata`, the one free-form map, is decoded by msgpack itself).

A decoded group remembers the frames it came in (`remember_frames`): a `Batch` embeds each
of its groups as that whole Group message, so the hub forwards what it received unchanged.

What a valid group is (`check_group` states it field by field):
- one or more trajectories; every per-trajectory list has one entry per trajectory;
- 0 <= prompt_len_i <= seq_len_i; `tokens` holds sum(seq_len_i) ids, all >= 0;
- `loss_mask` (0 or 1) and `behavior_logprobs` (finite, <= 0 up to float rounding) hold one
  entry per completion token, sum(seq_len_i - prompt_len_i);
- 0 <= min_policy_version_i <= max_policy_version_i; finish reasons from FINISH_REASONS;
  rewards and timings finite;
- the episode lists (`num_turns` >= 0, `tool_s`, `env_s` finite) are empty (not recorded, and
  then off the wire) or hold one entry per trajectory;
- `version_spans` (flat triples: trajectory, first completion token, version) lists, per
  trajectory it covers, spans in order: the first at token 0 with the trajectory's min version,
  later ones at increasing tokens inside its completion with increasing versions, the last
  with its max version; a trajectory it does not cover has no per-token versions recorded
  (its tokens count as its min version's, the oldest);
- `reward_components` maps names to one finite value per trajectory (empty = not recorded,
  and then off the wire).

The value rules (ids, masks, logprobs) scan the arrays: the only per-byte work of a decode.
After msgspec, the fast path is one call into asyncrl/protocol/_hotpath.c where that module was built
(setup.py; it needs a C compiler): the length rules, the rules between fields, the array
references and sizes, one pass over each array and the Group itself. `finish_group` below is
the same in Python and numpy, the reference that tests/unit/test_hotpath.py holds the compiled
one to, and what runs where it was not built.

`values=False` is for bytes the hub checked when they arrived (groups inside a `Batch`, records
read back from the hub's own log): the fast path then skips the value scans and the rules
between fields, and still checks types, list lengths and array sizes, so a
decoded group is always safe to index (and the rules on single values, which parsing checks at
no cost).

The fast path for `Credits`, the message an actor decodes most: one item for every
group it will push, so decoding them generically (a Python check per field of every item)
would cost the actor more than encoding the group it pushes for that credit.

`decode_credits` takes a Credits header exactly as `encode` writes it (the known keys only, no
array frames): msgspec parses and type-checks it into typed structs, `info` (the one free-form
map) is decoded by msgpack as the generic path decodes it. Anything unusual (an unknown key, a
wrong type, a frame too many) answers None and the caller takes the generic path of
asyncrl/protocol/codec.py, which names what is wrong; so the fast path never accepts what the generic
path refuses (tests/unit/test_protocol_fast_path.py pins it).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import sys
import typing
from collections.abc import Sequence
from typing import Any

import msgpack
import msgspec
import numpy as np

from asyncrl.protocol.messages import (
    FINISH_REASONS,
    PROTOCOL_VERSION,
    CreditItem,
    Credits,
    Group,
    ProtocolError,
)

try:
    from asyncrl.protocol import _hotpath
except ImportError:  # installed without a C compiler (setup.py): the Python below does it all
    _hotpath = None

LOGPROB_SLACK = 1e-3  # behaviour logprobs are <= 0 up to float rounding
GROUP_ARRAYS = (("tokens", "int32"), ("loss_mask", "uint8"), ("behavior_logprobs", "float32"))

_I32, _U8, _F32 = np.dtype(np.int32), np.dtype(np.uint8), np.dtype(np.float32)
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce  # ndarray.min/max add a Python wrapper
_NUM = {int, float}
_EMPTY_MAP = b"\x80"  # msgpack's empty map
_FINISH = frozenset(FINISH_REASONS)
_INF, _isfinite = math.inf, math.isfinite
_lt, _gt, _sub = operator.lt, operator.gt, operator.sub  # on ints: int.__lt__ &co are slower


_WIRE = "_wire"  # instance attribute, not a field: the frames a decoded group came in


def remember_frames(group: Group, frames: Sequence[Any]) -> None:
    """Keep the frames `group` was decoded from (its header and array frames, as received):
    encoding it inside another message (a hub's `Batch`) then sends them again as they are,
    without re-encoding the header or touching the arrays."""
    group.__dict__[_WIRE] = list(frames)


def wire_frames(group: Group) -> list[Any] | None:
    """The frames `group` was decoded from, or None for a group built here."""
    return group.__dict__.get(_WIRE)


def new_message(cls: type, fields: dict[str, Any]) -> Any:
    """A frozen dataclass instance from its complete fields, in order, without __init__."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


class _Ref(msgspec.Struct, forbid_unknown_fields=True):
    """An array reference as `encode` writes it."""

    dtype: str
    shape: list[int]
    frame: int


_NonNeg = typing.Annotated[int, msgspec.Meta(ge=0)]
_Finite = typing.Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
_Reason = typing.Literal[FINISH_REASONS]  # type: ignore[valid-type]
_CHECKED = {  # the rules on single values, checked while parsing (NaN fails both bounds)
    "seq_lens": list[_NonNeg],
    "prompt_lens": list[_NonNeg],
    "rewards": list[_Finite],
    "min_policy_versions": list[_NonNeg],
    "max_policy_versions": list[_NonNeg],
    "finish_reasons": list[_Reason],
    "timings": dict[str, _Finite],
    "num_turns": list[_NonNeg],
    "tool_s": list[_Finite],
    "env_s": list[_Finite],
    "reward_components": dict[str, list[_Finite]],
}


def _head_struct() -> type:
    """The header of a Group message as a typed struct, derived from the `Group` dataclass
    (its fields in order, arrays as `_Ref`, then `type` and `protocol`): what the compiled
    decoder checks while it parses: types, and the rules on single values (`_CHECKED`: counts
    and versions >= 0, finite floats, known finish reasons); the rules between fields are
    checked after. Unknown keys go to the generic path, which ignores them; `metadata` stays
    raw bytes until it is known to be non-empty."""
    hints = typing.get_type_hints(Group)
    fields: list[tuple[Any, ...]] = []
    for f in dataclasses.fields(Group):
        hint = _Ref if hints[f.name] is np.ndarray else _CHECKED.get(f.name, hints[f.name])
        if f.name == "metadata":
            fields.append((f.name, msgspec.Raw, msgspec.Raw(_EMPTY_MAP)))
        elif f.default_factory is not dataclasses.MISSING:
            fields.append((f.name, hint, f.default_factory()))
        else:
            assert f.default is dataclasses.MISSING, f"Group.{f.name}: a plain default"
            fields.append((f.name, hint))
    fields += [("type", str, ""), ("protocol", int, 0)]
    return msgspec.defstruct("GroupHead", fields, forbid_unknown_fields=True, kw_only=True)


_Head = _head_struct()
_HEAD = msgspec.msgpack.Decoder(_Head)
_PARSE_ERRORS = (msgspec.ValidationError, msgspec.DecodeError)


def decode_group(bufs: list[memoryview], values: bool) -> Group | None:
    """The Group message in `bufs` (header, then its three arrays in field order), or None
    when anything about it is unusual (the generic decoder then decides)."""
    try:
        h = _HEAD.decode(bufs[0])
    except _PARSE_ERRORS:
        return None
    return _finish(h, bufs, values)


def finish_group(h: _Head, bufs: list[memoryview], values: bool) -> Group | None:
    """A parsed header and its frames as a Group, or None: the reference for
    asyncrl/protocol/_hotpath.c's `finish_group`, which does the same in one call where it was built."""
    if h.type != "Group" or h.protocol != PROTOCOL_VERSION or len(bufs) != 4:
        return None
    seq_lens, prompt_lens, lo, hi = (
        h.seq_lens,
        h.prompt_lens,
        h.min_policy_versions,
        h.max_policy_versions,
    )
    n = len(seq_lens)
    if not n or not (
        len(prompt_lens)
        == len(lo)
        == len(hi)
        == len(h.rewards)
        == len(h.trajectory_ids)
        == len(h.finish_reasons)
        == len(h.reward_failed)
        == n
    ):
        return None
    metadata = raw_map(h.metadata)
    if metadata is None or (values and not _rules_ok(h, n)):
        return None
    num_tokens = sum(seq_lens)
    arrays = _arrays(h, num_tokens, num_tokens - sum(prompt_lens), bufs)
    if arrays is None or (values and not _values_ok(*arrays)):
        return None
    fields = msgspec.structs.asdict(h)  # Group's fields in order, then type and protocol
    del fields["type"], fields["protocol"]
    fields.update(
        tokens=arrays[0], loss_mask=arrays[1], behavior_logprobs=arrays[2], metadata=metadata
    )
    g = new_message(Group, fields)
    return g


def _rules_ok(h: _Head, n: int) -> bool:
    """The rules between a group's fields (module docstring) that parsing did not check."""
    seq_lens, prompt_lens, lo, hi = (
        h.seq_lens,
        h.prompt_lens,
        h.min_policy_versions,
        h.max_policy_versions,
    )
    if any(map(_lt, seq_lens, prompt_lens)) or any(map(_gt, lo, hi)):
        return False
    turns, tool_s, env_s, components = h.num_turns, h.tool_s, h.env_s, h.reward_components
    if (turns and len(turns) != n) or (tool_s and len(tool_s) != n) or (env_s and len(env_s) != n):
        return False
    if components and not all(len(v) == n for v in components.values()):
        return False
    spans = h.version_spans  # only groups that record versions pay for the check
    return not (spans and spans_problem(spans, lo, hi, list(map(_sub, seq_lens, prompt_lens))))


def raw_map(raw: msgspec.Raw) -> dict[str, Any] | None:
    """A free-form map field kept raw while parsing (a group's `metadata`, a credit's `info`),
    decoded as the generic path decodes headers; None if it is not a map."""
    if bytes(raw) == _EMPTY_MAP:
        return {}
    try:
        value = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception:  # msgpack raises several unrelated types on garbage
        return None
    return value if type(value) is dict else None


def spans_problem(spans: list[int], lo: list[int], hi: list[int], completion: list[int]) -> str:
    """What is wrong with a group's `version_spans` (see the module docstring), or ""."""
    if not spans:
        return ""
    if len(spans) % 3:
        return "must hold (trajectory, first token, version) triples"
    covered: dict[int, list[tuple[int, int]]] = {}
    for i in range(0, len(spans), 3):
        t, first, version = spans[i : i + 3]
        if not 0 <= t < len(lo):
            return f"trajectory index {t} out of range"
        covered.setdefault(t, []).append((first, version))
    last_t = -1
    for t in sorted(covered):
        pairs = covered[t]
        if t < last_t or pairs[0] != (0, lo[t]) or pairs[-1][1] != hi[t]:
            return f"trajectory {t}: spans must start at token 0 with min_policy_version and end with max_policy_version"
        for (f0, v0), (f1, v1) in zip(pairs, pairs[1:], strict=False):
            if not (f0 < f1 < completion[t] and v0 < v1):
                return f"trajectory {t}: spans must grow in token and version inside the completion"
        last_t = t
    return ""


if _hotpath is not None:
    _hotpath.configure(
        tuple(f.name for f in dataclasses.fields(Group)),
        PROTOCOL_VERSION,
        LOGPROB_SLACK,
        Group,
        raw_map,
        spans_problem,
        np.frombuffer,
        _I32,
        _U8,
        _F32,
    )
    _finish = _hotpath.finish_group
else:
    _finish = finish_group

EPISODE_LISTS = ("num_turns", "tool_s", "env_s")
OPTIONAL_LISTS = (*EPISODE_LISTS, "version_spans")
"""Per-group lists that stay off the wire when empty."""


def _arrays(
    h: _Head, num_tokens: int, num_completion: int, bufs: list[memoryview]
) -> tuple[np.ndarray, ...] | None:
    """The three arrays, if their references are canonical (frames 1, 2, 3 in field order)
    and those frames hold exactly the bytes the lengths call for."""
    rt, rm, rl = h.tokens, h.loss_mask, h.behavior_logprobs
    if not (
        rt.frame == 1
        and rm.frame == 2
        and rl.frame == 3
        and rt.dtype == "int32"
        and rm.dtype == "uint8"
        and rl.dtype == "float32"
        and rt.shape == [num_tokens]
        and rm.shape == [num_completion]
        and rl.shape == [num_completion]
    ):
        return None
    bt, bm, bl = bufs[1], bufs[2], bufs[3]
    if (
        bt.nbytes != 4 * num_tokens
        or bm.nbytes != num_completion
        or bl.nbytes != 4 * num_completion
    ):
        return None
    return np.frombuffer(bt, _I32), np.frombuffer(bm, _U8), np.frombuffer(bl, _F32)


def _lowest(a: np.ndarray) -> Any:
    """The smallest element of a non-empty 1-d array (NaN if it holds one). `a[a.argmin()]`
    (a C method: ~0.4 us) beats the ufunc reduction (~1.2 us of call overhead) and scans
    integers as fast; for floats from `_ARG_BELOW` elements on, the reduction scans faster."""
    return _MIN(a) if a.shape[0] >= _ARG_BELOW and a.dtype is _F32 else a[a.argmin()]


def _highest(a: np.ndarray) -> Any:
    """The largest element of a non-empty 1-d array (NaN if it holds one); see `_lowest`."""
    return _MAX(a) if a.shape[0] >= _ARG_BELOW and a.dtype is _F32 else a[a.argmax()]


_ARG_BELOW = 16384


def _values_ok(tokens: np.ndarray, mask: np.ndarray, lp: np.ndarray) -> bool:
    if tokens.shape[0] and _lowest(tokens) < 0:
        return False
    if not mask.shape[0]:
        return True
    # NaN comes out of both scans (and fails the comparison); -inf shows up as the lowest
    return bool(_highest(mask) <= 1 and _highest(lp) <= LOGPROB_SLACK and _lowest(lp) > -_INF)


_LISTS = (
    "trajectory_ids",
    "prompt_lens",
    "rewards",
    "min_policy_versions",
    "max_policy_versions",
    "finish_reasons",
    "reward_failed",
)


def check_group(g: dict[str, Any], prefix: str, values: bool = True) -> None:
    """Cross-field consistency of a group's fields (types already checked): raises
    `ProtocolError` naming the first field that breaks a rule of the module docstring."""
    seq_lens = g["seq_lens"]
    n = len(seq_lens)
    if n == 0:
        raise ProtocolError(prefix + "seq_lens", "a group needs at least one trajectory")
    for name in _LISTS:
        if len(g[name]) != n:
            raise ProtocolError(prefix + name, f"has {len(g[name])} entries for {n} trajectories")
    prompt_lens = g["prompt_lens"]
    if min(prompt_lens) < 0 or any(map(_lt, seq_lens, prompt_lens)):
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
    if values:
        _check_values(tokens, mask, lp, prefix)
    lo, hi = g["min_policy_versions"], g["max_policy_versions"]
    if min(lo) < 0 or any(map(_gt, lo, hi)):
        raise ProtocolError(prefix + "min_policy_versions", "need 0 <= min <= max per trajectory")
    if not _FINISH.issuperset(g["finish_reasons"]):
        bad = sorted(set(g["finish_reasons"]) - _FINISH)[0]
        raise ProtocolError(
            prefix + "finish_reasons", f"{bad!r} is not one of {list(FINISH_REASONS)}"
        )
    for name in EPISODE_LISTS:
        if g[name] and len(g[name]) != n:
            raise ProtocolError(prefix + name, f"has {len(g[name])} entries for {n} trajectories")
    if g["num_turns"] and min(g["num_turns"]) < 0:
        raise ProtocolError(prefix + "num_turns", "must be >= 0")
    completion = [a - b for a, b in zip(seq_lens, prompt_lens, strict=True)]
    problem = spans_problem(g["version_spans"], lo, hi, completion)
    if problem:
        raise ProtocolError(prefix + "version_spans", problem)
    for name, values in g["reward_components"].items():
        if type(name) is not str or type(values) is not list or len(values) != n:
            raise ProtocolError(prefix + "reward_components", "must map names to one value each")
        g["reward_components"][name] = _decode_floats(values, prefix + "reward_components")
    timings = g["timings"]
    if timings and not (
        set(map(type, timings.values())) <= _NUM and all(map(_isfinite, timings.values()))
    ):
        raise ProtocolError(prefix + "timings", "must map names to finite numbers")


def _decode_floats(values: list[Any], path: str) -> list[float]:
    if not set(map(type, values)) <= _NUM or not all(map(_isfinite, values)):
        raise ProtocolError(path, "must hold finite numbers only")
    return [float(v) for v in values]


def _check_values(tokens: np.ndarray, mask: np.ndarray, lp: np.ndarray, prefix: str) -> None:
    if tokens.shape[0] and _lowest(tokens) < 0:
        raise ProtocolError(prefix + "tokens", "token ids must be >= 0")
    if mask.shape[0]:
        if _highest(mask) > 1:
            raise ProtocolError(prefix + "loss_mask", "must hold 0 or 1")
        if not (_highest(lp) <= LOGPROB_SLACK and _lowest(lp) > -_INF):
            raise ProtocolError(prefix + "behavior_logprobs", "must be finite and <= 0")


def encode_group(g: Group, frames: list[Any]) -> dict[str, Any]:
    """A group's header map (fields in declaration order, arrays as references to the frames
    appended here)."""
    out = dict(g.__dict__)
    out.pop(_WIRE, None)
    for name in OPTIONAL_LISTS:
        if not out[name]:
            del out[name]  # not recorded: off the wire, as before these fields existed
    if not out["reward_components"]:
        del out["reward_components"]
    for name, dtype, dtype_name in _ENCODED_ARRAYS:
        arr = _contiguous(out[name], dtype=dtype)  # the array itself when it already is
        out[name] = {"dtype": dtype_name, "shape": list(arr.shape), "frame": len(frames)}
        frames.append(payload(arr))
    return out


_ENCODED_ARRAYS = tuple((name, np.dtype(dtype), dtype) for name, dtype in GROUP_ARRAYS)
_contiguous = np.ascontiguousarray


def payload(arr: np.ndarray) -> Any:
    """The frame to send for an array: a received frame it views whole is forwarded as is
    (ZeroMQ then shares that message's buffer: no copy, no Python reference tracking)."""
    base = arr.base
    if type(base) is memoryview and base.nbytes == arr.nbytes:
        frame = base.obj
        whole = getattr(frame, "buffer", None)  # a zmq.Frame; only if the array is all of it
        if whole is not None and whole.nbytes == arr.nbytes and hasattr(frame, "more"):
            return frame if arr.nbytes else b""
    return arr.data if arr.size else b""


_EMPTY_MAP = b"\x80"  # msgpack's empty map: `info` as nearly every credit has it


class _Item(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    credit_id: int
    prompt_id: str
    prompt: str
    seed: int
    info: msgspec.Raw = msgspec.Raw(_EMPTY_MAP)


class _Credits(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    group_size: int
    policy_version: int
    items: list[_Item]
    min_weights_version: int = 0
    type: str = ""
    protocol: int = 0


for _cls, _struct in ((CreditItem, _Item), (Credits, _Credits)):  # a field added there, add here
    _names = [f.name for f in dataclasses.fields(_cls)]
    assert list(_struct.__struct_fields__[: len(_names)]) == _names, f"{_cls.__name__}: {_names}"

_DECODE = msgspec.msgpack.Decoder(_Credits).decode
_asdict = msgspec.structs.asdict
_PARSE_ERRORS = (msgspec.ValidationError, msgspec.DecodeError)


def decode_credits(bufs: list[memoryview]) -> Credits | None:
    """The Credits message in `bufs` (its header alone), or None when anything about it is
    unusual (the generic decoder then decides)."""
    if len(bufs) != 1:
        return None
    try:
        c = _DECODE(bufs[0])
    except _PARSE_ERRORS:
        return None
    if c.type != "Credits" or c.protocol != PROTOCOL_VERSION:
        return None
    items = []
    for item in c.items:
        fields = _asdict(item)  # CreditItem's fields in order
        if bytes(item.info) == _EMPTY_MAP:
            fields["info"] = {}
        elif (info := raw_map(item.info)) is not None:
            fields["info"] = info
        else:
            return None
        items.append(new_message(CreditItem, fields))
    fields = {
        "group_size": c.group_size,
        "policy_version": c.policy_version,
        "items": tuple(items),
        "min_weights_version": c.min_weights_version,
    }
    return new_message(Credits, fields)
