"""The codec's hot path: `Group` headers in and out, and the group consistency rules.

Groups are nearly all the bytes and most of the messages asyncrl moves, and every one is
decoded at least twice (the hub on arrival, the learner inside a `Batch`), so they get a
decoder of their own. `decode_group` accepts a well-formed group in the canonical layout that
`encode` writes (array frames k, k+1, k+2 in field order) with a handful of bulk checks, and
answers None for anything else; the caller then takes the generic path of asyncrl/protocol.py,
which finds and names whatever is wrong. Both paths accept exactly the same groups.

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

The value rules (ids, masks, logprobs) scan the arrays: two or three numpy reductions per array,
the only per-byte work of a decode. `values=False` skips them, for groups that arrive inside a
`Batch` from the hub, which scanned the same bytes when the group arrived.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from asyncrl.messages import FINISH_REASONS, Group, ProtocolError

LOGPROB_SLACK = 1e-3  # behaviour logprobs are <= 0 up to float rounding
GROUP_ARRAYS = (("tokens", "int32"), ("loss_mask", "uint8"), ("behavior_logprobs", "float32"))

_FIELDS = operator.itemgetter(
    "group_id", "prompt_id", "credit_id", "actor_id", "seq", "trajectory_ids", "seq_lens",
    "prompt_lens", "rewards", "min_policy_versions", "max_policy_versions", "finish_reasons",
    "reward_failed", "tokens", "loss_mask", "behavior_logprobs",
)  # fmt: skip
_I32, _U8, _F32 = np.dtype(np.int32), np.dtype(np.uint8), np.dtype(np.float32)
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce  # ndarray.min/max add a Python wrapper
_INT, _STR, _FLOAT, _NUM = {int}, {str}, {float}, {int, float}
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


def decode_group(
    data: dict[str, Any], bufs: list[memoryview], used: set[int], values: bool
) -> Group | None:
    """The group in header map `data` whose arrays are the next three unused frames, or None
    when anything about it is unusual (the generic decoder then decides)."""
    try:
        (gid, pid, cid, aid, seq, tids, seq_lens, prompt_lens, rewards, lo, hi, finish, failed,
         rt, rm, rl) = _FIELDS(data)  # fmt: skip
    except KeyError:
        return None
    if not (
        type(gid) is str and type(pid) is str and type(aid) is str and type(cid) is int
        and type(seq) is int and type(rewards) is list
        and _lists_ok(seq_lens, prompt_lens, lo, hi, tids, finish, failed, len(rewards))
    ):  # fmt: skip
        return None
    n = len(rewards)
    rewards, extras, episode = _finite_rewards(rewards), _extras(data), _episode_lists(data, n)
    components = _components(data, n)
    if rewards is None or extras is None or episode is None or components is None:
        return None
    spans = data["version_spans"] if "version_spans" in data else []
    if spans and (
        type(spans) is not list
        or set(map(type, spans)) != _INT
        or spans_problem(spans, lo, hi, list(map(_sub, seq_lens, prompt_lens)))
    ):
        return None  # only groups that record versions pay for the check
    num_tokens = sum(seq_lens)
    arrays = _arrays(rt, rm, rl, num_tokens, num_tokens - sum(prompt_lens), bufs, used)
    if arrays is None or (values and not _values_ok(*arrays)):
        return None
    k = len(used) + 1
    used.update((k, k + 1, k + 2))
    g = object.__new__(Group)
    g.__dict__.update(
        group_id=gid, prompt_id=pid, credit_id=cid, actor_id=aid, seq=seq, trajectory_ids=tids,
        seq_lens=seq_lens, prompt_lens=prompt_lens, rewards=rewards, min_policy_versions=lo,
        max_policy_versions=hi, finish_reasons=finish, reward_failed=failed, tokens=arrays[0],
        loss_mask=arrays[1], behavior_logprobs=arrays[2], metadata=extras[0], timings=extras[1],
        num_turns=episode[0], tool_s=episode[1], env_s=episode[2], version_spans=spans,
        reward_components=components,
    )  # fmt: skip
    return g


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


def _lists_ok(seq_lens: Any, prompt_lens: Any, lo: Any, hi: Any, tids: Any, finish: Any,
              failed: Any, n_rewards: int) -> bool:  # fmt: skip
    """The per-trajectory lists: lists, one entry per trajectory, of the right types and ranges."""
    if not (
        type(seq_lens) is list and type(prompt_lens) is list and type(lo) is list
        and type(hi) is list and type(tids) is list and type(finish) is list
        and type(failed) is list
    ):  # fmt: skip
        return False
    n = len(seq_lens)
    if not n or not (
        len(tids) == len(prompt_lens) == n_rewards == len(lo) == len(hi) == len(finish)
        == len(failed) == n
    ):  # fmt: skip
        return False
    if {*map(type, tids), *map(type, finish), *map(type, failed)} != _STR:
        return False
    if {*map(type, seq_lens), *map(type, prompt_lens), *map(type, lo), *map(type, hi)} != _INT:
        return False
    if not _FINISH.issuperset(finish) or min(prompt_lens) < 0 or min(lo) < 0:
        return False
    return not (any(map(_lt, seq_lens, prompt_lens)) or any(map(_gt, lo, hi)))


def _finite_rewards(rewards: list[Any]) -> list[float] | None:
    kinds = set(map(type, rewards))
    if kinds != _FLOAT:
        if not kinds <= _NUM:
            return None
        rewards = list(map(float, rewards))
    # a sum is finite iff every term is (overflow aside, which the generic path sorts out)
    return rewards if _isfinite(sum(rewards)) else None


def _extras(data: dict[str, Any]) -> tuple[dict, dict] | None:
    """(metadata, timings), defaults filled in, if they are maps (timings of finite numbers)."""
    metadata = data["metadata"] if "metadata" in data else {}
    timings = data["timings"] if "timings" in data else {}
    if type(metadata) is not dict or type(timings) is not dict:
        return None
    if timings and not (set(map(type, timings.values())) <= _NUM and _isfinite(sum(timings.values()))):  # fmt: skip
        return None
    return metadata, timings


EPISODE_LISTS = ("num_turns", "tool_s", "env_s")
OPTIONAL_LISTS = (*EPISODE_LISTS, "version_spans")
"""Per-group lists that stay off the wire when empty."""


def _episode_lists(data: dict[str, Any], n: int) -> tuple[list, list, list] | None:
    """(num_turns, tool_s, env_s), each empty or one well-typed entry per trajectory."""
    out = []
    for name in EPISODE_LISTS:
        value = data[name] if name in data else []
        if type(value) is not list or (value and len(value) != n):
            return None
        if value:
            kinds = set(map(type, value))
            if name == "num_turns":
                if kinds != _INT or min(value) < 0:
                    return None
            elif kinds != _FLOAT or not _isfinite(sum(value)):
                return None
        out.append(value)
    return out[0], out[1], out[2]


def _components(data: dict[str, Any], n: int) -> dict[str, list[float]] | None:
    """`reward_components` ({} when absent) if it maps strings to n finite floats each."""
    components = data["reward_components"] if "reward_components" in data else {}
    if type(components) is not dict:
        return None
    for name, values in components.items():
        if type(name) is not str or type(values) is not list or len(values) != n:
            return None
        if set(map(type, values)) != _FLOAT or not _isfinite(sum(values)):
            return None
    return components


def _arrays(rt: Any, rm: Any, rl: Any, num_tokens: int, num_completion: int,
            bufs: list[memoryview], used: set[int]) -> tuple[np.ndarray, ...] | None:  # fmt: skip
    """The three arrays, if their references are canonical (the next three frames, in order)
    and those frames hold exactly the bytes the lengths call for."""
    k = len(used) + 1  # frames 1..k-1 are taken when every earlier reference was canonical
    if k + 2 >= len(bufs) or k in used or k + 1 in used or k + 2 in used:
        return None
    if (
        rt != {"dtype": "int32", "shape": [num_tokens], "frame": k}
        or rm != {"dtype": "uint8", "shape": [num_completion], "frame": k + 1}
        or rl != {"dtype": "float32", "shape": [num_completion], "frame": k + 2}
    ):
        return None
    # == also holds for True == 1 and 3.0 == 3: the generic path refuses those
    types = {type(rt["frame"]), type(rm["frame"]), type(rl["frame"]), type(rt["shape"][0]),
             type(rm["shape"][0]), type(rl["shape"][0])}  # fmt: skip
    bt, bm, bl = bufs[k], bufs[k + 1], bufs[k + 2]
    if types != _INT or bt.nbytes != 4 * num_tokens or bm.nbytes != num_completion:
        return None
    if bl.nbytes != 4 * num_completion:
        return None
    return np.frombuffer(bt, _I32), np.frombuffer(bm, _U8), np.frombuffer(bl, _F32)


def _values_ok(tokens: np.ndarray, mask: np.ndarray, lp: np.ndarray) -> bool:
    if tokens.shape[0] and _MIN(tokens) < 0:
        return False
    if not mask.shape[0]:
        return True
    # NaN propagates into max (and fails the comparison); -inf shows up in min
    return bool(_MAX(mask) <= 1 and _MAX(lp) <= LOGPROB_SLACK and _MIN(lp) > -_INF)


_LISTS = ("trajectory_ids", "prompt_lens", "rewards", "min_policy_versions",
          "max_policy_versions", "finish_reasons", "reward_failed")  # fmt: skip


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
    if tokens.shape[0] and _MIN(tokens) < 0:
        raise ProtocolError(prefix + "tokens", "token ids must be >= 0")
    if mask.shape[0]:
        if _MAX(mask) > 1:
            raise ProtocolError(prefix + "loss_mask", "must hold 0 or 1")
        if not (_MAX(lp) <= LOGPROB_SLACK and _MIN(lp) > -_INF):
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
