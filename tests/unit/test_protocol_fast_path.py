"""The wire codec's compiled group path and its limits: fields appended with defaults stay off
the wire, the fast and generic paths agree, batches from the hub are decoded as trusted, and
reward components ride on the group."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import msgpack
import numpy as np
import pytest
from golden_wire import GOLDEN_COMPONENTS_HEADER, GOLDEN_MESSAGES, GROUP
from hypothesis import given
from wire_cases import FAST, builds, edited, groups, header, rejected, same, wire

from asyncrl.protocol.codec import decode
from asyncrl.protocol.group_codec import decode_credits, decode_group
from asyncrl.protocol.messages import (
    Ack,
    Batch,
    CreditItem,
    Credits,
    Group,
    ProtocolError,
    Trajectory,
)

# --- appended fields, the group fast path, trusted batches --------------------------------------


def test_appended_fields_stay_off_the_wire_at_their_default() -> None:
    assert "seqs" not in header(Ack(seq=1, credit_id=7))  # golden bytes unchanged
    batched = Ack(seq=4, credit_id=9, seqs=[1, 2, 3])
    assert header(batched)["seqs"] == [1, 2, 3]
    assert same(decode(wire(batched)), batched)
    hello = GOLDEN_MESSAGES["Hello"]
    assert "batched_acks" not in header(hello) and decode(wire(hello)).batched_acks is False
    assert header(dataclasses.replace(hello, batched_acks=True))["batched_acks"] is True
    assert "session" not in header(hello) and "acks_batches" not in header(hello)
    assert "next_seq" not in header(GOLDEN_MESSAGES["Welcome"])
    error = GOLDEN_MESSAGES["Error"]
    assert "request_id" not in header(error) and decode(wire(error)).request_id == -1
    refused = dataclasses.replace(error, request_id=12)
    assert header(refused)["request_id"] == 12 and same(decode(wire(refused)), refused)


def permuted(msg: Any) -> list[bytes]:
    """The message with its array frames in reverse order (references renumbered): valid, but
    not the layout `encode` writes, so decoding takes the generic path. In a Batch, each
    embedded group is permuted within its own frames."""
    frames = wire(msg)
    h = msgpack.unpackb(frames[0])
    if h["type"] == "Batch":
        out, pos = [frames[0]], 1
        for count in h["groups"]:
            out += _reversed_arrays(frames[pos : pos + count])
            pos += count
        return out
    return _reversed_arrays(frames)


def _reversed_arrays(frames: list[bytes]) -> list[bytes]:
    k = len(frames) - 1
    h = msgpack.unpackb(frames[0])
    for name in ("tokens", "loss_mask", "behavior_logprobs"):
        h[name]["frame"] = k + 1 - h[name]["frame"]
    return [msgpack.packb(h), *reversed(frames[1:])]


@FAST
@given(groups())
def test_fast_and_generic_group_paths_agree(group: Group) -> None:
    assert same(decode(permuted(group)), group)
    batch = Batch(request_id=1, policy_version=0, groups=(group, group))
    assert same(decode(permuted(batch)), batch)


def test_fast_path_refuses_what_the_generic_path_refuses() -> None:
    ref = header(GROUP)["tokens"]
    assert rejected(edited(GROUP, tokens={**ref, "frame": True})).field == "tokens"
    assert rejected(edited(GROUP, tokens={**ref, "shape": [5.0]})).field == "tokens"
    assert rejected(edited(GROUP, rewards=[math.inf])).field == "rewards"
    assert rejected(edited(GROUP, credit_id=True)).field == "credit_id"
    assert rejected(edited(GROUP, timings={"t": math.nan})).field == "timings"
    assert rejected(edited(GROUP, prompt_lens=[6])).field == "prompt_lens"
    assert rejected(edited(GROUP, max_policy_versions=[1])).field == "min_policy_versions"


def test_compiled_fast_path_takes_only_what_the_generic_path_takes() -> None:
    """The fast path (msgspec, typed header) must never accept a header the generic path
    (msgpack with strict map keys) refuses; it may hand odd but valid ones over."""
    frames = wire(GROUP)
    head = msgpack.unpackb(frames[0])

    def fast(raw: bytes) -> bool:
        return decode_group([memoryview(raw), *map(memoryview, frames[1:])], True) is not None

    refused = [
        frames[0] + b"\x01",
        msgpack.packb({**head, "metadata": {1: 2}}),
        msgpack.packb({**head, "metadata": {"a": {1: 2}}}),
        msgpack.packb({**head, "unknown": {1: 2}}),
    ]
    for raw in refused:
        assert not fast(raw)
        assert rejected([raw, *frames[1:]]).field == "header"
    bytes_key = msgpack.packb({**head, "timings": {b"t": 1.0}})
    assert not fast(bytes_key) and decode([bytes_key, *frames[1:]]).timings == {b"t": 1.0}
    later = msgpack.packb({**head, "later": 1})  # a field appended by a newer peer
    assert not fast(later) and same(decode([later, *frames[1:]]), GROUP)
    assert fast(frames[0]) and fast(msgpack.packb({**head, "timings": {"t": 1}}))


@FAST
@given(builds(Credits))
def test_fast_and_generic_credits_paths_agree(credits: Credits) -> None:
    frames = wire(credits)
    fast = decode_credits(list(map(memoryview, frames)))
    assert fast is not None and same(fast, credits) and same(decode(frames), credits)
    later = msgpack.packb({**header(credits), "later": 1})  # unknown key: the generic path
    assert decode_credits([memoryview(later)]) is None and same(decode([later]), credits)


def test_credits_fast_path_takes_only_what_the_generic_path_takes() -> None:
    item = CreditItem(credit_id=7, prompt_id="p", prompt="x", seed=3, info={"k": [1, {"a": 2}]})
    head = header(Credits(group_size=8, policy_version=0, items=(item,)))
    one = head["items"][0]
    refused = {  # edited header -> the field the generic path names
        "group_size": {**head, "group_size": True},
        "items[0].seed": {**head, "items": [{**one, "seed": 1.0}]},
        "items[0].prompt": {**head, "items": [{**one, "prompt": b"x"}]},
        "items[0].credit_id": {
            **head,
            "items": [{k: v for k, v in one.items() if k != "credit_id"}],
        },
        "items[0]": {**head, "items": [7]},
    }
    for field, edited_head in refused.items():
        raw = msgpack.packb(edited_head)
        assert decode_credits([memoryview(raw)]) is None
        assert rejected([raw]).field == field
    odd_info = msgpack.packb({**head, "items": [{**one, "info": {1: 2}}]})
    assert decode_credits([memoryview(odd_info)]) is None and rejected([odd_info]).field == "header"
    assert decode_credits([memoryview(msgpack.packb(head)), memoryview(b"")]) is None
    bytes_key = msgpack.packb(
        {**head, "items": [{**one, "info": {b"k": 1}}]}
    )  # as the generic path
    assert decode_credits([memoryview(bytes_key)]).items[0].info == {b"k": 1}
    assert decode([bytes_key]).items[0].info == {b"k": 1}


def test_version_spans_must_describe_the_versions() -> None:
    traj = Trajectory(
        tokens=np.arange(7, dtype=np.int32),
        prompt_len=2,
        loss_mask=np.ones(5, np.uint8),
        behavior_logprobs=np.zeros(5, np.float32),
        reward=1.0,
        min_policy_version=3,
        max_policy_version=5,
        finish_reason="stop",
        version_spans=(0, 3, 2, 4, 4, 5),
    )
    group = Group.build(
        group_id="g",
        prompt_id="p",
        credit_id=1,
        actor_id="a",
        seq=0,
        trajectories=[traj, dataclasses.replace(traj, version_spans=(0, 3, 1, 5))],
    )
    assert group.version_spans == [0, 0, 3, 0, 2, 4, 0, 4, 5, 1, 0, 3, 1, 1, 5]
    back = decode(wire(group))
    assert back.trajectories()[0].token_versions().tolist() == [3, 3, 4, 4, 5]
    assert back.trajectories()[1].token_versions().tolist() == [3, 5, 5, 5, 5]
    bad = [
        [0, 0, 3, 0, 2, 4],  # trajectory 0 never reaches its max version
        [0, 1, 3, 0, 2, 5, 1, 0, 3, 1, 1, 5],  # does not start at token 0
        [0, 0, 3, 0, 9, 5, 1, 0, 3, 1, 1, 5],  # past the completion
        [0, 0, 3, 0, 2, 5, 0, 1, 4, 1, 0, 3, 1, 1, 5],  # tokens go back
        [0, 0, 3, 0, 2, 5, 1, 0, 3, 1, 1, 5, 7],  # not triples
        [0, 0, 3, 0, 2, 5, 9, 0, 3],  # no such trajectory
    ]
    for spans in bad:
        assert rejected(edited(group, version_spans=spans)).field == "version_spans", spans
    assert decode(edited(GROUP, rewards=[1])).rewards == [1.0]  # ints are numbers


def test_embedded_groups_are_whole_messages_checked_as_such() -> None:
    batch = GOLDEN_MESSAGES["Batch"]
    frames = wire(batch)
    group_head = msgpack.unpackb(frames[1])
    two = [
        msgpack.packb({**msgpack.unpackb(frames[0]), "groups": [4, 4]}),
        *frames[1:],
        *frames[1:],
    ]
    assert len(decode(two).groups) == 2
    assert rejected(edited(batch, groups=[3])).field == "groups[0].behavior_logprobs"
    assert rejected(edited(batch, groups=[5])).code == "truncated"
    assert rejected([*frames, b"x"]).field == "frames"  # a frame nobody takes
    assert rejected(edited(batch, groups=[0])).field == "groups[0]"
    assert rejected(edited(batch, groups=[{"seq": 1}])).field == "groups[0]"
    assert rejected(edited(batch, groups=4)).field == "groups"
    for key, value, field in (
        ("protocol", 1, "groups[0].protocol"),
        ("type", "Batch", "groups[0].type"),
        ("seq_lens", [9], "groups[0].tokens"),
    ):
        head = msgpack.packb({**group_head, key: value})
        assert rejected([frames[0], head, *frames[2:]]).field == field, key
    assert rejected([frames[0], b"\xc1", *frames[2:]]).field == "groups[0].header"


def trusted_refusal(frames: list[Any]) -> str:
    with pytest.raises(ProtocolError) as info:
        decode(frames, check_values=False)
    return info.value.field


def test_batches_from_the_hub_skip_only_what_the_hub_checked() -> None:
    """Trusted decoding (a Batch from the hub) skips the value scans and the rules between
    fields, which the hub ran on these bytes; types, list lengths and array sizes, what makes
    a group safe to index, are still checked."""
    frames = wire(GOLDEN_MESSAGES["Batch"])  # batch header, group header, its three arrays
    lp = np.frombuffer(frames[4], np.float32).copy()
    lp[0] = math.nan
    bad_values = [*frames[:4], lp.tobytes()]
    assert rejected(bad_values).field == "groups[0].behavior_logprobs"
    assert math.isnan(decode(bad_values, check_values=False).groups[0].behavior_logprobs[0])
    head = msgpack.unpackb(frames[1])  # its min_policy_versions: [2]
    bad_rule = [frames[0], msgpack.packb({**head, "max_policy_versions": [1]}), *frames[2:]]
    assert rejected(bad_rule).field == "groups[0].min_policy_versions"
    assert decode(bad_rule, check_values=False).groups[0].max_policy_versions == [1]
    # the rules on single values cost nothing while parsing: checked either way
    bad_reason = [frames[0], msgpack.packb({**head, "finish_reasons": ["x"]}), *frames[2:]]
    assert rejected(bad_reason).field == trusted_refusal(bad_reason) == "groups[0].finish_reasons"
    assert trusted_refusal([*frames[:4], frames[4][:-1]]) == "groups[0].behavior_logprobs"
    for key, value, field in (
        ("rewards", [1.0, 2.0], "groups[0].rewards"),
        ("seq_lens", [9], "groups[0].tokens"),
        ("prompt_lens", ["a"], "groups[0].prompt_lens"),
    ):
        assert (
            trusted_refusal([frames[0], msgpack.packb({**head, key: value}), *frames[2:]]) == field
        )


def test_reward_components_ride_on_the_group_wire() -> None:
    assert "reward_components" not in header(GROUP)  # the Group golden bytes are unchanged
    group = dataclasses.replace(GROUP, reward_components={"task": [1.0], "judge": [0.5]})
    frames = wire(group)
    assert frames[0].hex() == GOLDEN_COMPONENTS_HEADER
    assert same(decode(frames), group)
    assert decode(wire(GROUP)).reward_components == {}


def test_reward_components_must_be_one_finite_number_per_trajectory() -> None:
    assert rejected(edited(GROUP, reward_components={"task": [1.0, 2.0]})).field == (
        "reward_components"
    )
    assert rejected(edited(GROUP, reward_components={"task": [math.nan]})).field == (
        "reward_components"
    )
    assert rejected(edited(GROUP, reward_components={"task": ["1"]})).field == "reward_components"
    assert rejected(edited(GROUP, reward_components=[1.0])).field == "reward_components"
    assert decode(edited(GROUP, reward_components={"task": [1]})).reward_components == {
        "task": [1.0]
    }  # ints are numbers
