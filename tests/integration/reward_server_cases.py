"""Helpers of the reward server tests (test_reward_server.py, test_reward_server_lifecycle.py):
`asyncrl reward-server` as a process ended by pid, its settings, and a request header to edit."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack

from asyncrl.protocol.codec import encode
from asyncrl.protocol.messages import ScoreRequest

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 60.0
PROMPTS = ["3141:", "9870:", "12:", "55555555:", "0:"]
COMPLETIONS = ["1134<eos>", "0789<eos>", "21", "55555555<eos>", ""]


class ServerProcess:
    """`asyncrl reward-server` in a subprocess; its endpoint is read from its endpoint file."""

    def __init__(self, tmp: Path, model_dir: Path, *options: str, bind: str = "") -> None:
        self.endpoint_file = tmp / f"endpoint-{time.monotonic_ns()}"
        self.stats_file = tmp / f"stats-{time.monotonic_ns()}.json"
        cmd = [
            sys.executable,
            "-m",
            "asyncrl",
            "reward-server",
            "--model",
            str(model_dir),
            "--endpoint-file",
            str(self.endpoint_file),
            "--stats-file",
            str(self.stats_file),
            "--log-level",
            "WARNING",
            *options,
        ]
        if bind:
            cmd += ["--bind", bind]
        self.log_path = tmp / "reward-server.log"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + WAIT_S
        while not self.endpoint_file.exists():
            assert self.proc.poll() is None, f"server exited: {self.log_path.read_text()}"
            assert time.monotonic() < deadline, "the reward server did not start"
            time.sleep(0.05)
        self.endpoint = self.endpoint_file.read_text().strip()

    def stop(self) -> dict[str, Any]:
        """SIGTERM, by pid; the counters it wrote at exit."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=WAIT_S) == 0
        return json.loads(self.stats_file.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def sets(**values: object) -> list[str]:
    out = []
    for key, value in values.items():
        out += ["--set", f"reward_model.{key}={json.dumps(value)}"]
    return out


def request_header(**changes: Any) -> list[bytes]:
    msg = ScoreRequest(request_id=77, prompts=["12:"], completions=["12"])
    header = msgpack.unpackb(encode(msg)[0])
    header.update(changes)
    return [msgpack.packb(header)]
