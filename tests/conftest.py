"""Shared test fixtures: the real tiny model, and the loud skip of GPU-only tests on CPU boxes.

`tiny_model_dir` builds the embedded tiny Llama (from `ModelConfig()` defaults) once per test
session into a temporary directory, so tests never touch the user's model cache. Tests marked
`gpu` are skipped, with the reason printed in the summary, when no CUDA device or no cupy is
present.

A pytest started as a background job of a script inherits SIGINT ignored, and so would every
process it starts (Python keeps an inherited SIG_IGN, and so does `asyncrl run`): the tests that
stop a process with SIGINT, as Ctrl-C does, would then wait on a process that never hears it.
`pytest_configure` gives this process, and through it every child, SIGINT as a terminal's
foreground job has it.
"""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path

import pytest

from asyncrl.config import ModelConfig, TaskConfig


def pytest_configure(config: pytest.Config) -> None:
    """SIGINT raises KeyboardInterrupt here, and children start with it at its default."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of the tiny model (HF layout: config, safetensors, tokenizer)."""
    from asyncrl.models.tiny import ensure_model

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
