"""The learner's optimizer step with and without the shared prompt, side by side in one run.

    python bench/learner_step.py [--config configs/tiny_cpu.toml] [--prompt-lens 6,32,96]
                                 [--steps 30] [--repeats 5]

Builds two real `Learner`s from the config (same initial weights; `learner.share_prompt` off
and on; the hub connection is never started) and times `Learner.optimize` — collate, scoring,
loss, backward, AdamW — on the same batches, alternating the two every repetition. A batch is
`learner.groups_per_step` groups of `actor.group_size` samples: each group one random prompt
of the given length, completions of 1..`actor.max_new_tokens` tokens. Threads: torch uses
`run.learner_threads` (as `asyncrl run` gives the learner). Writes
`bench/results/learner_step.json`: per prompt length the median step time of each way and
`speedup` = plain / shared.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl.config import RunConfig, load_config
from asyncrl.models.tiny import MAX_POSITIONS, ensure_model, vocab
from asyncrl.protocol.messages import Batch, Group, Trajectory
from asyncrl.transport.connection import HubConnection
from bench.common import (
    REPO,
    RESULTS,
    command_line,
    environment,
    interleave,
    spread,
    timed,
    write_json,
)
from launch.run import thread_split
from learner.loop import Learner


def make_batch(cfg: RunConfig, prompt_len: int, rng: np.random.Generator) -> Batch:
    """groups_per_step groups as actors make them: one prompt each, completions of any length."""
    low = len(vocab()) - 10  # the ten digits: ordinary tokens, no special ones
    groups = []
    for g in range(cfg.learner.groups_per_step):
        prompt = rng.integers(low, low + 10, size=prompt_len).astype(np.int32)
        trajs = []
        for _ in range(cfg.actor.group_size):
            clen = int(rng.integers(1, cfg.actor.max_new_tokens + 1))
            completion = rng.integers(low, low + 10, size=clen).astype(np.int32)
            trajs.append(
                Trajectory(
                    tokens=np.concatenate([prompt, completion]),
                    prompt_len=prompt_len,
                    loss_mask=np.ones(clen, np.uint8),
                    behavior_logprobs=np.log(rng.uniform(0.05, 0.5, clen)).astype(np.float32),
                    reward=float(rng.random()),
                    min_policy_version=0,
                    max_policy_version=0,
                    finish_reason="stop",
                )
            )
        groups.append(
            Group.build(
                group_id=f"g{g}",
                prompt_id=f"p{g}",
                credit_id=0,
                actor_id="bench",
                seq=g,
                trajectories=trajs,
            )
        )
    return Batch(request_id=0, policy_version=0, groups=tuple(groups), dropped_stale=0, wait_s=0.0)


def make_learner(cfg: RunConfig, share: bool, model_dir: Path, work: Path) -> Learner:
    learner_cfg = dataclasses.replace(cfg.learner, share_prompt=share)
    cfg = dataclasses.replace(cfg, learner=learner_cfg)
    conn = HubConnection(
        "tcp://127.0.0.1:1", role="learner", client_id="bench", config_hash=cfg.config_hash()
    )
    return Learner(cfg, work / f"share-{share}", conn, model_dir)


def time_steps(learner: Learner, batches: list[Batch]) -> float:
    """Median seconds of `optimize` over the batches (the first one is a warm-up)."""
    todo = iter(batches)
    return timed(lambda: learner.optimize(next(todo)), reps=len(batches) - 1, warmup=1).median


def measure(cfg: RunConfig, prompt_lens: list[int], steps: int, repeats: int) -> dict[str, Any]:
    model_dir = ensure_model(cfg.model, cfg.task)
    work = Path("/tmp") / f"asyncrl-learner-step-{time.time_ns()}"
    learners = {share: make_learner(cfg, share, model_dir, work) for share in (False, True)}
    rows = []
    try:
        for prompt_len in prompt_lens:
            rng = np.random.default_rng(prompt_len)
            batches = [make_batch(cfg, prompt_len, rng) for _ in range(steps + 1)]
            ways = {
                "plain": lambda _rep, b=batches: time_steps(learners[False], b),
                "shared": lambda _rep, b=batches: time_steps(learners[True], b),
            }
            times = interleave(ways, reps=repeats, warmup=0)  # time_steps warms up itself
            plain, shared = times["plain"], times["shared"]
            speedups = [p / s for p, s in zip(plain, shared, strict=True)]
            rows.append(
                {
                    "prompt_len": prompt_len,
                    "plain_step_ms": spread([t * 1e3 for t in plain]),
                    "shared_step_ms": spread([t * 1e3 for t in shared]),
                    "speedup": statistics.median(speedups),
                    "speedup_spread": spread(speedups),
                }
            )
            print(
                f"prompt {prompt_len:3d} tokens: plain {statistics.median(plain) * 1e3:6.1f} ms, "
                f"shared {statistics.median(shared) * 1e3:6.1f} ms, "
                f"speedup {statistics.median(speedups):.2f}",
                flush=True,
            )
    finally:
        for learner in learners.values():
            learner.publisher.close()
    return {"points": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs" / "tiny_cpu.toml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--prompt-lens", default="6,32,96", help="comma-separated prompt lengths")
    p.add_argument("--steps", type=int, default=30, help="timed steps per way and repetition")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS / "learner_step.json"))
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set)
    prompt_lens = [int(x) for x in args.prompt_lens.split(",") if x]
    longest = max(prompt_lens) + cfg.actor.max_new_tokens
    if min(prompt_lens) < 1 or longest > MAX_POSITIONS:
        raise ValueError(
            f"--prompt-lens: each must be >= 1 and fit {MAX_POSITIONS} positions with "
            f"actor.max_new_tokens={cfg.actor.max_new_tokens}; got {prompt_lens}"
        )
    if args.steps < 1 or args.repeats < 1:
        raise ValueError(f"--steps and --repeats must be >= 1, got {args.steps}, {args.repeats}")
    threads, _ = thread_split(cfg)
    torch.set_num_threads(threads)
    result = {
        "command": command_line(__file__, argv),
        "environment": environment(),
        "torch_threads": threads,
        "groups_per_step": cfg.learner.groups_per_step,
        "group_size": cfg.actor.group_size,
        "max_new_tokens": cfg.actor.max_new_tokens,
        **measure(cfg, prompt_lens, args.steps, args.repeats),
    }
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
