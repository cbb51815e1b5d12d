"""asyncrl/protocol/_hotpath.c against the Python it replaces on the group fast path: `values_ok` against
the numpy scans (NaN, infinities, the slack boundary, negative ids, mask bytes above 1, frames
that are not aligned) and `finish_group` against `group_codec.finish_group` (every group, and
headers edited to break each rule: the same Group, or None from both); `address` against numpy's
(the write-ahead log's fallback)."""

from __future__ import annotations

import gc
import math
import sys
import tracemalloc

import msgpack
import numpy as np
import pytest
import zmq
from golden_wire import GROUP
from hypothesis import given
from hypothesis import strategies as st
from wire_cases import FAST, groups, header, same, wire

from asyncrl.protocol import group_codec
from asyncrl.protocol.codec import decode
from asyncrl.protocol.group_codec import _HEAD, LOGPROB_SLACK, _values_ok, finish_group
from asyncrl.protocol.messages import Group, ProtocolError
from replay import wal_records

hotpath = group_codec._hotpath
scan_values = hotpath.values_ok if hotpath is not None else None

SLACK32 = np.float32(LOGPROB_SLACK)  # the slack as the arrays compare it (NumPy 2: in float32)
ABOVE = float(np.nextafter(SLACK32, np.float32(1)))  # the first float32 above it
EDGES = [
    0.0,
    -0.0,
    -1.0,
    LOGPROB_SLACK,
    float(SLACK32),
    ABOVE,
    math.inf,
    -math.inf,
    math.nan,
    -3.4e38,
    1e-45,
    -1e-45,
]


def test_the_extension_is_built() -> None:
    """setup.py builds it on any machine with a C compiler (as CI has): without it the hub
    scans with numpy, correct but slower, and this test says so."""
    assert hotpath is not None, "asyncrl.protocol._hotpath was not built: pip install -e . with gcc"
    assert group_codec._finish is hotpath.finish_group


def scanned(tokens: np.ndarray, mask: np.ndarray, lp: np.ndarray, offset: int = 0) -> bool:
    """scan_values over the arrays' bytes, each starting `offset` bytes into its buffer."""
    bufs = [memoryview(b"\0" * offset + a.tobytes())[offset:] for a in (tokens, mask, lp)]
    return scan_values(*bufs, LOGPROB_SLACK)


arrays = st.integers(0, 70).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=70),
        st.lists(st.sampled_from([0, 1, 1, 1, 2, 128, 255]), min_size=n, max_size=n),
        st.lists(st.one_of(st.sampled_from(EDGES), st.floats(width=32)), min_size=n, max_size=n),
        st.integers(0, 7),
    )
)


@given(arrays)
def test_scan_agrees_with_numpy(case: tuple[list[int], list[int], list[float], int]) -> None:
    tokens, mask, lp, offset = case
    t = np.array(tokens, np.int32)
    m, p = np.array(mask, np.uint8), np.array(lp, np.float32)
    assert scanned(t, m, p, offset) == _values_ok(t, m, p)


@pytest.mark.parametrize("bad", ["token", "mask", "nan", "-inf", "above_slack"])
@pytest.mark.parametrize("where", [0, 17, 4095])  # the first, a middle, the last element
def test_one_bad_value_anywhere_fails(bad: str, where: int) -> None:
    t, m, p = (
        np.arange(4096, dtype=np.int32),
        np.ones(4096, np.uint8),
        np.full(4096, -0.5, np.float32),
    )
    p[-1] = SLACK32  # the largest value allowed
    assert scanned(t, m, p) and _values_ok(t, m, p)
    if bad == "token":
        t[where] = -1
    elif bad == "mask":
        m[where] = 2
    else:
        p[where] = {"nan": math.nan, "-inf": -math.inf, "above_slack": ABOVE}[bad]
    assert not scanned(t, m, p) and not _values_ok(t, m, p)


def test_sizes_that_are_not_whole_elements_fail() -> None:
    ok = (b"\0" * 8, b"\1\1", b"\0" * 8)
    assert scan_values(*ok, LOGPROB_SLACK)
    assert not scan_values(b"\0" * 7, ok[1], ok[2], LOGPROB_SLACK)
    assert not scan_values(ok[0], ok[1], b"\0" * 9, LOGPROB_SLACK)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(TypeError, match="4 arguments"):
        scan_values(b"", b"", b"")
    with pytest.raises(TypeError):
        scan_values("not a buffer", b"", b"", LOGPROB_SLACK)
    with pytest.raises(TypeError):
        scan_values(b"", b"", b"", "slack")


def test_address_is_where_the_buffer_starts() -> None:
    pool = np.zeros(100, np.uint8)
    for buf in (pool[3:], memoryview(pool)[17:40], zmq.Frame(b"x" * 70_000), b"abc"):
        expected = np.frombuffer(buf, np.uint8).ctypes.data
        assert hotpath.address(buf) == expected == wal_records.address(buf)
    with pytest.raises(TypeError):
        hotpath.address("not a buffer")


# --- finish_group ------------------------------------------------------------------------------


def finished(frames: list[bytes], values: bool) -> tuple[Group | None, Group | None]:
    """(compiled, Python) finish of a header that msgspec parses, and its frames."""
    bufs = list(map(memoryview, frames))
    h = _HEAD.decode(bufs[0])
    return hotpath.finish_group(h, bufs, values), finish_group(h, bufs, values)


def agree(frames: list[bytes], values: bool) -> Group | None:
    compiled, reference = finished(frames, values)
    assert (compiled is None) == (reference is None)
    if compiled is not None:
        assert type(compiled) is Group and list(compiled.__dict__) == list(reference.__dict__)
        for name, value in compiled.__dict__.items():  # arrays bit for bit (NaN included)
            other = reference.__dict__[name]
            if isinstance(value, np.ndarray):
                assert value.dtype == other.dtype and value.tobytes() == other.tobytes(), name
            else:
                assert same(value, other), name
    return compiled


