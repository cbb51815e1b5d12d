"""Unit-test verification of generated code, with results that the candidate cannot forge.

```
 candidate jail (uid u, own pid ns)            judge jail (uid u+1, own pid ns)
   exec(prompt + completion)                     exec(trusted prompt + test)  (never runs
   serve entry_point(*args) <--fd3-- args ----   candidate = proxy            candidate code)
                             --fd4-- result -->  check(candidate)
   (plain data only: None/bool/int/float/str/    verdict + nonce --fd5--> worker --> host
    bytes/list/tuple/dict/set, exact types)
```

The candidate's stdout, exit code and anything it does to its own interpreter (exit early,
patch builtins, monkeypatch `assert`, return an object whose `__eq__` is always True, raise
`SystemExit` when called) cannot reach the verdict: the tests run in a second, fresh process
that decodes results into plain builtin values, and the verdict travels over a descriptor the
candidate never holds, tagged with a per-run nonce. Reward is 1 only when `check` returns
normally after at least one call.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import asdict, dataclass
from typing import Any, Literal

from actors.sandbox.pool import Sandbox, SandboxLimits

VerdictStatus = Literal["passed", "failed", "timeout", "verifier_error"]

CODEC = r"""
import json, math

def encode(x, depth=0):
    if depth > 100:
        raise ValueError("value nested too deeply")
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:
        return {"i": str(x)}
    if t is float:
        return {"f": x.hex()}
    if t is bytes:
        return {"b": x.hex()}
    if t in (list, tuple, set, frozenset):
        tag = {list: "l", tuple: "t", set: "s", frozenset: "z"}[t]
        return {tag: [encode(v, depth + 1) for v in x]}
    if t is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in x.items()]}
    raise TypeError("result of type %s is not plain data" % t.__name__)

def decode(x):
    if x is None or type(x) in (bool, str):
        return x
    if type(x) is not dict or len(x) != 1:
        raise ValueError("malformed value")
    (tag, v), = x.items()
    if tag == "i" and type(v) is str:
        return int(v)
    if tag == "f" and type(v) is str:
        return float.fromhex(v)
    if tag == "b" and type(v) is str:
        return bytes.fromhex(v)
    if type(v) is not list:
        raise ValueError("malformed value")
    if tag == "d":
        return {decode(k): decode(w) for k, w in v}
    items = [decode(w) for w in v]
    kinds = {"l": list, "t": tuple, "s": set, "z": frozenset}
    if tag not in kinds:
        raise ValueError("malformed value")
    return kinds[tag](items)
"""

CANDIDATE = (
    CODEC
    + r"""
import os
namespace = {"__name__": "candidate"}
exec(compile(open("/tmp/candidate.py").read(), "candidate.py", "exec"), namespace)
function = namespace[ENTRY_POINT]
calls, replies = os.fdopen(3, "rb"), os.fdopen(4, "wb")
for line in calls:
    args = decode(json.loads(line))
    try:
        reply = {"ok": encode(function(*args)), "args": encode(args)}
    except BaseException as exc:
        reply = {"raise": type(exc).__name__, "msg": str(exc)[:300]}
    replies.write(json.dumps(reply).encode() + b"\n")
    replies.flush()
"""
)

JUDGE = (
    CODEC
    + r"""
import builtins, os
calls, replies, verdict = os.fdopen(4, "wb"), os.fdopen(3, "rb"), os.fdopen(5, "w")
state = {"calls": 0}

class CandidateFailed(Exception):
    pass

def write_back(sent, returned):
    for old, new in zip(sent, returned):
        if type(old) is list and type(new) is list:
            old[:] = new
        elif type(old) is dict and type(new) is dict:
            old.clear()
            old.update(new)

