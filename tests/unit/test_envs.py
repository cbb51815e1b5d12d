"""Environments without a model: the registry, JSONL rows, tool calls, tools and the tool env.

What the model writes is scripted here (the environments take text); episodes over the real
model are tests/integration/test_episodes.py.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from actors.envs.base import Observation, Row
from actors.envs.data import from_credit, read_rows, to_record, write_rows
from actors.envs.lookup import lookup_reward, make_rows
from actors.envs.lookup import make_env as make_lookup_env
from actors.envs.registry import env_factory, task_rows, write_prompts
from actors.envs.tool_calls import CompactCalls, JsonCalls, ToolCall
from actors.envs.tool_env import make_env as make_tools_env
from actors.envs.toolbox import TOOLS, Toolbox, calculator, tool
from actors.episodes import ChatTokens
from asyncrl.config import TaskConfig
from asyncrl.models.tiny import build_tokenizer
from asyncrl.plugins import load_attr
from replay.prompts import load_dataset

# --- registry -------------------------------------------------------------------------------


def test_unknown_task_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"task.name: unknown task 'nope' \(known: .*lookup"):
        env_factory(TaskConfig(name="nope"))


def test_a_task_from_the_users_own_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_tasks.py").write_text(
        textwrap.dedent("""
        from actors.envs.base import Observation, Row, Step

        class Echo:
            inline_steps = True
            def reset(self, row, seed):
                return Observation(text=row.prompt)
            def step(self, text):
                return Step(done=True, reward=float(text == "1"), finish_reason="stop")

        def make_env(task):
            return Echo()

        def make_rows(task):
            return [Row(prompt_id=f"e{i}", prompt=f"{i}:") for i in range(3)]
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    task = TaskConfig(module="my_tasks:make_env")
    env = env_factory(task)(task)
    assert env.reset(Row(prompt_id="x", prompt="5:"), 0) == Observation(text="5:")
    assert env.step("1").reward == 1.0
    assert [r.prompt_id for r in task_rows(task)] == ["e0", "e1", "e2"]
    records = [json.loads(line) for line in write_prompts(task, tmp_path / "p.jsonl").open()]
    assert [r["prompt"] for r in records] == ["0:", "1:", "2:"]
    sys.modules.pop("my_tasks", None)


@pytest.mark.parametrize(
    ("module", "message"),
    [
        ("no_colon", "must look like"),
        ("no_such_module_xyz:make_env", "cannot import 'no_such_module_xyz'"),
        ("json:no_such_fn", "module 'json' has no 'no_such_fn'"),
    ],
)
def test_bad_task_modules_are_named(module: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        env_factory(TaskConfig(module=module))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("json", 'reward.modules.x: must look like "pkg.mod:attr"'),
        ("json:a:b", "must look like"),
        (":loads", "must look like"),
        ("no_such_module_xyz:f", "reward.modules.x: cannot import 'no_such_module_xyz'"),
        ("json:nope", "reward.modules.x: module 'json' has no 'nope'"),
        ("json:__name__", r"reward.modules.x: json:__name__ is not callable"),
    ],
)
def test_the_plugin_loader_names_the_key(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_attr(spec, what="reward.modules.x")
    assert load_attr("json:loads", what="k") is json.loads


# --- rows from files ------------------------------------------------------------------------


def test_rows_round_trip_through_the_hubs_prompt_records(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(
        '{"prompt": "2 + 3?", "answer": "5"}\n\n'
        '{"messages": [{"role": "user", "content": "hi"}], "info": {"k": 1}, "prompt_id": "m"}\n'
    )
    rows = read_rows(path)
    assert [r.prompt_id for r in rows] == ["rows-1", "m"]
    records = load_dataset(write_rows(tmp_path / "p.jsonl", rows))  # as the hub reads them
    back = [from_credit(r.prompt_id, r.prompt, r.info) for r in records]
    assert back[0].prompt == "2 + 3?" and back[0].answer == "5"
    assert back[1].messages == ({"role": "user", "content": "hi"},) and back[1].info["k"] == 1
    assert to_record(rows[1]).prompt == "hi"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"prompt": "a", "extra": 1}', "unknown key 'extra'"),
        ('{"answer": "5"}', "exactly one of prompt and messages"),
        ('{"prompt": "a", "messages": [{"role": "user", "content": "a"}]}', "exactly one"),
        ('{"prompt": ""}', "prompt must be a non-empty string"),
        ('{"messages": [{"role": "user"}]}', r"messages\[0\] must be an object"),
        ('{"prompt": "a", "info": []}', "info must be an object"),
        ('{"prompt": "a", "answer": "1", "info": {"answer": "2"}}', "info.answer would hide"),
    ],
)
def test_a_bad_row_is_reported_with_its_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n" + '{"prompt": "fine too"}\n')
    with pytest.raises(ValueError, match=rf"rows.jsonl:2: .*{message}"):
        read_rows(path)