@FAST
@given(groups(), st.booleans())
def test_finish_agrees_on_every_group(group: Group, values: bool) -> None:
    out = agree(wire(group), values)
    assert out is not None and same(out, group)


def rewritten(frames: list[bytes], **changes: object) -> list[bytes]:

    return [msgpack.packb({**msgpack.unpackb(frames[0]), **changes}), *frames[1:]]


G = wire(GROUP)  # 1 trajectory: 5 tokens, 3 of them prompt
REF = header(GROUP)
EDITS = {  # each breaks one rule (or none: "fine")
    "fine": {},
    "fine_no_metadata": {"metadata": {}},
    "fine_turns": {"num_turns": [2], "tool_s": [0.5], "env_s": [0.1]},
    "fine_components": {"reward_components": {"a": [1.0], "b": [0.0]}},
    "fine_spans": {"version_spans": [0, 0, 2, 0, 1, 3]},
    "short_list": {"rewards": []},
    "long_list": {"finish_reasons": ["stop", "stop"]},
    "no_trajectories": {
        k: []
        for k in (
            "seq_lens",
            "prompt_lens",
            "rewards",
            "min_policy_versions",
            "max_policy_versions",
            "finish_reasons",
            "reward_failed",
            "trajectory_ids",
        )
    },
    "prompt_over_seq": {"prompt_lens": [6]},
    "lo_over_hi": {"min_policy_versions": [4]},
    "turns_length": {"num_turns": [1, 2]},
    "components_length": {"reward_components": {"a": [1.0, 2.0]}},
    "bad_spans": {"version_spans": [0, 1, 2]},
    "metadata_not_map": {"metadata": [1]},
    "wrong_type": {"type": "Credits"},
    "wrong_protocol": {"protocol": 2},
    "tokens_frame": {"tokens": {**REF["tokens"], "frame": 2}},
    "tokens_dtype": {"tokens": {**REF["tokens"], "dtype": "int64"}},
    "tokens_shape": {"tokens": {**REF["tokens"], "shape": [4]}},
    "tokens_2d": {"tokens": {**REF["tokens"], "shape": [5, 1]}},
    "mask_shape": {"loss_mask": {**REF["loss_mask"], "shape": [3]}},
    "lp_frame": {"behavior_logprobs": {**REF["behavior_logprobs"], "frame": 1}},
    "huge_seq_len": {"seq_lens": [2**63 + 5]},
}


@pytest.mark.parametrize("values", [True, False])
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_finish_agrees_on_every_broken_rule(edit: str, values: bool) -> None:
    out = agree(rewritten(G, **EDITS[edit]), values)
    if edit.startswith("fine"):
        assert out is not None
    elif values or edit not in (
        "prompt_over_seq",
        "lo_over_hi",
        "turns_length",
        "components_length",
        "bad_spans",
    ):
        assert out is None  # only the rules between fields wait for values=True


@pytest.mark.parametrize("frames", ["extra", "missing", "short_tokens", "long_mask"])
def test_finish_agrees_on_frames_that_do_not_fit(frames: str) -> None:
    head, tokens, mask, lp = G
    cases = {
        "extra": [head, tokens, mask, lp, b""],
        "missing": [head, tokens, mask],
        "short_tokens": [head, tokens[:-4], mask, lp],
        "long_mask": [head, tokens, mask + b"\0", lp],
    }
    for values in (True, False):
        assert agree(cases[frames], values) is None


@pytest.mark.parametrize("bad", ["nan", "token", "mask"])
def test_finish_scans_values_only_when_asked(bad: str) -> None:
    head, tokens, mask, lp = G
    if bad == "nan":
        lp = np.array([math.nan, -1.0], np.float32).tobytes()
    elif bad == "token":
        tokens = np.array([1, 2, -3, 4, 5], np.int32).tobytes()
    else:
        mask = b"\x01\x07"
    assert agree([head, tokens, mask, lp], True) is None
    assert agree([head, tokens, mask, lp], False) is not None  # the hub checked these already


def test_finish_keeps_nothing_alive() -> None:
    """No reference leaks: the frames, the header's fields and the objects made are all let go."""

    frames = list(map(memoryview, G))
    h = _HEAD.decode(frames[0])  # its raw metadata holds a view of the header frame
    broken = _HEAD.decode(rewritten(G, rewards=[])[0])
    fields = [getattr(h, name) for name in h.__struct_fields__]

    def counts() -> list[int]:
        return [sys.getrefcount(x) for x in (*frames, *fields)]

    hotpath.finish_group(h, frames, True)  # anything made once (interned names) is made now
    gc.collect()
    before = counts()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        for _ in range(1000):
            assert hotpath.finish_group(h, frames, True) is not None
            assert hotpath.finish_group(broken, frames, True) is None
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert counts() == before
    assert grown < 16 << 10, f"{grown} bytes still held after 2000 calls"  # a leak: ~100 B each


@pytest.mark.parametrize("compiled", [True, False])
def test_a_group_with_a_nan_logprob_is_refused_by_name(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Either finish sends the group to the generic path, which names the field."""
    if not compiled:
        monkeypatch.setattr(group_codec, "_finish", finish_group)
    g = GROUP
    assert decode(wire(g)).seq == g.seq  # a good group passes
    lp = g.behavior_logprobs.copy()
    lp[-1] = math.nan
    bad = group_codec.new_message(type(g), {**g.__dict__, "behavior_logprobs": lp})
    with pytest.raises(ProtocolError) as err:
        decode(wire(bad))
    assert err.value.field == "behavior_logprobs"
