"""The humaneval task end to end: every canonical solution scores 1, every empty body 0."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from actors.envs import humaneval
from actors.envs.base import Observation, Row
from actors.sandbox import Sandbox, isolation_problem
from asyncrl.config import TaskConfig

pytestmark = pytest.mark.skipif(
    isolation_problem() is not None, reason=f"no isolation here: {isolation_problem()}"
)


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    with Sandbox(num_workers=2) as pool:
        yield pool


def _rewards(sandbox: Sandbox, rows: list[Row], bodies: list[str]) -> dict[str, float]:
    def one(pair: tuple[Row, str]) -> tuple[str, float]:
        env = humaneval.HumanEvalEnv(sandbox)
        assert env.reset(pair[0], seed=0) == Observation(text=pair[0].prompt)
        step = env.step(pair[1])
        assert step.done and step.finish_reason == "stop" and "reward_failed" not in step.info
        return pair[0].prompt_id, step.reward

    with ThreadPoolExecutor(4) as pool:
        return dict(pool.map(one, zip(rows, bodies, strict=True)))


def test_canonical_solutions_score_one_and_empty_bodies_zero(sandbox: Sandbox) -> None:
    rows = humaneval.make_rows(TaskConfig())
    assert len(rows) == 164 and len({row.prompt_id for row in rows}) == 164
    canonical = _rewards(sandbox, rows, [row.answer for row in rows])
    assert [k for k, v in canonical.items() if v != 1.0] == []
    empty = _rewards(sandbox, rows, ["    pass\n"] * len(rows))
    assert [k for k, v in empty.items() if v != 0.0] == []


def test_completion_is_cut_at_the_next_top_level_statement() -> None:
    body = "    return 1\n\n\ndef other():\n    pass\nprint('x')\n"
    assert humaneval.truncate_completion(body) == "    return 1\n\n"


def test_score_command_uses_the_task_path(tmp_path: Path) -> None:
    problem = humaneval.load_problems()[2]
    row, completion = tmp_path / "row.json", tmp_path / "completion.txt"
    row.write_text(json.dumps(problem))
    command = [sys.executable, "-m", "asyncrl", "score", "--task", "humaneval", "--row", str(row)]
    results = {}
    for name, body in (("right", problem["canonical_solution"]), ("hack", "    exit(0)\n")):
        completion.write_text(body)
        done = subprocess.run(
            [*command, "--completion", str(completion)], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        results[name] = json.loads(done.stdout)
    assert results["right"]["reward"] == 1.0 and results["right"]["info"]["status"] == "passed"
    assert results["hack"]["reward"] == 0.0 and results["hack"]["info"]["status"] == "failed"
    assert results["right"]["info"]["task_id"] == problem["task_id"]


def test_score_command_reads_generic_rows_too(tmp_path: Path) -> None:
    row, completion = tmp_path / "row.json", tmp_path / "completion.txt"
    row.write_text(json.dumps({"prompt": "3141:", "answer": "1134"}))
    completion.write_text("1134")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl",
            "score",
            "--task",
            "sort",
            "--row",
            str(row),
            "--completion",
            str(completion),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(done.stdout)
    assert report["reward"] == 1.0 and report["info"]["pred"] == "1134"
