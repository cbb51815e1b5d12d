"""The reward pipeline: composition, failure policies, format/length guards, disagreement,
canaries through the live path."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import pytest

from actors.envs.base import Row, Step
from actors.envs.sort_task import make_env as make_sort_env
from actors.rewards.canaries import CanaryRunner, sort_canaries
from actors.rewards.guards import (
    FormatGate,
    OverlongPenalty,
    RepetitionPenalty,
    overlong_penalty,
)
from actors.rewards.judge import JudgeComponent
from actors.rewards.pipeline import (
    ComponentResult,
    ComposeRule,
    InlineComponent,
    RewardPipeline,
    ScoreItem,
    done,
)
from asyncrl.config import RewardConfig, RunConfig, TaskConfig


def item(
    completion: str = "1134", reward: float = 1.0, tokens: int = 5, failed: str = ""
) -> ScoreItem:
    row = Row(prompt_id="p", prompt="3141:", answer="1134")
    step = Step(reward=reward, done=True, finish_reason="stop")
    return ScoreItem(
        row=row,
        prompt="3141:",
        completion=completion,
        step=step,
        task_failed=failed,
        num_completion_tokens=tokens,
    )


class Const(InlineComponent):
    def __init__(self, name: str, value: float) -> None:
        self.name, self.value = name, value

    def score_one(self, item: ScoreItem) -> ComponentResult:
        return ComponentResult(value=self.value)


class Flaky:
    """Fails its first `fails` submits (raises), then answers 0.5."""

    def __init__(self, fails: int, name: str = "rm") -> None:
        self.name, self.fails, self.calls = name, fails, 0

    def submit(self, items: Sequence[ScoreItem]) -> Future[list[ComponentResult]]:
        self.calls += 1
        if self.calls <= self.fails:
            future: Future[list[ComponentResult]] = Future()
            future.set_exception(ConnectionError("server gone"))
            return future
        return done([ComponentResult(value=0.5)] * len(items))

    def provenance(self) -> dict[str, str]:
        return {"checkpoint": "abc"}

    def close(self) -> None:
        return None


class Silent:
    """Never answers."""

    name = "slow"

    def submit(self, items: Sequence[ScoreItem]) -> Future[list[ComponentResult]]:
        return Future()

    def provenance(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        return None


def pipeline(components: list, weights: dict[str, float], **kw: object) -> RewardPipeline:
    from actors.rewards.pipeline import TaskComponent

    gates = kw.pop("gates", ())
    assert isinstance(gates, tuple)
    rule = ComposeRule.from_config(RewardConfig(weights=weights, gates=gates))
    return RewardPipeline([TaskComponent(), *components], rule, log=lambda _: None, **kw)  # type: ignore[arg-type]


def test_weighted_sum_gates_and_clip() -> None:
    rule = ComposeRule.from_config(
        RewardConfig(
            weights={"task": 1, "rm": 0.5, "judge": 0}, gates=("format",), clip_min=-1, clip_max=1.2
        )
    )
    assert rule.names == ["task", "rm", "judge", "format"]
    assert rule.apply({"task": 1.0, "rm": 2.0, "judge": 9.0, "format": 1.0}) == 1.2  # clipped
    assert rule.apply({"task": 1.0, "rm": -0.5, "format": 1.0}) == 0.75
    assert rule.apply({"task": 1.0, "rm": 2.0, "format": 0.0}) == 0.0  # the gate failed
    with pytest.raises(ValueError, match="reward.weights"):
        RewardConfig(weights={"task": "x"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="reward.gates"):
        RewardConfig(gates=("format>>1",))


def test_every_component_is_recorded_with_provenance() -> None:
    p = pipeline([Const("bonus", -2.5), Flaky(0)], {"task": 1, "rm": 1, "bonus": 1})
    [out] = p.score([item()])
    assert out.reward == -1.0 and out.components == {"task": 1.0, "bonus": -2.5, "rm": 0.5}
    fields = p.group_fields([out])
    assert fields["reward_components"] == {"task": [1.0], "bonus": [-2.5], "rm": [0.5]}
    provenance = fields["metadata"]["reward"]["provenance"]
    assert provenance["rule"] == p.rule.digest()
    assert provenance["components"]["rm"] == {"checkpoint": "abc"}


def test_a_failed_component_is_recorded_never_silent() -> None:
    p = pipeline([Flaky(99)], {"task": 1, "rm": 1})
    [out] = p.score([item()])
    assert out.reward == 0.0 and out.failed_components == ("rm",)
    assert "ConnectionError: server gone" in out.failed
    assert p.group_fields([out])["reward_failed"] == [out.failed]
    assert p.stats["failed/rm"] == 1


def test_retry_policy_rescores_the_failed_items() -> None:
    flaky = Flaky(1)
    p = pipeline([flaky], {"task": 1, "rm": 1}, on_failure="retry", max_retries=2)
    [out] = p.score([item()])
    assert out.failed == "" and out.reward == 1.5 and flaky.calls == 2
    assert p.stats["retried/rm"] == 1


def test_drop_group_policy_marks_the_outcome() -> None:
    p = pipeline([Flaky(99)], {"task": 1, "rm": 1}, on_failure="drop_group")
    assert all(o.drop_group for o in p.score([item(), item()]))


def test_a_component_that_does_not_answer_times_out_with_a_reason() -> None:
    p = pipeline([Silent()], {"task": 1, "slow": 1}, timeout_s=0.2)
    [out] = p.score([item()])
    assert "slow: timeout" in out.failed


def test_a_task_verifier_failure_is_an_error_with_its_reason() -> None:
    [out] = pipeline([], {"task": 1}).score([item(failed="verifier raised KeyError: 'answer'")])
    assert out.reward == 0.0 and "KeyError" in out.failed


def test_format_gate_zeroes_rewards_without_the_format() -> None:
    p = pipeline([FormatGate(r"^\d+$")], {"task": 1}, gates=("format",))
    right, chatty = p.score([item("1134"), item("Sure! 1134")])
    assert right.reward == 1.0 and chatty.reward == 0.0 and "gate:format" in chatty.flags


def test_dapo_soft_overlong_penalty() -> None:
    assert overlong_penalty(10, 20, 8) == 0.0
    assert overlong_penalty(16, 20, 8) == -0.5
    assert overlong_penalty(20, 20, 8) == -1.0 and overlong_penalty(25, 20, 8) == -1.0
    p = pipeline([OverlongPenalty(20, 8)], {"task": 1, "overlong": 1})
    short, padded = p.score([item(tokens=5), item(tokens=18)])
    assert short.reward == 1.0 and padded.reward == 0.25 and "overlong" in padded.flags


def test_repetition_penalty_catches_padding() -> None:
    p = pipeline([RepetitionPenalty(3, 0.2)], {"task": 1, "repetition": 1})
    honest, padded = p.score(
        [
            item("The digits sorted ascending give 1134 as the answer"),
            item("1134 " + "the answer is 1134 " * 12),
        ]
    )
    assert honest.reward == 1.0 and padded.reward < 0.3 and "repetition" in padded.flags


class Contrarian:
    """A judge backend that grades every response 0."""

    def complete(self, prompts: Sequence[str]) -> list[str]:
        return ["Grade: 0"] * len(prompts)

    def describe(self) -> dict[str, str]:
        return {"backend": "contrarian"}


def test_verifier_judge_disagreement_is_counted_and_logged() -> None:
    lines: list[str] = []
    p = pipeline([JudgeComponent(Contrarian())], {"task": 1, "judge": 0})
    p.log = lines.append
    outs = p.score([item("1134"), item("9999", reward=0.0)])
    assert [o.components["disagreement"] for o in outs] == [1.0, 0.0]
    assert p.stats["disagreements"] == 1 and "disagree" in lines[0]


def sort_runner(pipe: RewardPipeline, lines: list[str]) -> CanaryRunner:
    task = TaskConfig()
    return CanaryRunner(sort_canaries(), lambda: make_sort_env(task), every=3, log=lines.append)


def test_canaries_pass_on_the_sort_verifier_and_run_every_k_versions() -> None:
    lines: list[str] = []
    p = pipeline([], {"task": 1})
    p.canaries = sort_runner(p, lines)
    first = p.group_fields(p.score([item()], policy_version=0))["metadata"]["reward"]
    assert first["canary"]["num"] == 15 and first["canary"]["alarms"] == []
    assert first["canary"]["missed"] == []
    report = p.group_fields(p.score([item()], policy_version=1))["metadata"]["reward"]
    assert "canary" not in report  # handed to the first group after the run, once
    assert p.canaries.next_version == 3 and not lines


def test_a_known_wrong_canary_earning_reward_raises_an_alarm_with_evidence() -> None:
    lines: list[str] = []
    # a reward model that likes everything, weighted in: the hedged and empty canaries now pay
    p = pipeline([Const("rm", 1.0)], {"task": 0.2, "rm": 1})
    p.canaries = sort_runner(p, lines)
    [out] = p.score([item()], policy_version=0)
    report = p.group_fields([out])["metadata"]["reward"]["canary"]
    labels = {a["label"] for a in report["alarms"]}
    assert {"empty", "hedged", "addresses_judge", "descending"} <= labels
    assert p.stats["canary_alarms"] == len(report["alarms"]) and lines[0].startswith("ALARM")
    assert '"label": "empty"' in "".join(lines) and '"reward": ' in lines[0]


def test_reward_config_from_a_run_config() -> None:
    cfg = dataclasses.replace(
        RunConfig(), reward=RewardConfig(weights={"task": 1, "format": 0}, format_regex=r"\d")
    )
    p = RewardPipeline.from_config(cfg)
    assert [c.name for c in p.components] == ["task", "format"]
    start = time.perf_counter()
    assert p.score([item()])[0].reward == 1.0
    assert time.perf_counter() >= start


def test_a_component_of_your_own_by_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_scorers.py").write_text(
        "from actors.rewards.pipeline import ComponentResult, InlineComponent\n"
        "class Length(InlineComponent):\n"
        "    name = 'length'\n"
        "    def score_one(self, item):\n"
        "        return ComponentResult(value=-0.1 * len(item.completion))\n"
        "def make_component(cfg):\n"
        "    return Length()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = RewardConfig(
        weights={"task": 1, "length": 1}, modules={"length": "my_scorers:make_component"}
    )
    p = RewardPipeline.from_config(dataclasses.replace(RunConfig(), reward=reward))
    assert p.score([item("1134")])[0].reward == pytest.approx(0.6)
    with pytest.raises(ValueError, match="unknown component 'nope'"):
        RewardPipeline.from_config(
            dataclasses.replace(RunConfig(), reward=RewardConfig(weights={"task": 1, "nope": 1}))
        )


def test_the_judge_component_from_config_needs_a_url() -> None:
    from actors.rewards.judge import make_component
    from asyncrl.config import JudgeConfig

    with pytest.raises(ValueError, match="judge.url"):
        make_component(RunConfig())
    judge = make_component(
        dataclasses.replace(RunConfig(), judge=JudgeConfig(url="http://127.0.0.1:9/v1"))
    )
    assert judge.provenance()["url"] == "http://127.0.0.1:9/v1/chat/completions"
    judge.close()