def test_duplicate_ids_and_empty_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a", "prompt_id": "x"}\n{"prompt": "b", "prompt_id": "x"}\n')
    with pytest.raises(ValueError, match=r":2: duplicate prompt_id 'x' \(already used on line 1"):
        read_rows(path)
    path.write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        read_rows(path)
    with pytest.raises(ValueError, match="file not found"):
        read_rows(tmp_path / "missing.jsonl")


# --- tool calls -----------------------------------------------------------------------------


def test_json_calls_parse_and_malformed_ones_become_errors() -> None:
    syntax = JsonCalls()
    turn = syntax.parse(
        'Let me see. <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}'
        '</tool_call><tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"a\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call><tool_call>"
        '{"name": "x", "arguments": [1]}</tool_call> then <tool_call>{"name": "calc'
    )
    assert turn.calls[0] == ToolCall("calculator", {"expression": "2+3"})
    assert turn.calls[1] == ToolCall("lookup", {"key": "a"})
    errors = turn.calls[2:]
    assert all(isinstance(e, str) for e in errors) and turn.num_malformed == 4
    assert "not valid JSON" in errors[0] and '"name": string' in errors[1]
    assert "arguments must be an object" in errors[2] and "truncated" in errors[3]
    assert turn.answer == "Let me see.  then"
    assert syntax.parse("The answer is 5.").calls == ()


def test_compact_calls() -> None:
    syntax = CompactCalls(tool="lookup", argument="key", argument_chars="0123456789")
    assert syntax.parse("?7?x").calls == (ToolCall("lookup", {"key": "7"}),)
    assert syntax.parse("?").calls == ("malformed call: no argument",)
    assert syntax.parse("382").answer == "382"


# --- tools ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"), [("(2 + 3) * 4", "20"), ("7 / 2", "3.5"), ("-2 ** 3", "-8")]
)
def test_calculator(expression: str, value: str) -> None:
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression",
    ["__import__('os').system('true')", "x + 1", "9 ** 999", "1 / 0", "(1).real", "'a' * 3"],
)
def test_calculator_runs_no_code_and_refuses_with_a_reason(expression: str) -> None:
    result = Toolbox(["calculator"]).call(
        ToolCall("calculator", {"expression": expression}), Row(prompt_id="p", prompt="x")
    )
    assert not result.ok and result.text


def test_toolbox_checks_arguments_against_the_schema() -> None:
    box, row = Toolbox(["calculator", "lookup"]), Row(prompt_id="p", info={"table": {"a": "1"}})
    assert box.call(ToolCall("lookup", {"key": "a"}), row).text == "1"
    bad = [
        (ToolCall("nope", {}), "unknown tool 'nope'"),
        (ToolCall("lookup", {}), "missing argument 'key'"),
        (ToolCall("lookup", {"key": "a", "x": 1}), "unknown argument 'x'"),
        (ToolCall("lookup", {"key": 3}), "must be a string"),
        (ToolCall("lookup", {"key": "b"}), "no key 'b'"),
    ]
    for call, reason in bad:
        result = box.call(call, row)
        assert not result.ok and reason in result.text
    schema = box.schemas()[1]["function"]
    assert schema["name"] == "lookup" and schema["parameters"]["required"] == ["key"]
    with pytest.raises(ValueError, match="task.tools: unknown tool 'nope'"):
        Toolbox(["nope"])


def test_a_users_tool_is_registered_with_its_schema() -> None:
    @tool("reverse_text", "Reverse a string.", {"text": {"type": "string"}})
    def reverse_text(text: str) -> str:
        return text[::-1]

    try:
        result = Toolbox(["reverse_text"]).call(
            ToolCall("reverse_text", {"text": "abc"}), Row(prompt_id="p")
        )
        assert result.ok and result.text == "cba"
        with pytest.raises(ValueError, match="registered already"):
            tool("reverse_text", "again", {})(reverse_text)
    finally:
        TOOLS.pop("reverse_text")


# --- the tool environment -------------------------------------------------------------------


