"""`asyncrl eval CHECKPOINT`: evaluate a saved checkpoint offline, exactly as a run's actors do.

    asyncrl eval runs/tiny_cpu/checkpoints/step_00001500 [--task sort] [--samples 4]
                 [--temperature 0] [--num-prompts 32] [--config C] [--set k=v] [--out FILE]

```
  checkpoint dir (HF layout + state.json) ──> engine (actor.engine) at the checkpoint's version
  run dir's prompts.jsonl ──held_out_split (the hub's rule)──> held-out prompts ──EvalRequest
  actors/evaluation.py evaluate() ──EvalResult──> asyncrl/evaluation.py summarize ──> eval.jsonl
```

The held-out prompts, seeds, sampling and scoring are the ones the hub and actor use during a
run, so a checkpoint evaluated here reproduces the run's evaluation at that version (greedy
decoding: the same completions). The config is the run's (`config.toml` next to
`checkpoints/`) unless `--config` is given; `--task`, `--samples`, `--temperature`,
`--num-prompts` override `[task]`/`[eval]`. The record (with `source: offline` and the checkpoint
path) is printed as JSON and appended to the run's eval.jsonl (or `--out`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.config import RunConfig, load_config
from asyncrl.evaluation import EvalLog, summarize
from asyncrl.protocol.messages import EvalRequest


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl eval", description="Evaluate a saved checkpoint.")
    p.add_argument("checkpoint", help="checkpoint directory (HF layout with state.json)")
    p.add_argument("--config", default="", help="run config (default: the run's config.toml)")
    p.add_argument("--task", default="", help="task name (overrides task.name)")
    p.add_argument("--samples", type=int, default=0, help="samples per prompt (eval.num_samples)")
    p.add_argument("--temperature", type=float, default=-1.0, help="0 = greedy (eval.temperature)")
    p.add_argument("--num-prompts", type=int, default=0, help="held-out prompts (eval.num_prompts)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    p.add_argument("--out", default="", help="eval.jsonl to append to (default: the run's)")
    return p.parse_args(list(argv))


def resolve(args: argparse.Namespace) -> tuple[RunConfig, Path, Path]:
    """(config, checkpoint dir, run dir) from the command line."""
    ckpt = Path(args.checkpoint)
    if not (ckpt / "config.json").is_file():
        raise ValueError(f"{ckpt}: not a checkpoint directory (no config.json)")
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    config = Path(args.config) if args.config else run_dir / "config.toml"
    overrides = list(args.set)
    for key, value in (
        ("task.name", args.task),
        ("eval.num_samples", args.samples),
        ("eval.num_prompts", args.num_prompts),
    ):
        if value:
            overrides.append(f"{key}={json.dumps(value)}")
    if args.temperature >= 0:
        overrides.append(f"eval.temperature={args.temperature}")
    cfg = load_config(config if config.is_file() else None, overrides)
    return cfg, ckpt, run_dir


def held_out_request(cfg: RunConfig, run_dir: Path, policy_version: int) -> EvalRequest:
    """The hub's evaluation request for this run's held-out prompts."""
    from actors.envs.registry import write_prompts
    from replay.evals import eval_items, held_out_split
    from replay.prompts import load_dataset

    dataset = Path(cfg.task.dataset) if cfg.task.dataset else run_dir / "prompts.jsonl"
    if not dataset.is_file() or cfg.task.name != _run_task(run_dir):  # another task's prompts
        dataset = write_prompts(cfg.task, Path(tempfile.mkdtemp()) / "prompts.jsonl")
    if cfg.eval.every_versions == 0:
        print(
            "asyncrl eval: this run did not evaluate (eval.every_versions = 0), so its "
            "held-out prompts were also trained on",
            file=sys.stderr,
        )
    ev = dataclasses.replace(cfg.eval, every_versions=max(1, cfg.eval.every_versions))
    _, held = held_out_split(load_dataset(dataset), ev)
    return EvalRequest(
        eval_id=0,
        policy_version=policy_version,
        items=eval_items(held, ev.seed),
        num_samples=ev.num_samples,
        temperature=ev.temperature,
        max_new_tokens=ev.max_new_tokens or cfg.actor.max_new_tokens,
        pass_threshold=ev.pass_threshold,
    )


def _run_task(run_dir: Path) -> str:
    """The task name the run in `run_dir` trained on ("" when unknown)."""
    config = run_dir / "config.toml"
    if not config.is_file():
        return ""
    return load_config(config).task.name


def evaluate_checkpoint(cfg: RunConfig, ckpt: Path, run_dir: Path) -> dict[str, Any]:
    """Generate and score the held-out prompts with the checkpoint's weights."""
    from transformers import AutoTokenizer

    from actors.actor_main import build_engine
    from actors.envs.registry import env_factory
    from actors.episodes import EpisodeLimits
    from actors.evaluation import evaluate

    state = json.loads((ckpt / "state.json").read_text()) if (ckpt / "state.json").is_file() else {}
    policy_version = int(state.get("policy_version", -1))
    make_env = env_factory(cfg.task)  # an unknown task fails before the engine loads
    request = held_out_request(cfg, run_dir, policy_version)
    engine = build_engine(cfg, ckpt, seed=cfg.eval.seed)
    try:
        tokenizer = AutoTokenizer.from_pretrained(ckpt)
        result = evaluate(
            engine,
            tokenizer,
            lambda: make_env(cfg.task),
            request,
            "offline",
            EpisodeLimits.from_config(cfg),
            cfg.actor.env_workers,
        )
    finally:
        engine.close()
    result = dataclasses.replace(result, policy_version=policy_version)
    return summarize(result)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    cfg, ckpt, run_dir = resolve(args)
    record = evaluate_checkpoint(cfg, ckpt, run_dir)
    out = Path(args.out) if args.out else run_dir / "eval.jsonl"
    log = EvalLog(out.parent, out.name)
    row = log.write(record, source="offline", checkpoint=str(ckpt), task=cfg.task.name)
    log.close()
    print(json.dumps(row, indent=1))
    return 0
