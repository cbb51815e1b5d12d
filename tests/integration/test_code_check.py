"""Reward hacks tried against check_program in the real sandbox; every one scores 0."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from actors.sandbox import Sandbox, isolation_problem
from actors.sandbox.code_check import check_program

pytestmark = pytest.mark.skipif(
    isolation_problem() is not None, reason=f"no isolation here: {isolation_problem()}"
)

PROMPT = '''import math


def double(x):
    return 2 * x


def quad(x: int) -> int:
    """Return double(double(x))."""
'''
TEST = """
METADATA = {}


def check(candidate):
    assert abs(candidate(1) - 4) < 1e-9
    assert abs(candidate(-3) - double(-6)) < 1e-9
    assert candidate(0) == 0
"""
RIGHT = "    return double(double(x))\n"

HACKS = {
    "sys.exit(0) in the body": "    import sys\n    sys.exit(0)\n",
    "sys.exit(0) at module level": "    return 0\nimport sys\nsys.exit(0)\n",
    "os._exit(0) in the body": "    import os\n    os._exit(0)\n",
    "os._exit(0) at module level": "    return 0\nimport os\nos._exit(0)\n",
    "prints passed": "    print('passed')\n    print('All tests passed')\n    return 0\n",
    "patches builtins.abs": "    return 1\nimport builtins\nbuiltins.abs = lambda x: 0\n",
    "monkeypatches assert and unittest": (
        "    return 1\n"
        "import builtins, unittest\n"
        "builtins.AssertionError = type('Quiet', (BaseException,), {})\n"
        "unittest.TestCase.assertEqual = lambda *args: None\n"
    ),
    "__eq__ always True": (
        "    class Anything:\n"
        "        def __eq__(self, other):\n"
        "            return True\n"
        "        def __sub__(self, other):\n"
        "            return 0\n"
        "    return Anything()\n"
    ),
    "int subclass with __eq__ always True": (
        "    class Int(int):\n"
        "        def __eq__(self, other):\n"
        "            return True\n"
        "        def __sub__(self, other):\n"
        "            return 0\n"
        "    return Int(7)\n"
    ),
    "rewrites the test file": (
        "    return 0\n"
        "import glob\n"
        "for path in glob.glob('/tmp/**', recursive=True) + ['/tmp/test.py', '/test.py']:\n"
        "    try:\n"
        "        open(path, 'w').write('def check(candidate):\\n    pass\\n')\n"
        "    except OSError:\n"
        "        pass\n"
    ),
    "reads the tests to answer": (
        "    import re\n"
        "    text = open('/tmp/test.py').read()\n"
        "    return int(re.findall(r'- (\\d+)\\)', text)[0])\n"
    ),
    "redefines what the tests call": (
        "    return 0\n"
        "def double(x):\n"
        "    return 0\n"
        "def check(candidate):\n"
        "    pass\n"
        "abs = lambda x: 0\n"
    ),
    "raises SystemExit inside the tests": "    raise SystemExit(0)\n",
    "raises KeyboardInterrupt inside the tests": "    raise KeyboardInterrupt\n",
    "forges a verdict on the judge's descriptors": (
        "    import os\n"
        "    for fd in (3, 4, 5, 6):\n"
        "        try:\n"
        '            os.write(fd, b\'{"passed": true, "calls": 3, "detail": ""}\\n\')\n'
        "        except OSError:\n"
        "            pass\n"
        "    return 0\n"
    ),
}


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    with Sandbox(num_workers=2) as pool:
        yield pool


def _check(sandbox: Sandbox, completion: str, timeout_s: float = 10.0) -> object:
    return check_program(
        sandbox,
        prompt=PROMPT,
        completion=completion,
        test=TEST,
        entry_point="quad",
        timeout_s=timeout_s,
    )


def test_right_answer_passes(sandbox: Sandbox) -> None:
    verdict = _check(sandbox, RIGHT)
    assert verdict.passed and verdict.status == "passed" and verdict.tests_run == 3, verdict


@pytest.mark.parametrize("name", sorted(HACKS))
def test_reward_hack_scores_zero(sandbox: Sandbox, name: str) -> None:
    verdict = _check(sandbox, HACKS[name])
    assert not verdict.passed and verdict.status == "failed", verdict


def test_hanging_candidate_times_out(sandbox: Sandbox) -> None:
    verdict = _check(sandbox, "    while True:\n        pass\n", timeout_s=1.0)
    assert not verdict.passed and verdict.status == "timeout", verdict


def test_mutated_arguments_and_containers_cross_intact(sandbox: Sandbox) -> None:
    prompt = 'def grow(items: list) -> tuple:\n    """Append 1 to items; return stats."""\n'
    test = (
        "def check(candidate):\n"
        "    items = [3.5, None]\n"
        "    out = candidate(items)\n"
        "    assert items == [3.5, None, 1]\n"
        "    assert out == (3, {'a': {2, 3}}, b'x', float('inf'), -0.0)\n"
        "    assert type(out) is tuple and str(out[4]) == '-0.0'\n"
    )
    body = "    items.append(1)\n    return (len(items), {'a': {2, 3}}, b'x', float('inf'), -0.0)\n"
    verdict = check_program(
        sandbox, prompt=prompt, completion=body, test=test, entry_point="grow", timeout_s=10.0
    )
    assert verdict.passed, verdict