def test_tool_env_multi_turn_budget_and_tool_error() -> None:
    task = TaskConfig(name="tools", tools=("calculator",), max_tool_calls=2, max_tool_errors=2)
    env = make_tools_env(task)
    row = Row(prompt_id="p", prompt="What is 6*7?", answer="42")
    first = env.reset(row, seed=0)
    assert first.messages == ({"role": "user", "content": "What is 6*7?"},)
    assert first.tools[0]["function"]["name"] == "calculator"
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    step = env.step(call)
    assert not step.done and step.observation is not None
    assert step.observation.messages == ({"role": "tool", "content": "42"},)
    assert step.info["tool_calls"] == 1 and step.info["tool_errors"] == 0
    final = env.step("It is 42.")
    assert final.done and final.finish_reason == "stop" and final.reward == 1.0
    env.reset(row, seed=0)
    env.step(call + call)  # the budget: two calls
    over = env.step(call + "<tool_call>{oops</tool_call>")
    assert over.done and over.finish_reason == "tool_error"
    assert over.info["tool_errors"] == 2 and over.info["malformed_calls"] == 1
    assert over.reward == 0.0


def test_lookup_rewards_need_the_tools_answer() -> None:
    task = TaskConfig(name="lookup", num_digits=3, num_prompts=5)
    rows = make_rows(task)
    assert rows == make_rows(task)  # seeded
    row = rows[0]
    key, value = row.info["key"], row.answer
    env = make_lookup_env(task)
    assert env.reset(row, seed=0) == Observation(text=f"{key}:")
    step = env.step(f"?{key}")
    assert step.observation == Observation(text=f"={value}=")
    done = env.step(value)
    assert done.done and done.reward == pytest.approx(1.0)
    guess, _ = lookup_reward(row, value, [])  # right without looking: no call credits
    assert guess == pytest.approx(0.8)
    assert lookup_reward(row, value + "?" + value, [])[0] == pytest.approx(0.8)  # leading digits
    assert lookup_reward(row, value + value, [])[0] == pytest.approx(0.4)  # padding never pays
    wrong_key = next(k for k in row.info["table"] if k != key)
    env.reset(row, seed=0)
    env.step(f"?{wrong_key}")
    miss = "".join(str((int(c) + 1) % 10) for c in value)
    assert env.step(miss).reward == pytest.approx(0.1)  # called, wrong key, no digit right


# --- chat templates -------------------------------------------------------------------------


def test_a_template_that_rewrites_past_turns_is_refused() -> None:
    tok = build_tokenizer("<>|SUAT")
    tok.chat_template = (  # numbers its messages from the end: adding one changes the others
        "{% for m in messages %}{{ (messages|length - loop.index) }}{{ m['content'] }}"
        "{{ eos_token }}{% endfor %}"
    )
    with pytest.raises(ValueError, match="cannot be rendered turn by turn"):
        ChatTokens(tok).next(Observation(messages=({"role": "tool", "content": "1"},)))


def test_the_learner_logs_how_episodes_went() -> None:
    import numpy as np

    from asyncrl.protocol.messages import Group, Trajectory
    from learner.loop import episode_metrics

    def traj(reason: str, turns: int, failed: str = "") -> Trajectory:
        return Trajectory(
            tokens=np.arange(6, dtype=np.int32),
            prompt_len=2,
            loss_mask=np.ones(4, np.uint8),
            behavior_logprobs=np.zeros(4, np.float32),
            reward=0.0,
            min_policy_version=0,
            max_policy_version=0,
            finish_reason=reason,
            reward_failed=failed,
            num_turns=turns,
            tool_s=0.5,
            env_s=1.0,
        )

    group = Group.build(
        group_id="g",
        prompt_id="p",
        credit_id="c",
        actor_id="a",
        seq=0,
        trajectories=[
            traj("stop", 3),
            traj("tool_error", 2, "bad"),
            traj("stop", 1),
            traj("turn_limit", 4),
        ],
        metadata={"tool_calls": 6, "malformed_calls": 2},
    )
    out = episode_metrics([group])
    assert out["finish/stop"] == 0.5 and out["finish/tool_error"] == 0.25
    assert out["reward_failed_frac"] == 0.25 and out["turns_mean"] == 2.5
    assert out["tool_calls_per_episode"] == 1.5 and out["malformed_calls_per_episode"] == 0.5
    assert out["tool_errors_per_episode"] == 0.0 and out["tool_s_mean"] == 0.5
