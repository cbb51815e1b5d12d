"""The math task: final-answer extraction, hedging, math-verify in its worker, its failures."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.envs.base import Row
from actors.envs.math_task import MathEnv, VerifyWorker, final_answer, make_rows
from actors.envs.registry import env_factory, task_rows
from asyncrl.config import TaskConfig


@pytest.fixture(scope="module")
def worker() -> Iterator[VerifyWorker]:
    w = VerifyWorker()
    yield w
    w.stop()


def step(worker: VerifyWorker, text: str, answer: str = "42") -> tuple[float, dict]:
    env = MathEnv(worker)
    env.reset(Row(prompt_id="p", prompt="What is 6 * 7?", answer=answer), seed=0)
    s = env.step(text)
    assert s.done
    return s.reward, s.info


@pytest.mark.parametrize(
    ("text", "answer", "flag"),
    [
        ("so \\boxed{42}", "42", ""),
        ("\\boxed{42} and again \\boxed{42}", "42", ""),
        ("First 41.\nAnswer: 42", "42", ""),
        ("\\boxed{41} or maybe \\boxed{42}", None, "hedged"),
        ("\\boxed{41, 42}", None, "hedged"),
        ("\\boxed{41 \\text{ or } 42}", None, "hedged"),
        ("The answer is 41 or 42", None, "hedged"),
        ("42 is what I get.\nThen I stop.", None, "no_answer"),
        ("6 * 7 is\n$42$.", "42", ""),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", ""),
    ],
)
def test_only_the_final_answer_counts_and_hedges_are_refused(
    text: str, answer: str | None, flag: str
) -> None:
    assert final_answer(text) == (answer, flag)


def test_math_verify_scores_equivalent_answers(worker: VerifyWorker) -> None:
    assert step(worker, "6 * 7 = \\boxed{42}")[0] == 1.0
    assert step(worker, "\\boxed{0.5}", answer="\\frac{1}{2}")[0] == 1.0
    assert step(worker, "\\boxed{41}")[0] == 0.0
    assert step(worker, "Answer: 42")[0] == 1.0


def test_hedged_answers_score_zero(worker: VerifyWorker) -> None:
    for text in ("\\boxed{41} \\boxed{42} \\boxed{43}", "\\boxed{40, 41, 42}", "Answer: 41 or 42"):
        reward, info = step(worker, text)
        assert reward == 0.0 and info["flags"] == ["hedged"], text


def test_a_verifier_timeout_is_an_error_with_its_reason(worker: VerifyWorker) -> None:
    # a tower of powers: sympy would compute it for ever; math-verify's signal timeout fires
    # (it works here: the worker runs it on its process's main thread)
    reward, info = step(worker, "\\boxed{9^{9^{9^{9}}}}")
    assert reward == 0.0
    assert info["reward_failed"].startswith("timeout"), info


def test_a_hung_worker_is_killed_and_replaced() -> None:
    w = VerifyWorker(hard_timeout_s=0.5)  # counted from a started worker's request
    try:
        ok, failed = w.check("42", "9^{9^{9^{9}}}")  # its own 5 s timeout is too late here
        assert not ok and "worker killed" in failed
        assert w.restarts == 1
        w.hard_timeout_s = 120.0
        assert w.check("42", "42") == (True, "")  # a fresh worker took over
    finally:
        w.stop()


def test_a_row_without_an_answer_is_a_recorded_failure(worker: VerifyWorker) -> None:
    env = MathEnv(worker)
    env.reset(Row(prompt_id="p", prompt="?"), seed=0)
    assert "no answer" in env.step("\\boxed{1}").info["reward_failed"]


def test_registered_with_generated_rows_and_jsonl_data(tmp_path: Path) -> None:
    task = TaskConfig(name="math", num_prompts=20, seed=3)
    rows = task_rows(task)
    assert len(rows) == 20 and rows == make_rows(task)  # deterministic
    assert all("\\boxed{}" in r.prompt and int(r.answer) >= 0 for r in rows)  # type: ignore[operator]
    assert isinstance(env_factory(task)(task), MathEnv)
    data = tmp_path / "m.jsonl"
    data.write_text(json.dumps({"prompt_id": "a", "prompt": "1+1?", "answer": "2"}) + "\n")
    [row] = task_rows(TaskConfig(name="math", data=str(data)))
    assert row.answer == "2"


def test_math_canaries_through_the_live_path(worker: VerifyWorker) -> None:
    from actors.envs.math_task import make_canaries
    from actors.rewards.canaries import CanaryRunner
    from actors.rewards.pipeline import ComposeRule, RewardPipeline, TaskComponent
    from asyncrl.config import RewardConfig

    lines: list[str] = []
    pipe = RewardPipeline(
        [TaskComponent()], ComposeRule.from_config(RewardConfig()), log=lines.append
    )
    runner = CanaryRunner(
        make_canaries(TaskConfig(name="math")), lambda: MathEnv(worker), every=1, log=lines.append
    )
    report = runner.run(pipe.score_items, policy_version=0)
    assert report["alarms"] == [] and report["missed"] == [] and not lines

    # a verifier that passes any answer: the wrong-answer canaries raise the alarm, while the
    # hedged ones stay at 0 (refused before verification)
    class Lenient(VerifyWorker):
        def check(self, gold: str, answer: str) -> tuple[bool, str]:
            return True, ""

    lenient = CanaryRunner(
        make_canaries(TaskConfig(name="math")),
        lambda: MathEnv(Lenient()),
        every=1,
        log=lines.append,
    )
    labels = {a["label"] for a in lenient.run(pipe.score_items, 0)["alarms"]}
    assert labels == {"wrong", "early_then_wrong"} and lines[0].startswith("ALARM")
