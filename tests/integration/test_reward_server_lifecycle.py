"""`asyncrl reward-server`'s lifecycle as real processes: a client that times out with no
server, retries across a server restart, CURVE auth admitting key holders only, and models,
binds and settings refused with a message naming what is wrong."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
from reward_server_cases import (
    REPO,
    WAIT_S,
    ServerProcess,
    sets,
)

from actors.rewards.rm_client import RewardModelClient, RewardModelError
from actors.rewards.rm_model import RewardModel
from asyncrl.transport.auth import keygen

# --- timeouts, restarts, auth -------------------------------------------------------------------


def test_a_client_with_no_server_times_out_after_its_retries() -> None:
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as silent:  # binds, never answers
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        client = RewardModelClient(
            f"tcp://127.0.0.1:{port}", timeout_s=0.2, retries=2, backoff_s=0.05
        )
        try:
            with pytest.raises(RewardModelError, match="attempt 3") as caught:
                client.score(["1:1"])
            assert caught.value.code == "timeout"
            assert client.stats["timeouts"] == 3 and client.stats["retries"] == 2
        finally:
            client.close()
            silent.setsockopt(zmq.LINGER, 0)


def test_the_client_retries_across_a_server_restart(tmp_path: Path, rm_dir: Path) -> None:
    first = ServerProcess(tmp_path, rm_dir, *sets(max_batch=8, max_wait_ms=60000))
    # 40 tries of 3 s: longer than the second server may take to start (60 s)
    client = RewardModelClient(first.endpoint, timeout_s=3.0, retries=40, backoff_s=0.1)
    second = None
    try:
        assert client.server_stats()["requests"] == 0
        future = client.submit(["21:"], ["12"])  # waits in the first server's queue...
        first.kill()  # ...which dies with it
        second = ServerProcess(tmp_path, rm_dir, *sets(max_wait_ms=1), bind=first.endpoint)
        result = future.result(timeout=WAIT_S)
        assert result.attempts >= 2 and len(result.scores) == 1
        assert second.stop()["samples_scored"] >= 1
    finally:
        client.close()
        first.kill()
        if second is not None:
            second.kill()


def test_auth_admits_key_holders_only(tmp_path: Path, rm_dir: Path) -> None:
    keys = keygen(tmp_path / "keys", num_clients=1)
    proc = ServerProcess(tmp_path, rm_dir, "--auth", str(keys))
    try:
        client = RewardModelClient(proc.endpoint, auth_dir=str(keys), timeout_s=WAIT_S)
        try:
            assert len(client.score(["12:12"])) == 1
        finally:
            client.close()
        stranger = RewardModelClient(proc.endpoint, timeout_s=1.0, retries=0)
        try:
            with pytest.raises(RewardModelError, match="no reply"):
                stranger.score(["12:12"])
        finally:
            stranger.close()
        stats = proc.stop()
        assert stats["requests"] == 1 and stats["samples_scored"] == 1
    finally:
        proc.kill()


def test_refuses_to_serve_a_model_with_more_than_one_output(tmp_path: Path, rm_dir: Path) -> None:
    import shutil

    two = tmp_path / "two-labels"
    shutil.copytree(rm_dir, two)
    config = json.loads((two / "config.json").read_text())
    config["id2label"] = {"0": "a", "1": "b"}
    (two / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardModel(two)


def test_an_open_non_loopback_bind_needs_auth() -> None:
    from actors.rewards.rm_server import bind_score_router
    from asyncrl.config import RewardModelConfig

    with zmq.Context() as ctx, pytest.raises(ValueError, match="reward_model.bind"):
        bind_score_router(ctx, RewardModelConfig(bind="tcp://0.0.0.0:0"), allow_insecure=False)


@pytest.mark.parametrize("key", ["max_batch", "timeout_s", "max_in_flight"])
def test_bad_config_values_name_their_key(key: str) -> None:
    from asyncrl.config import RewardModelConfig

    with pytest.raises(ValueError, match=f"reward_model.{key}"):
        RewardModelConfig(**{key: 0})


def test_the_command_names_a_bad_model_directory(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "asyncrl", "reward-server", "--model", str(tmp_path / "none")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 2
    assert "--model" in done.stderr and "not a Hugging Face model directory" in done.stderr
