"""Golden encoded bytes of every message (any change here is a wire-format change: bump
PROTOCOL_VERSION), and the messages they encode."""

from __future__ import annotations

from typing import Any

import numpy as np

from asyncrl.protocol.messages import (
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
)


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
        Hello(role="actor", client_id="a", protocol_version=3, config_hash="abcd", concurrency=4),
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
        ),
        Control(action="pause", reason="look"),
        EvalRequest(
            eval_id=2,
            policy_version=5,
            items=(item,),
            num_samples=2,
            temperature=0.0,
            max_new_tokens=8,
            pass_threshold=1.0,
        ),
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
        ),
        ScoreRequest(request_id=5, prompts=["31:"], completions=["13"], timeout_s=2.0),
        Scores(
            request_id=5,
            scores=np.array([0.5, -1.25], np.float32),
            model_dir="rm",
            model_hash="ab12",
            queue_s=0.25,
            compute_s=0.5,
        ),
    ]


GOLDEN_MESSAGES = {msg.TYPE: msg for msg in _golden_messages()}

GOLDEN = {
    "Hello": [
        (
            "87a4726f6c65a56163746f72a9636c69656e745f6964a161b070726f746f636f6c5f76657273696f"
            "6e03ab636f6e6669675f68617368a461626364ab636f6e63757272656e637904a474797065a54865"
            "6c6c6fa870726f746f636f6c03"
        ),
    ],
    "Welcome": [
        (
            "86a9636c69656e745f6964a161ae706f6c6963795f76657273696f6e03b46865617274626561745f"
            "696e74657276616c5f73cb3ff0000000000000ad6d61785f7374616c656e65737304a474797065a7"
            "57656c636f6d65a870726f746f636f6c03"
        ),
    ],
    "Credits": [
        (
            "85aa67726f75705f73697a6508ae706f6c6963795f76657273696f6e03a56974656d739185a96372"
            "656469745f696407a970726f6d70745f6964a27031a670726f6d7074a7736f7274203331a4736565"
            "642aa4696e666f81a6646967697473a23331a474797065a743726564697473a870726f746f636f6c"
            "03"
        ),
    ],
    "CreditReturn": [
        ("83aa6372656469745f696473920708a474797065ac43726564697452657475726ea870726f746f636f6c03"),
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
            "5f73cb3fd0000000000000a474797065a547726f7570a870726f746f636f6c03"
        ),
        "0500000006000000070000000800000009000000",
        "0100",
        "000000bf00000000",
    ],
    "Ack": [
        "84a373657101a96372656469745f696407a474797065a341636ba870726f746f636f6c03",
    ],
    "SampleRequest": [
        (
            "85aa726571756573745f696409ae706f6c6963795f76657273696f6e03aa6e756d5f67726f757073"
            "02a474797065ad53616d706c6552657175657374a870726f746f636f6c03"
        ),
    ],
    "Batch": [  # its header, then the Group message embedded whole
        (
            "87aa726571756573745f696409ae706f6c6963795f76657273696f6e03a667726f7570739104ad64"
            "726f707065645f7374616c6501a6776169745f73cb3fe0000000000000a474797065a54261746368"
            "a870726f746f636f6c03"
        ),
    ],
    "Version": [
        "83ae706f6c6963795f76657273696f6e04a474797065a756657273696f6ea870726f746f636f6c03",
    ],
    "Members": [
        (
            "84ae706f6c6963795f76657273696f6e04a96163746f725f69647392a161a162a474797065a74d65"
            "6d62657273a870726f746f636f6c03"
        ),
    ],
    "WeightsAnnounce": [
        (
            "85ae706f6c6963795f76657273696f6e04a9706c616e5f68617368a27068ac616e6e6f756e63656d"
            "656e7481a573746f7265b17463703a2f2f3132372e302e302e313a31a474797065af576569676874"
            "73416e6e6f756e6365a870726f746f636f6c03"
        ),
    ],
    "WeightsLoaded": [
        (
            "84a86163746f725f6964a161ae706f6c6963795f76657273696f6e04a474797065ad576569676874"
            "734c6f61646564a870726f746f636f6c03"
        ),
    ],
    "Heartbeat": [
        (
            "84a9636c69656e745f6964a161ae706f6c6963795f76657273696f6e04a474797065a94865617274"
            "62656174a870726f746f636f6c03"
        ),
    ],
    "StatsRequest": [
        "82a474797065ac537461747352657175657374a870726f746f636f6c03",
    ],
    "Stats": [
        (
            "83a5737461747381af67726f7570735f726563656976656403a474797065a55374617473a870726f"
            "746f636f6c03"
        ),
    ],
    "Error": [
        (
            "85a4636f6465ab6261645f6d657373616765a56669656c64a6746f6b656e73a664657461696cad6d"
            "75737420626520696e743332a474797065a54572726f72a870726f746f636f6c03"
        ),
    ],
    "Bye": [
        (
            "84a9636c69656e745f6964a161a6726561736f6ea4646f6e65a474797065a3427965a870726f746f"
            "636f6c03"
        ),
    ],
    "BatchAck": ["83aa726571756573745f696409a474797065a8426174636841636ba870726f746f636f6c03"],
    "StatusRequest": [
        ("82a474797065ad53746174757352657175657374a870726f746f636f6c03"),
    ],
    "Status": [
        (
            "83a673746174757382ae706f6c6963795f76657273696f6e04a6706175736564a0a474797065a653"
            "7461747573a870726f746f636f6c03"
        ),
    ],
    "AlarmRaised": [
        (
            "88a46e616d65a86b6c5f7370696b65a47374657009ae706f6c6963795f76657273696f6e09a76d65"
            "7373616765a96b6c207370696b6564a6616374696f6ea47761726ea865766964656e636582a57661"
            "6c7565cb4004000000000000a677696e646f77920108a474797065ab416c61726d526169736564a8"
            "70726f746f636f6c03"
        ),
    ],
    "Control": [
        (
            "84a6616374696f6ea57061757365a6726561736f6ea46c6f6f6ba474797065a7436f6e74726f6ca8"
            "70726f746f636f6c03"
        ),
    ],
    "EvalRequest": [
        (
            "89a76576616c5f696402ae706f6c6963795f76657273696f6e05a56974656d739185a96372656469"
            "745f696407a970726f6d70745f6964a27031a670726f6d7074a7736f7274203331a4736565642aa4"
            "696e666f81a6646967697473a23331ab6e756d5f73616d706c657302ab74656d7065726174757265"
            "cb0000000000000000ae6d61785f6e65775f746f6b656e7308ae706173735f7468726573686f6c64"
            "cb3ff0000000000000a474797065ab4576616c52657175657374a870726f746f636f6c03"
        ),
    ],
    "EvalResult": [
        (
            "8ea76576616c5f696402a86163746f725f6964a161ae706f6c6963795f76657273696f6e05b17265"
            "717565737465645f76657273696f6e05ab6e756d5f73616d706c657302ae706173735f7468726573"
            "686f6c64cb3ff0000000000000aa70726f6d70745f69647391a27031a77265776172647392cb3ff0"
            "000000000000cb3fe0000000000000a76c656e67746873920304ae66696e6973685f726561736f6e"
            "7392a473746f70a66c656e677468ad7265776172645f6661696c656492a0a0aa67656e6572617465"
            "5f73cb3fc0000000000000a474797065aa4576616c526573756c74a870726f746f636f6c03"
        ),
    ],
    "ScoreRequest": [
        (
            "86aa726571756573745f696405a770726f6d70747391a333313aab636f6d706c6574696f6e7391a2"
            "3133a974696d656f75745f73cb4000000000000000a474797065ac53636f726552657175657374a8"
            "70726f746f636f6c03"
        ),
    ],
    "Scores": [
        (
            "88aa726571756573745f696405a673636f72657383a56474797065a7666c6f61743332a573686170"
            "659102a56672616d6501a96d6f64656c5f646972a2726daa6d6f64656c5f68617368a461623132a7"
            "71756575655f73cb3fd0000000000000a9636f6d707574655f73cb3fe0000000000000a474797065"
            "a653636f726573a870726f746f636f6c03"
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
            protocol_version=3,
            config_hash="abcd",
            batched_acks=True,
            session=12345,
            acks_batches=True,
        ),
        "8aa4726f6c65a76c6561726e6572a9636c69656e745f6964a16cb070726f746f636f6c5f76657273696f6e"
        "03ab636f6e6669675f68617368a461626364ab636f6e63757272656e637900ac626174636865645f61636b"
        "73c3a773657373696f6ecd3039ac61636b735f62617463686573c3a474797065a548656c6c6fa870726f74"
        "6f636f6c03",
    ),
    (
        Welcome(
            client_id="a", policy_version=3, heartbeat_interval_s=1.0, max_staleness=4, next_seq=17
        ),
        "87a9636c69656e745f6964a161ae706f6c6963795f76657273696f6e03b46865617274626561745f696e74"
        "657276616c5f73cb3ff0000000000000ad6d61785f7374616c656e65737304a86e6578745f73657111a474"
        "797065a757656c636f6d65a870726f746f636f6c03",
    ),
]


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
    "7570a870726f746f636f6c03"
)

GROUP = GOLDEN_MESSAGES["Group"]
