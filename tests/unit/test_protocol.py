"""The wire codec: round trips for every message (hypothesis), golden bytes, and rejections that
name the offending field."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.group_codec import decode_group
from asyncrl.protocol import (
    FINISH_REASONS,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
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
    decode,
    encode,
)
from asyncrl.wire_specs import SPECS

FAST = settings(max_examples=40, deadline=None)

# --- strategies ---------------------------------------------------------------------------------

ints = st.integers(-(2**63), 2**63 - 1)
texts = st.text(max_size=12)
floats = st.floats(allow_nan=False, allow_infinity=False)
plain = st.none() | st.booleans() | ints | floats | texts
values = st.recursive(
    plain, lambda c: st.lists(c, max_size=3) | st.dictionaries(texts, c, max_size=3), max_leaves=8
)
maps = st.dictionaries(texts, values, max_size=4)
KIND = {"int": ints, "float": floats, "str": texts, "bool": st.booleans(), "map": maps,
        "ints": st.lists(ints, max_size=5), "floats": st.lists(floats, max_size=5), "strs": st.lists(texts, max_size=5)}  # fmt: skip


@st.composite
def groups(draw: st.DrawFn) -> Group:
    n = draw(st.integers(1, 4))
    prompt_lens = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    completion = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    trajectories = []
    for plen, clen in zip(prompt_lens, completion, strict=True):
        lo = draw(st.integers(0, 50))
        tokens = draw(
            st.lists(st.integers(0, 2**31 - 1), min_size=plen + clen, max_size=plen + clen)
        )
        mask = draw(st.lists(st.integers(0, 1), min_size=clen, max_size=clen))
        lp = draw(st.lists(st.floats(-50, 0, width=32), min_size=clen, max_size=clen))
        hi = lo + (draw(st.integers(0, 3)) if clen >= 2 else 0)
        spans = (0, lo, draw(st.integers(1, clen - 1)), hi) if hi > lo else ()
        trajectories.append(Trajectory(
            tokens=np.array(tokens, np.int32), prompt_len=plen, loss_mask=np.array(mask, np.uint8),
            behavior_logprobs=np.array(lp, np.float32), reward=draw(floats), min_policy_version=lo,
            max_policy_version=hi, finish_reason=draw(st.sampled_from(FINISH_REASONS)),
            trajectory_id=draw(texts), reward_failed=draw(texts), version_spans=spans,
        ))  # fmt: skip
    return Group.build(
        group_id=draw(texts), prompt_id=draw(texts), credit_id=draw(ints), actor_id=draw(texts),
        seq=draw(ints), trajectories=trajectories, metadata=draw(maps),
        timings=draw(st.dictionaries(texts, floats, max_size=3)),
        reward_components=draw(st.dictionaries(texts, st.lists(floats, min_size=n, max_size=n),
                                               max_size=3)),
    )  # fmt: skip


def builds(cls: type) -> st.SearchStrategy[Any]:
    if cls is Group:
        return groups()
    fields: dict[str, Any] = {}
    for spec in SPECS[cls]:
        if spec.kind == "msgs":
            fields[spec.name] = st.lists(builds(spec.nested), max_size=2).map(tuple)
        elif spec.kind == "array":  # Scores: one float32 per sample
            one = st.floats(width=32, allow_nan=False, allow_infinity=False)
            fields[spec.name] = st.lists(one, max_size=6).map(lambda v: np.array(v, np.float32))
        else:
            fields[spec.name] = KIND[spec.kind]
    return st.builds(cls, **fields)


def same(a: Any, b: Any) -> bool:
    """Structural equality that compares arrays by dtype, shape and contents."""
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.array_equal(a, b)
        )
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(
            same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return type(a) is type(b) and a == b


def wire(msg: Any) -> list[bytes]:
    """Encode and copy every frame to bytes, as the receiving socket would see it."""
    return [bytes(memoryview(f)) for f in encode(msg)]


# --- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.TYPE)
def test_round_trip(cls: type) -> None:
    @FAST
    @given(builds(cls))
    def check(msg: Any) -> None:
        assert same(decode(wire(msg)), msg)
        assert same(decode(encode(msg)), msg)  # memoryview frames, as sent

    check()


def test_decoded_arrays_are_read_only_views_of_the_frames() -> None:
    group = GOLDEN_MESSAGES[Group.TYPE]
    frames = wire(group)
    out = decode(frames)
    assert not out.tokens.flags.writeable
    assert np.shares_memory(out.tokens, np.frombuffer(frames[1], np.uint8))


def test_unknown_header_keys_are_ignored_and_optional_fields_default() -> None:
    header = msgpack.unpackb(wire(Ack(seq=3, credit_id=5))[0])
    header["added_later"] = [1, 2]
    del header["credit_id"]
    assert decode([msgpack.packb(header)]) == Ack(seq=3)


@FAST
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=4))
def test_arbitrary_bytes_raise_only_protocol_errors(frames: list[bytes]) -> None:
    try:
        decode(frames)
    except ProtocolError:
        pass


@pytest.mark.parametrize("name", ["StatusRequest", "Status", "AlarmRaised", "Control",
                                  "EvalRequest", "EvalResult", "Credits", "Group"])  # fmt: skip
def test_a_field_replaced_by_anything_decodes_or_raises_protocol_error(name: str) -> None:
    @FAST
    @given(st.data())
    def check(data: st.DataObject) -> None:
        frames = wire(GOLDEN_MESSAGES[name])
        head = msgpack.unpackb(frames[0])
        key = data.draw(st.sampled_from(sorted(head)))
        head[key] = data.draw(values)
        try:
            msg = decode([msgpack.packb(head), *frames[1:]])
        except ProtocolError:
            return
        assert type(msg) is type(GOLDEN_MESSAGES[name]) or key == "type"

    check()


# --- golden bytes (any change here is a wire-format change: bump PROTOCOL_VERSION) -------------


def _golden_messages() -> list[Any]:
    traj = Trajectory(
        tokens=np.array([5, 6, 7, 8, 9], np.int32),
        prompt_len=3,
        loss_mask=np.array([1, 0], np.uint8),
        behavior_logprobs=np.array([-0.5, 0.0], np.float32),
        reward=1.0,
        min_policy_version=2,
        max_policy_version=3,
        finish_reason="stop",
    )
    group = Group.build(
        group_id="a/1",
        prompt_id="p1",
        credit_id=7,
        actor_id="a",
        seq=1,
        trajectories=[traj],
        metadata={"env": "sort"},
        timings={"generate_s": 0.25},
    )
    item = CreditItem(credit_id=7, prompt_id="p1", prompt="sort 31", seed=42, info={"digits": "31"})
    return [
        Hello(role="actor", client_id="a", protocol_version=2, config_hash="abcd", concurrency=4),
        Welcome(client_id="a", policy_version=3, heartbeat_interval_s=1.0, max_staleness=4),
        Credits(group_size=8, policy_version=3, items=(item,)),
        CreditReturn(credit_ids=[7, 8]),
        group,
        Ack(seq=1, credit_id=7),
        SampleRequest(request_id=9, policy_version=3, num_groups=2),
        Batch(request_id=9, policy_version=3, groups=(group,), dropped_stale=1, wait_s=0.5),
        Version(policy_version=4),
        Members(policy_version=4, actor_ids=["a", "b"]),
        WeightsAnnounce(
            policy_version=4, plan_hash="ph", announcement={"store": "tcp://127.0.0.1:1"}
        ),
        WeightsLoaded(actor_id="a", policy_version=4),
        Heartbeat(client_id="a", policy_version=4),
        StatsRequest(),
        Stats(stats={"groups_received": 3}),
        Error(code="bad_message", field="tokens", detail="must be int32"),
        Bye(client_id="a", reason="done"),
        BatchAck(request_id=9),
        StatusRequest(),
        Status(status={"policy_version": 4, "paused": ""}),
        AlarmRaised(
            name="kl_spike",
            step=9,
            policy_version=9,
            message="kl spiked",
            action="warn",
            evidence={"value": 2.5, "window": [1, 8]},
        ),  # fmt: skip
        Control(action="pause", reason="look"),
        EvalRequest(
            eval_id=2,
            policy_version=5,
            items=(item,),
            num_samples=2,
            temperature=0.0,
            max_new_tokens=8,
            pass_threshold=1.0,
        ),  # fmt: skip
        EvalResult(
            eval_id=2,
            actor_id="a",
            policy_version=5,
            requested_version=5,
            num_samples=2,
            pass_threshold=1.0,
            prompt_ids=["p1"],
            rewards=[1.0, 0.5],
            lengths=[3, 4],
            finish_reasons=["stop", "length"],
            reward_failed=["", ""],
            generate_s=0.125,
        ),  # fmt: skip
        ScoreRequest(request_id=5, prompts=["31:"], completions=["13"], timeout_s=2.0),
        Scores(
            request_id=5,
            scores=np.array([0.5, -1.25], np.float32),
            model_dir="rm",
            model_hash="ab12",
            queue_s=0.25,
            compute_s=0.5,
        ),  # fmt: skip
    ]


GOLDEN_MESSAGES = {msg.TYPE: msg for msg in _golden_messages()}

GOLDEN = {
    "Hello": [
        (
            "87a4726f6c65a56163746f72a9636c69656e745f6964a161b070726f746f636f6c5f76657273696f"
            "6e02ab636f6e6669675f68617368a461626364ab636f6e63757272656e637904a474797065a54865"
            "6c6c6fa870726f746f636f6c02"
        ),
    ],
    "Welcome": [
        (
            "86a9636c69656e745f6964a161ae706f6c6963795f76657273696f6e03b46865617274626561745f"
            "696e74657276616c5f73cb3ff0000000000000ad6d61785f7374616c656e65737304a474797065a7"
            "57656c636f6d65a870726f746f636f6c02"
        ),
    ],
    "Credits": [
        (
            "85aa67726f75705f73697a6508ae706f6c6963795f76657273696f6e03a56974656d739185a96372"
            "656469745f696407a970726f6d70745f6964a27031a670726f6d7074a7736f7274203331a4736565"
            "642aa4696e666f81a6646967697473a23331a474797065a743726564697473a870726f746f636f6c"
            "02"
        ),
    ],
    "CreditReturn": [
        ("83aa6372656469745f696473920708a474797065ac43726564697452657475726ea870726f746f636f6c02"),
    ],
    "Group": [
        (
            "de0014a867726f75705f6964a3612f31a970726f6d70745f6964a27031a96372656469745f696407"
            "a86163746f725f6964a161a373657101ae7472616a6563746f72795f69647391a5612f312f30a873"
            "65715f6c656e739105ab70726f6d70745f6c656e739103a77265776172647391cb3ff00000000000"
            "00b36d696e5f706f6c6963795f76657273696f6e739102b36d61785f706f6c6963795f7665727369"
            "6f6e739103ae66696e6973685f726561736f6e7391a473746f70ad7265776172645f6661696c6564"
            "91a0a6746f6b656e7383a56474797065a5696e743332a573686170659105a56672616d6501a96c6f"
            "73735f6d61736b83a56474797065a575696e7438a573686170659102a56672616d6502b162656861"
            "76696f725f6c6f6770726f627383a56474797065a7666c6f61743332a573686170659102a5667261"
            "6d6503a86d6574616461746181a3656e76a4736f7274a774696d696e677381aa67656e6572617465"
            "5f73cb3fd0000000000000a474797065a547726f7570a870726f746f636f6c02"
        ),
        "0500000006000000070000000800000009000000",
        "0100",
        "000000bf00000000",
    ],
    "Ack": [
        "84a373657101a96372656469745f696407a474797065a341636ba870726f746f636f6c02",
    ],
    "SampleRequest": [
        (
            "85aa726571756573745f696409ae706f6c6963795f76657273696f6e03aa6e756d5f67726f757073"
            "02a474797065ad53616d706c6552657175657374a870726f746f636f6c02"
        ),
    ],
    "Batch": [  # its header, then the Group message embedded whole
        (
            "87aa726571756573745f696409ae706f6c6963795f76657273696f6e03a667726f7570739104ad64"
            "726f707065645f7374616c6501a6776169745f73cb3fe0000000000000a474797065a54261746368"
            "a870726f746f636f6c02"
        ),
    ],
    "Version": [
        "83ae706f6c6963795f76657273696f6e04a474797065a756657273696f6ea870726f746f636f6c02",
    ],
    "Members": [
        (
            "84ae706f6c6963795f76657273696f6e04a96163746f725f69647392a161a162a474797065a74d65"
            "6d62657273a870726f746f636f6c02"
        ),
    ],
    "WeightsAnnounce": [
        (
            "85ae706f6c6963795f76657273696f6e04a9706c616e5f68617368a27068ac616e6e6f756e63656d"
            "656e7481a573746f7265b17463703a2f2f3132372e302e302e313a31a474797065af576569676874"
            "73416e6e6f756e6365a870726f746f636f6c02"
        ),
    ],
    "WeightsLoaded": [
        (
            "84a86163746f725f6964a161ae706f6c6963795f76657273696f6e04a474797065ad576569676874"
            "734c6f61646564a870726f746f636f6c02"
        ),
    ],
    "Heartbeat": [
        (
            "84a9636c69656e745f6964a161ae706f6c6963795f76657273696f6e04a474797065a94865617274"
            "62656174a870726f746f636f6c02"
        ),
    ],
    "StatsRequest": [
        "82a474797065ac537461747352657175657374a870726f746f636f6c02",
    ],
    "Stats": [
        (
            "83a5737461747381af67726f7570735f726563656976656403a474797065a55374617473a870726f"
            "746f636f6c02"
        ),
    ],
    "Error": [
        (
            "85a4636f6465ab6261645f6d657373616765a56669656c64a6746f6b656e73a664657461696cad6d"
            "75737420626520696e743332a474797065a54572726f72a870726f746f636f6c02"
        ),
    ],
    "Bye": [
        (
            "84a9636c69656e745f6964a161a6726561736f6ea4646f6e65a474797065a3427965a870726f746f"
            "636f6c02"
        ),
    ],
    "BatchAck": ["83aa726571756573745f696409a474797065a8426174636841636ba870726f746f636f6c02"],
    "StatusRequest": [
        ("82a474797065ad53746174757352657175657374a870726f746f636f6c02"),
    ],
    "Status": [
        (
            "83a673746174757382ae706f6c6963795f76657273696f6e04a6706175736564a0a474797065a653"
            "7461747573a870726f746f636f6c02"
        ),
    ],
    "AlarmRaised": [
        (
            "88a46e616d65a86b6c5f7370696b65a47374657009ae706f6c6963795f76657273696f6e09a76d65"
            "7373616765a96b6c207370696b6564a6616374696f6ea47761726ea865766964656e636582a57661"
            "6c7565cb4004000000000000a677696e646f77920108a474797065ab416c61726d526169736564a8"
            "70726f746f636f6c02"
        ),
    ],
    "Control": [
        (
            "84a6616374696f6ea57061757365a6726561736f6ea46c6f6f6ba474797065a7436f6e74726f6ca8"
            "70726f746f636f6c02"
        ),
    ],
    "EvalRequest": [
        (
            "89a76576616c5f696402ae706f6c6963795f76657273696f6e05a56974656d739185a96372656469"
            "745f696407a970726f6d70745f6964a27031a670726f6d7074a7736f7274203331a4736565642aa4"
            "696e666f81a6646967697473a23331ab6e756d5f73616d706c657302ab74656d7065726174757265"
            "cb0000000000000000ae6d61785f6e65775f746f6b656e7308ae706173735f7468726573686f6c64"
            "cb3ff0000000000000a474797065ab4576616c52657175657374a870726f746f636f6c02"
        ),
    ],
    "EvalResult": [
        (
            "8ea76576616c5f696402a86163746f725f6964a161ae706f6c6963795f76657273696f6e05b17265"
            "717565737465645f76657273696f6e05ab6e756d5f73616d706c657302ae706173735f7468726573"
            "686f6c64cb3ff0000000000000aa70726f6d70745f69647391a27031a77265776172647392cb3ff0"
            "000000000000cb3fe0000000000000a76c656e67746873920304ae66696e6973685f726561736f6e"
            "7392a473746f70a66c656e677468ad7265776172645f6661696c656492a0a0aa67656e6572617465"
            "5f73cb3fc0000000000000a474797065aa4576616c526573756c74a870726f746f636f6c02"
        ),
    ],
    "ScoreRequest": [
        (
            "86aa726571756573745f696405a770726f6d70747391a333313aab636f6d706c6574696f6e7391a2"
            "3133a974696d656f75745f73cb4000000000000000a474797065ac53636f726552657175657374a8"
            "70726f746f636f6c02"
        ),
    ],
    "Scores": [
        (
            "88aa726571756573745f696405a673636f72657383a56474797065a7666c6f61743332a573686170"
            "659102a56672616d6501a96d6f64656c5f646972a2726daa6d6f64656c5f68617368a461623132a7"
            "71756575655f73cb3fd0000000000000a9636f6d707574655f73cb3fe0000000000000a474797065"
            "a653636f726573a870726f746f636f6c02"
        ),
        "0000003f0000a0bf",
    ],
}
GOLDEN["Batch"] += GOLDEN["Group"]  # embedded: the very frames of the Group message

# Messages with appended delivery fields set (at their defaults they stay off the wire, above).
GOLDEN_DELIVERY = [
    (
        Hello(
            role="learner",
            client_id="l",
            protocol_version=2,
            config_hash="abcd",
            batched_acks=True,
            session=12345,
            acks_batches=True,
        ),
        "8aa4726f6c65a76c6561726e6572a9636c69656e745f6964a16cb070726f746f636f6c5f76657273696f6e"
        "02ab636f6e6669675f68617368a461626364ab636f6e63757272656e637900ac626174636865645f61636b"
        "73c3a773657373696f6ecd3039ac61636b735f62617463686573c3a474797065a548656c6c6fa870726f74"
        "6f636f6c02",
    ),
    (
        Welcome(
            client_id="a", policy_version=3, heartbeat_interval_s=1.0, max_staleness=4, next_seq=17
        ),
        "87a9636c69656e745f6964a161ae706f6c6963795f76657273696f6e03b46865617274626561745f696e74"
        "657276616c5f73cb3ff0000000000000ad6d61785f7374616c656e65737304a86e6578745f73657111a474"
        "797065a757656c636f6d65a870726f746f636f6c02",
    ),
]


@pytest.mark.parametrize("msg, golden", GOLDEN_DELIVERY, ids=["Hello", "Welcome"])
def test_golden_bytes_of_delivery_fields(msg: Any, golden: str) -> None:
    assert [frame.hex() for frame in wire(msg)] == [golden]
    assert same(decode([bytes.fromhex(golden)]), msg)


def test_every_message_type_has_golden_bytes() -> None:
    assert set(GOLDEN) == set(GOLDEN_MESSAGES) == {cls.TYPE for cls in MESSAGE_TYPES}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_bytes(name: str) -> None:
    msg = GOLDEN_MESSAGES[name]
    assert [frame.hex() for frame in wire(msg)] == GOLDEN[name]
    assert same(decode([bytes.fromhex(h) for h in GOLDEN[name]]), msg)


# --- rejections name the field ------------------------------------------------------------------


def header(msg: Any) -> dict[str, Any]:
    return msgpack.unpackb(wire(msg)[0])


def edited(msg: Any, **changes: Any) -> list[bytes]:
    frames = wire(msg)
    h = msgpack.unpackb(frames[0])
    h.update(changes)
    return [msgpack.packb(h), *frames[1:]]


def rejected(frames: list[Any], limit: int = 2**30) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(frames, limit)
    return info.value


GROUP = GOLDEN_MESSAGES["Group"]


def test_garbage_and_structure() -> None:
    assert rejected([]).field == "frames"
    assert rejected([b"\xc1"]).field == "header"
    assert rejected([msgpack.packb([1])]).field == "header"
    assert rejected(edited(Version(policy_version=1), type="Nope")).field == "type"
    err = rejected(edited(Version(policy_version=1), protocol=PROTOCOL_VERSION + 1))
    assert (err.field, err.code) == ("protocol", "protocol_mismatch")
    assert rejected([*wire(GROUP), b"x"]).field == "frames"
    h = header(Version(policy_version=1))
    del h["policy_version"]
    assert rejected([msgpack.packb(h)]).field == "policy_version"


def test_wrong_scalar_and_list_types() -> None:
    assert rejected(edited(Version(policy_version=1), policy_version="1")).field == "policy_version"
    assert (
        rejected(edited(Version(policy_version=1), policy_version=True)).field == "policy_version"
    )
    assert rejected(edited(GROUP, rewards=["a"])).field == "rewards"
    assert rejected(edited(GROUP, seq_lens=5)).field == "seq_lens"
    assert rejected(edited(GROUP, metadata=[1])).field == "metadata"
    item = header(GOLDEN_MESSAGES["Credits"])["items"][0]
    assert (
        rejected(edited(GOLDEN_MESSAGES["Credits"], items=[{**item, "credit_id": "7"}])).field
        == "items[0].credit_id"
    )


def test_truncated_frames() -> None:
    frames = wire(GROUP)
    err = rejected([*frames[:-1], frames[-1][:-1]])
    assert (err.field, err.code) == ("behavior_logprobs", "truncated")
    assert rejected(frames[:-1]).field == "behavior_logprobs"
    batch = wire(GOLDEN_MESSAGES["Batch"])
    assert rejected([*batch[:-1], batch[-1][:-2]]).field == "groups[0].behavior_logprobs"


def test_wrong_dtype_and_shape() -> None:
    ref = header(GROUP)["tokens"]
    assert rejected(edited(GROUP, tokens={**ref, "dtype": "int64"})).field == "tokens"
    assert rejected(edited(GROUP, tokens={**ref, "shape": [1, 5]})).field == "tokens"
    assert rejected(edited(GROUP, tokens={**ref, "shape": [-5]})).field == "tokens"
    assert rejected(edited(GROUP, tokens={**ref, "frame": 9})).field == "tokens"
    assert rejected(edited(GROUP, loss_mask={**ref, "dtype": "uint8"})).field == "loss_mask"
    assert rejected(edited(GROUP, tokens=[1, 2])).field == "tokens"


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.5])
def test_non_finite_or_positive_logprobs(bad: float) -> None:
    frames = wire(GROUP)
    lp = np.frombuffer(frames[3], np.float32).copy()
    lp[0] = bad
    assert rejected([*frames[:3], lp.tobytes()]).field == "behavior_logprobs"


@pytest.mark.parametrize("length", [5, 40_000])  # below and above group_codec._ARG_BELOW (floats)
@pytest.mark.parametrize(
    ("field", "bad"),
    [("tokens", -1), ("loss_mask", 2), ("behavior_logprobs", math.nan),
     ("behavior_logprobs", -math.inf), ("behavior_logprobs", math.inf)],
)  # fmt: skip
@pytest.mark.parametrize("where", [0, -1])
def test_value_scans_find_a_bad_entry_anywhere_at_any_length(
    length: int, field: str, bad: float, where: int
) -> None:
    """Small arrays are scanned with argmin/argmax, large ones with reductions: both refuse
    the same entries, wherever they sit, and accept the clean group."""
    arrays = {"tokens": np.arange(length, dtype=np.int32),
              "loss_mask": np.ones(length - 1, np.uint8),
              "behavior_logprobs": -np.linspace(0.0, 3.0, length - 1, dtype=np.float32)}  # fmt: skip
    group = dataclasses.replace(GROUP, seq_lens=[length], prompt_lens=[1], **arrays)
    assert isinstance(decode(encode(group)), Group)
    bad_array = arrays[field].copy()
    bad_array[where] = bad
    bad_group = dataclasses.replace(group, **{field: bad_array})
    frames = wire(bad_group)
    assert decode_group([memoryview(f) for f in frames], True) is None
    assert rejected(frames).field == field


def test_non_finite_scalars() -> None:
    assert rejected(edited(GROUP, rewards=[math.nan])).field == "rewards"
    assert rejected(edited(GROUP, timings={"t": math.inf})).field == "timings"
    welcome = GOLDEN_MESSAGES["Welcome"]
    assert rejected(edited(welcome, heartbeat_interval_s=math.nan)).field == "heartbeat_interval_s"


def test_group_consistency() -> None:
    assert rejected(edited(GROUP, prompt_lens=[9])).field == "prompt_lens"
    assert rejected(edited(GROUP, rewards=[1.0, 2.0])).field == "rewards"
    assert rejected(edited(GROUP, seq_lens=[4])).field == "tokens"
    assert rejected(edited(GROUP, finish_reasons=["bored"])).field == "finish_reasons"
    assert rejected(edited(GROUP, min_policy_versions=[9])).field == "min_policy_versions"
    frames = wire(GROUP)
    assert rejected([*frames[:2], b"\x02\x00", frames[3]]).field == "loss_mask"
    assert (
        rejected([frames[0], np.array([-1, 0, 0, 0, 0], np.int32).tobytes(), *frames[2:]]).field
        == "tokens"
    )


def test_oversized() -> None:
    frames = wire(GROUP)
    size = sum(map(len, frames))
    err = rejected(frames, limit=size - 1)
    assert (err.field, err.code) == ("message", "too_large")
    assert same(decode(frames, size), GROUP)


def test_check_hello() -> None:
    hello = GOLDEN_MESSAGES["Hello"]
    check_hello(hello, "abcd")
    with pytest.raises(ProtocolError, match="config_hash") as info:
        check_hello(hello, "other")
    assert info.value.code == "config_mismatch"
    old = dataclasses.replace(hello, protocol_version=PROTOCOL_VERSION + 1)
    with pytest.raises(ProtocolError) as info:
        check_hello(old, "abcd")
    assert (info.value.field, info.value.code) == ("protocol_version", "protocol_mismatch")
    with pytest.raises(ProtocolError, match="role"):
        check_hello(dataclasses.replace(hello, role="boss"), "abcd")


def test_received_frames_are_forwarded_without_copies() -> None:
    zmq = pytest.importorskip("zmq")
    received = [zmq.Frame(f) for f in wire(GROUP)]
    batch = Batch(request_id=1, policy_version=0, groups=(decode(received),))
    frames = encode(batch)
    assert all(
        out is got for out, got in zip(frames[1:], received, strict=True)
    )  # the very frames received, the group's header among them
    assert same(decode(wire(batch)), batch)
    partial = np.frombuffer(received[1].buffer[4:], np.int32)  # a view of part of a frame
    assert not isinstance(encode(dataclasses.replace(GROUP, tokens=partial, seq_lens=[4], prompt_lens=[3],
                                                     loss_mask=GROUP.loss_mask[:1],
                                                     behavior_logprobs=GROUP.behavior_logprobs[:1]))[1],
                          zmq.Frame)  # fmt: skip


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

    def fast(header: bytes) -> bool:
        return decode_group([memoryview(header), *map(memoryview, frames[1:])], True) is not None

    refused = [frames[0] + b"\x01", msgpack.packb({**head, "metadata": {1: 2}}),
               msgpack.packb({**head, "metadata": {"a": {1: 2}}}),
               msgpack.packb({**head, "unknown": {1: 2}})]  # fmt: skip
    for header in refused:
        assert not fast(header)
        assert rejected([header, *frames[1:]]).field == "header"
    bytes_key = msgpack.packb({**head, "timings": {b"t": 1.0}})
    assert not fast(bytes_key) and decode([bytes_key, *frames[1:]]).timings == {b"t": 1.0}
    later = msgpack.packb({**head, "later": 1})  # a field appended by a newer peer
    assert not fast(later) and same(decode([later, *frames[1:]]), GROUP)
    assert fast(frames[0]) and fast(msgpack.packb({**head, "timings": {"t": 1}}))


def test_version_spans_must_describe_the_versions() -> None:
    traj = Trajectory(tokens=np.arange(7, dtype=np.int32), prompt_len=2,
                      loss_mask=np.ones(5, np.uint8), behavior_logprobs=np.zeros(5, np.float32),
                      reward=1.0, min_policy_version=3, max_policy_version=5,
                      finish_reason="stop", version_spans=(0, 3, 2, 4, 4, 5))  # fmt: skip
    group = Group.build(group_id="g", prompt_id="p", credit_id=1, actor_id="a", seq=0,
                        trajectories=[traj, dataclasses.replace(traj, version_spans=(0, 3, 1, 5))])  # fmt: skip
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
    for key, value, field in (("protocol", 1, "groups[0].protocol"), ("type", "Batch", "groups[0].type"),
                              ("seq_lens", [9], "groups[0].tokens")):  # fmt: skip
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
    for key, value, field in (("rewards", [1.0, 2.0], "groups[0].rewards"),
                              ("seq_lens", [9], "groups[0].tokens"),
                              ("prompt_lens", ["a"], "groups[0].prompt_lens")):  # fmt: skip
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


GOLDEN_COMPONENTS_HEADER = (
    "de0015a867726f75705f6964a3612f31a970726f6d70745f6964a27031a96372656469745f696407a86163"
    "746f725f6964a161a373657101ae7472616a6563746f72795f69647391a5612f312f30a87365715f6c656e"
    "739105ab70726f6d70745f6c656e739103a77265776172647391cb3ff0000000000000b36d696e5f706f6c"
    "6963795f76657273696f6e739102b36d61785f706f6c6963795f76657273696f6e739103ae66696e697368"
    "5f726561736f6e7391a473746f70ad7265776172645f6661696c656491a0a6746f6b656e7383a564747970"
    "65a5696e743332a573686170659105a56672616d6501a96c6f73735f6d61736b83a56474797065a575696e"
    "7438a573686170659102a56672616d6502b16265686176696f725f6c6f6770726f627383a56474797065a7"
    "666c6f61743332a573686170659102a56672616d6503a86d6574616461746181a3656e76a4736f7274a774"
    "696d696e677381aa67656e65726174655f73cb3fd0000000000000b17265776172645f636f6d706f6e656e"
    "747382a47461736b91cb3ff0000000000000a56a7564676591cb3fe0000000000000a474797065a547726f"
    "7570a870726f746f636f6c02"
)
