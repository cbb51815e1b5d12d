"""One learner rank training on fixed batches, for tests/integration/test_learner_world.py.

    python world_worker.py MODEL_DIR RUN_DIR STEPS [KEY=VALUE ...]

Run with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set for a sharded learner. Rank 0 trains on
`STEPS` batches of `make_batch` (the other ranks follow it through learner/parallel.py's
commands, as under `asyncrl learner`), then checkpoints (sharded state + HF export) and stops
the others. With `--resume` in the arguments the ranks first resume from RUN_DIR.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import NoReturn

import numpy as np

from asyncrl.config import RunConfig, load_config
from asyncrl.protocol.messages import Batch, Group, Trajectory
from learner.loop import Learner
from learner.parallel import Op, init_world, leave_world, ranks_from_env, send_command


def exit_rank(code: int) -> NoReturn:
    """End this rank's process after `leave_world`, skipping the interpreter's teardown: gloo's
    C++ state could still abort a rank that finished cleanly while its peer tears down at the
    same moment ("terminate called without an active exception"), failing the run by a signal
    after everything was checked and written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def make_group(rng: np.random.Generator, group_id: str, size: int) -> Group:
    """A group of `size` samples continuing one random prompt, with random rewards."""
    trajs = []
    prompt = rng.integers(4, 16, size=4).astype(np.int32)
    for _ in range(size):
        clen = int(rng.integers(2, 7))
        tokens = np.concatenate([prompt, rng.integers(4, 16, size=clen).astype(np.int32)])
        trajs.append(
            Trajectory(
                tokens=tokens,
                prompt_len=4,
                loss_mask=np.ones(clen, np.uint8),
                behavior_logprobs=np.log(rng.uniform(0.03, 0.2, clen)).astype(np.float32),
                reward=float(rng.random()),
                min_policy_version=0,
                max_policy_version=0,
                finish_reason="stop",
            )
        )
    return Group.build(
        group_id=group_id, prompt_id=group_id, credit_id=0, actor_id="a", seq=0, trajectories=trajs
    )


def make_batch(step: int, num_groups: int = 5, size: int = 6) -> Batch:
    """Batch `step` of a fixed sequence (groups of different lengths, 5 groups: uneven shares)."""
    rng = np.random.default_rng(100 + step)
    groups = tuple(make_group(rng, f"g{step}-{i}", size) for i in range(num_groups))
    return Batch(request_id=step + 1, policy_version=step, groups=groups, dropped_stale=0)


def config(model_dir: str, run_dir: str, overrides: list[str]) -> RunConfig:
    return load_config(
        None,
        [
            f"model.path={json.dumps(model_dir)}",
            f"run.run_dir={json.dumps(run_dir)}",
            "learner.groups_per_step=5",
            "learner.micro_batch_samples=4",
            "learner.lr=0.001",
            "learner.grad_clip=0.5",
            "loss.name=decoupled_ppo",
            "actor.temperature=1.0",
            *overrides,
        ],
    )


def main(argv: list[str]) -> int:
    model_dir, run_dir, steps, *rest = argv
    resume = "--resume" in rest
    overrides = [a for a in rest if a != "--resume"]
    ranks = ranks_from_env()
    cfg = config(model_dir, run_dir, [*overrides, f"learner.world={ranks.world}"])
    init_world(ranks, 600.0)
    learner = Learner(cfg, Path(run_dir), None, Path(model_dir), ranks)
    if resume:
        learner.resume()
    if not ranks.is_leader:
        learner.follow()
        leave_world(clean=True)
        exit_rank(0)
    first = learner.step
    for step in range(first, first + int(steps)):
        learner.optimize(make_batch(step))
        learner.step += 1
        learner.policy_version += 1
    learner.checkpoint()
    if ranks.distributed:
        send_command(Op.STOP)
    assert learner.publisher is not None
    learner.publisher.close()
    leave_world(clean=True)
    if ranks.distributed:
        exit_rank(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
