"""Shared test fixtures: the real tiny model, and the loud skip of GPU-only tests on CPU boxes.

`tiny_model_dir` builds the embedded tiny Llama (from `ModelConfig()` defaults) once per test
session into a temporary directory, so tests never touch the user's model cache. Tests marked
`gpu` are skipped, with the reason printed in the summary, when no CUDA device or no cupy is
present.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from asyncrl.config import ModelConfig, TaskConfig


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of the tiny model (HF layout: config, safetensors, tokenizer)."""
    from asyncrl.tiny_model import ensure_model

    cache = tmp_path_factory.mktemp("models")
    return ensure_model(ModelConfig(cache_dir=str(cache)), TaskConfig())


def _gpu_missing_reason() -> str:
    """Why GPU tests cannot run here, or "" when they can."""
    if importlib.util.find_spec("cupy") is None:
        return "gpu test skipped: cupy is not installed (pip install '.[gpu]')"
    import torch

    if not torch.cuda.is_available():
        return "gpu test skipped: torch.cuda.is_available() is False (no CUDA device)"
    return ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu`-marked tests, loudly, where no GPU stack is present."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _gpu_missing_reason()
    if not reason:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"WARNING: {len(gpu_items)} {reason}", yellow=True, bold=True)
