"""The learner on GPUs: FSDP2 over nccl matches one GPU, bf16 trains, and the sharded export
loads in a CUDA vLLM engine. Skipped, with the reason printed, where no GPU stack is present.

The CPU versions of these checks run in tests/integration/test_learner_world.py; these run the
same worker (world_worker.py) with one GPU per rank (`learner.device = auto` picks
cuda:LOCAL_RANK and `learner/parallel.py` picks nccl when CUDA is present).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from integration.test_learner_world import exported, max_diff, run_world
from safetensors.torch import load_file

pytestmark = pytest.mark.gpu


def _need_gpus(n: int) -> None:
    found = torch.cuda.device_count()
    if found < n:
        pytest.skip(f"gpu test skipped: needs {n} GPUs (one per rank), found {found}")


def test_fsdp2_over_nccl_matches_one_gpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    _need_gpus(2)
    run_world(1, tiny_model_dir, tmp_path / "w1", 2)
    run_world(2, tiny_model_dir, tmp_path / "w2", 2)
    initial = load_file(tiny_model_dir / "model.safetensors")
    one, two = exported(tmp_path / "w1"), exported(tmp_path / "w2")
    assert max_diff(one, initial) > 1e-3
    assert max_diff(one, two) < 1e-4  # GPU kernels reduce in other orders than the CPU's


def test_bf16_end_to_end_on_two_gpus(tiny_model_dir: Path, tmp_path: Path) -> None:
    _need_gpus(2)
    run_world(2, tiny_model_dir, tmp_path / "bf16", 2, "model.dtype=bfloat16")
    weights = exported(tmp_path / "bf16")
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert all(bool(torch.isfinite(t.float()).all()) for t in weights.values())


def test_cuda_vllm_serves_the_sharded_export(tiny_model_dir: Path, tmp_path: Path) -> None:
    _need_gpus(2)
    vllm = pytest.importorskip("vllm", reason="gpu test skipped: vLLM is not installed")
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        pytest.skip(f"gpu test skipped: this vLLM build is for {current_platform.device_type}")
    del vllm
    from actors.engines.base import GenerationRequest
    from actors.engines.vllm_engine import VllmEngine

    run_world(2, tiny_model_dir, tmp_path / "w2", 2)
    latest = (tmp_path / "w2" / "checkpoints" / "latest").read_text().strip()
    ckpt = tmp_path / "w2" / "checkpoints" / latest
    engine = VllmEngine(ckpt, gpu_memory_utilization=0.2, seed=0)
    try:
        request = GenerationRequest(prompt_tokens=[1, 5, 9, 7], n=2, max_new_tokens=4, seed=1)
        samples = engine.generate([request])[0]
        weights = exported(tmp_path / "w2")
        engine.load_weights(((n, t.cuda()) for n, t in weights.items()), policy_version=3)
        again = engine.generate([request])[0]
    finally:
        engine.close()
    for a, b in zip(samples, again, strict=True):
        assert a.completion_tokens.tolist() == b.completion_tokens.tolist()
        assert float(abs(a.logprobs - b.logprobs).max()) < 1e-2
