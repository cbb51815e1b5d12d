"""Fixtures of the integration tests: the hub processes a test starts, ended by pid after it;
the tiny sort reward model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hub_cases import HubProcess

from actors.rewards.tiny_reward_model import ensure_reward_model


@pytest.fixture
def hubs() -> Iterator[list[HubProcess]]:
    """Append every `HubProcess` the test starts; each is ended after the test."""
    started: list[HubProcess] = []
    yield started
    for hub in started:
        hub.kill()


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny sort reward model, built once per pytest run (shared base temp dir)."""
    return ensure_reward_model(tmp_path_factory.getbasetemp() / "reward-models")
