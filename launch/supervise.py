"""Supervision of `asyncrl run`'s children: a crashed process is restarted, a bounded number of
times, with backoff, and every restart is logged; when a role cannot go on, one line says why.

```
  poll every child ──exit 0──> learner: the run is done; actor: finished, left alone
        │
        └─exit != 0 (crash, SIGKILL)──> restarts[name] < run.max_restarts ?
                 yes: start again after run.restart_backoff_s * 2^n (at most 30 s), same command
                      (hub: same --bind endpoint and state dir; learner: --resume once a
                      checkpoint exists)
                 no:  the run ends: "<name> exited with code C N times; see <log>"
```

Each role comes back with what it needs: a durable hub recovers its state from
`replay.state_dir` (replay/durability.py) on the endpoint the others keep redialling; a
restarted actor is a new session (the hub re-issues its old credits' prompts and numbers its
groups on from `Welcome.next_seq`); a restarted learner resumes from its latest checkpoint and
gets back every batch it had not acknowledged.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from launch.processes import Processes

BACKOFF_MAX_S = 30.0


class Supervisor:
    """Restarts crashed children of a `Processes` (launch/processes.py) by name."""

    def __init__(
        self,
        procs: Processes,
        commands: dict[str, Callable[[], tuple[Sequence[str], int]]],
        *,
        max_restarts: int,
        backoff_s: float,
    ) -> None:
        self.procs = procs
        self.commands = commands  # name -> () -> (asyncrl arguments, threads), asked at restart
        self.max_restarts, self.backoff_s = max_restarts, backoff_s
        self.restarts: collections.Counter[str] = collections.Counter()
        self.due: dict[str, float] = {}  # name -> when it is started again
        self.finished: set[str] = set()

    def check(self, now: float) -> str:
        """Handle exits and due restarts; returns why the run must end ("" = it goes on)."""
        for name, proc in list(self.procs.procs.items()):
            code = proc.poll()
            if code is None or name in self.due or name in self.finished:
                continue
            if code == 0:
                if name == "learner":
                    return "the learner finished"
                self.finished.add(name)
                continue
            if name not in self.commands:  # started once, not supervised (the reward server)
                return f"{name} exited with code {code}; see {self.procs.run_dir / f'{name}.log'}"
            reason = self.schedule(name, code, now)
            if reason:
                return reason
        for name, at in list(self.due.items()):
            if now >= at:
                del self.due[name]
                args, threads = self.commands[name]()
                self.procs.start(name, args, threads)
        return ""

    def schedule(self, name: str, code: int, now: float) -> str:
        """A crash: schedule a restart, or say why not."""
        n = self.restarts[name]
        log_path = Path(self.procs.run_dir) / f"{name}.log"
        if n >= self.max_restarts:
            return (
                f"{name} exited with code {code} after {n} restarts "
                f"(run.max_restarts={self.max_restarts}); see {log_path}"
            )
        delay = min(BACKOFF_MAX_S, self.backoff_s * 2**n)
        self.restarts[name] = n + 1
        self.due[name] = now + delay
        print(
            f"run: {name} exited with code {code}; restart {n + 1} of {self.max_restarts} "
            f"in {delay:.1f} s (log: {log_path})",
            flush=True,
        )
        return ""

    def summary(self) -> dict[str, int]:
        return dict(self.restarts)
