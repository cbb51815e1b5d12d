"""Fixtures of the integration tests: the hub processes a test starts, ended by pid after it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hub_cases import HubProcess


@pytest.fixture
def hubs() -> Iterator[list[HubProcess]]:
    """Append every `HubProcess` the test starts; each is ended after the test."""
    started: list[HubProcess] = []
    yield started
    for hub in started:
        hub.kill()
