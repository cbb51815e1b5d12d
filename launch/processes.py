"""The child processes of `asyncrl run`: started (each in its own process group, told when its
parent dies) and ended by pid, with a log file each and run_dir/pids.json for operators."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from asyncrl.files import replace_text

PR_SET_PDEATHSIG = 1
"""prctl option (linux/prctl.h): the signal a child gets when its parent dies."""


class Processes:
    """The child processes of a run, started and ended by pid."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, args: Sequence[str], threads: int) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
        log = open(self.run_dir / f"{name}.log", "ab")  # noqa: SIM115 - lives as long as the child; a restart appends
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_detach_from_terminal(os.getpid()),
        )
        self.procs[name] = proc
        pids = {n: p.pid for n, p in self.procs.items()}
        # for operators and tests: a reader never sees it half-written
        replace_text(self.run_dir / "pids.json", json.dumps(pids))
        return proc

    def stop(self, names: Sequence[str], grace_s: float) -> None:
        """SIGTERM these children, wait up to grace_s, then SIGKILL the rest (all by pid)."""
        live = [self.procs[n] for n in names if n in self.procs and self.procs[n].poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in live:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def failed(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() not in (None, 0)]


def _detach_from_terminal(parent_pid: int) -> Callable[[], None]:
    """What a child runs before exec: its own process group, so that a terminal's Ctrl-C (SIGINT
    to the foreground group) reaches `asyncrl run` alone, which then stops the children in order
    (the learner checkpoints and publishes to live actors before the actors and the hub go);
    and SIGTERM when `asyncrl run` dies, so that no child outlives it. (The kernel sends that
    when the *thread* that started the child ends: children are started from the main thread.)
    """
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it

    def setup() -> None:
        os.setpgid(0, 0)
        if prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent_pid:  # `asyncrl run` died before prctl took effect
            os._exit(128 + signal.SIGTERM)

    return setup
