"""The sort task's dataset: deterministic, well-formed, and read by the hub as written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.envs.sort_task import (
    answer_for,
    make_prompts,
    parse_completion,
    render_prompt,
    write_dataset,
)
from asyncrl.config import TaskConfig
from asyncrl.models.tiny import ALPHABET
from asyncrl.prompt_records import Prompt
from replay.prompts import load_dataset


def test_prompts_are_deterministic_in_the_seed() -> None:
    task = TaskConfig(num_prompts=50, seed=7)
    assert make_prompts(task) == make_prompts(task)
    assert make_prompts(task) != make_prompts(TaskConfig(num_prompts=50, seed=8))


def test_rows_are_well_formed() -> None:
    task = TaskConfig(num_prompts=200, num_digits=5)
    rows = make_prompts(task)
    assert len(rows) == 200
    assert len({row["prompt_id"] for row in rows}) == 200
    for row in rows:
        digits = row["info"]["digits"]
        assert len(digits) == 5 and digits.isdigit()
        assert row["prompt"] == render_prompt(digits) == digits + ":"
        assert row["info"]["answer"] == "".join(sorted(digits))
        assert set(row["prompt"]) <= set(ALPHABET)


def test_write_dataset_round_trips_as_jsonl(tmp_path: Path) -> None:
    task = TaskConfig(num_prompts=20)
    path = write_dataset(tmp_path / "sub" / "prompts.jsonl", task)
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == make_prompts(task)
    assert load_dataset(path) == [Prompt(**row) for row in make_prompts(task)]  # as the hub


def test_the_hub_rejects_rows_without_prompt(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_id": "a", "prompt": "12:"}\n{"prompt_id": "b"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: prompt must be a string"):
        load_dataset(path)


def test_the_hub_defaults_info(tmp_path: Path) -> None:
    path = tmp_path / "ok.jsonl"
    path.write_text('{"prompt_id": "a", "prompt": "12:"}\n\n')
    assert load_dataset(path) == [Prompt("a", "12:", {})]


@pytest.mark.parametrize(
    ("completion", "parsed"),
    [
        ("1134<eos>", "1134"),
        ("1134<eos>999", "1134"),
        (" 12 <eos>", "12"),
        ("1134", "1134"),
        ("<eos>", ""),
        ("1:3<unk>", "1:3<unk>"),
    ],
)
def test_parse_completion(completion: str, parsed: str) -> None:
    assert parse_completion(completion) == parsed


def test_render_prompt_rejects_non_digits() -> None:
    with pytest.raises(ValueError, match="digits"):
        render_prompt("12a")
    assert answer_for("3141") == "1134"