def candidate(*args):
    state["calls"] += 1
    calls.write(json.dumps(encode(list(args))).encode() + b"\n")
    calls.flush()
    line = replies.readline()
    if not line:
        raise CandidateFailed("the candidate process ended")
    reply = json.loads(line)
    if "raise" in reply:
        kind = getattr(builtins, str(reply["raise"]), None)
        if isinstance(kind, type) and issubclass(kind, Exception):
            raise kind(reply.get("msg", ""))
        raise CandidateFailed("candidate raised " + str(reply["raise"]))
    write_back(args, decode(reply["args"]))
    return decode(reply["ok"])

outcome = {"nonce": NONCE, "passed": False, "detail": ""}
try:
    scope = {"__name__": "judge"}
    exec(compile(open("/tmp/prompt.py").read(), "prompt.py", "exec"), scope)
    scope[ENTRY_POINT] = candidate
    exec(compile(open("/tmp/test.py").read(), "test.py", "exec"), scope)
    scope["check"](candidate)
    outcome["passed"] = state["calls"] > 0
    outcome["detail"] = "" if outcome["passed"] else "the tests never called the candidate"
except BaseException as exc:
    outcome["detail"] = (type(exc).__name__ + ": " + str(exc))[:500]
outcome["calls"] = state["calls"]
verdict.write(json.dumps(outcome))
verdict.flush()
os._exit(0)
"""
)


@dataclass(frozen=True, kw_only=True)
class CodeVerdict:
    """The outcome of running a problem's tests against one completion."""

    passed: bool
    """True only when every test passed (the reward is 1.0 exactly then)."""
    status: VerdictStatus
    """passed / failed / timeout / verifier_error (the check itself could not be made)."""
    detail: str
    """Why it failed: the first failing assertion or exception, or the verifier's problem."""
    tests_run: int
    """Calls the tests made to the candidate function."""
    candidate_status: str = ""
    """Sandbox status of the candidate's process (ok, error, timeout, memory, ...)."""

    def to_json(self) -> dict[str, Any]:
        """Plain dict for JSON output."""
        return asdict(self)


def check_program(
    sandbox: Sandbox,
    *,
    prompt: str,
    completion: str,
    test: str,
    entry_point: str,
    timeout_s: float,
) -> CodeVerdict:
    """Run `test`'s `check(candidate)` against `prompt + completion`'s `entry_point`."""
    if not entry_point.isidentifier():
        raise ValueError(f"entry_point: not a Python name: {entry_point!r}")
    nonce = secrets.token_hex(16)
    limits = SandboxLimits(timeout_s=timeout_s, cpu_s=timeout_s)
    head = f"ENTRY_POINT = {entry_point!r}\n"
    cand_files = {"candidate.py": prompt + completion}
    judge_files = {"prompt.py": prompt, "test.py": test}
    cand, judge, raw = sandbox.run_linked(
        {"code": head + CANDIDATE, "files": cand_files},
        {"code": head + f"NONCE = {nonce!r}\n" + JUDGE, "files": judge_files},
        limits,
    )
    verdict = _parse_verdict(raw, nonce)
    if verdict is None:
        if "timeout" in (judge.status, cand.status):
            return _verdict("timeout", f"no verdict within {timeout_s} s", 0, cand.status)
        detail = f"judge process ended without a verdict ({judge.status}): {judge.stderr[-300:]}"
        return _verdict("verifier_error", detail, 0, cand.status)
    status = "passed" if verdict["passed"] else "failed"
    if status == "failed" and cand.status == "timeout":
        status = "timeout"
    return _verdict(status, str(verdict["detail"]), int(verdict["calls"]), cand.status)


def _parse_verdict(raw: str, nonce: str) -> dict | None:
    try:
        verdict = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(verdict, dict) or verdict.get("nonce") != nonce:
        return None
    return verdict


def _verdict(status: VerdictStatus, detail: str, calls: int, cand_status: str) -> CodeVerdict:
    return CodeVerdict(
        passed=status == "passed",
        status=status,
        detail=detail,
        tests_run=calls,
        candidate_status=cand_status,
    )
