"""Minimal single-process GRPO: the floor that the full asyncrl system is measured against.

No sockets, no processes, no staleness: one loop that samples with `TorchEngine` on the very
model object it trains (weights are shared, so every batch is exactly on-policy), scores with
the task's verifier, normalises rewards within each group, and takes one AdamW step of the
token-level clipped policy-gradient loss per batch:

```
  prompts --sample groups_per_step--> TorchEngine.generate (n = group_size, shared weights)
     ^                                        |
     |                           verifier -> rewards -> group-normalised advantages
     |                                        v
     +------------ AdamW step <-- clipped PG loss (token mean) over prompt + completion
```

`run_minimal(config, max_wall_s, max_steps)` returns one dict per step (`step`, `time_s` since
the loop started, `reward_mean`, `samples`, `tokens`); bench/overhead.py imports it to compare
the full system against this floor. Run as a script it trains on configs/tiny_cpu.toml for a few
seeds, prints reward vs time, and writes bench/results/minimal_grpo.json.

    python bench/minimal_grpo.py --max-wall-s 90 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.engines.base import GenerationRequest
from actors.engines.torch_engine import TorchEngine
from actors.envs.sort_task import make_prompts, make_verifier
from actors.rewards.pipeline import safe_score
from asyncrl.config import RunConfig, load_config
from asyncrl.models.tiny import ensure_model
from bench.common import REPO, RESULTS, command_line, environment, repeat, spread, write_json
from learner.policy_model import make_adamw

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run_minimal(config: RunConfig, max_wall_s: float, max_steps: int) -> list[dict]:
    """Train in one process until `max_wall_s` seconds or `max_steps` steps; per-step stats."""
    torch.manual_seed(config.run.seed)
    model_dir = ensure_model(config.model, config.task)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_DTYPES[config.model.dtype])
    engine = TorchEngine.from_model(model, tokenizer, seed=config.run.seed)
    prompts, verifier = make_prompts(config.task), make_verifier(config.task)
    optimizer = make_adamw(model, config.learner.lr, config.learner.weight_decay)  # as the learner
    rng = random.Random(config.run.seed)
    history: list[dict] = []
    start = time.perf_counter()
    for step in range(1, max_steps + 1):
        if time.perf_counter() - start >= max_wall_s:
            break
        rows = rng.sample(prompts, config.learner.groups_per_step)
        groups = engine.generate([_request(config, engine, row) for row in rows])
        rewards = [
            [
                safe_score(verifier, row["prompt"], engine.decode(s.completion_tokens), row["info"])
                for s in group
            ]
            for row, group in zip(rows, groups, strict=True)
        ]
        batch = _make_batch(config, engine, rows, groups, rewards, tokenizer.pad_token_id)
        _train_step(config, model, optimizer, batch)
        history.append(
            {
                "step": step,
                "time_s": time.perf_counter() - start,
                "reward_mean": float(batch["rewards"].mean()),
                "samples": int(batch["rewards"].numel()),
                "tokens": int(batch["loss_mask"].sum()),
            }
        )
    engine.close()
    return history


def _request(config: RunConfig, engine: TorchEngine, row: dict) -> GenerationRequest:
    return GenerationRequest(
        prompt_tokens=engine.encode(row["prompt"]),
        n=config.actor.group_size,
        temperature=config.actor.temperature,
        top_p=config.actor.top_p,
        max_new_tokens=config.actor.max_new_tokens,
        stop_token_ids=engine.stop_token_ids,
    )


def _make_batch(
    config: RunConfig,
    engine: TorchEngine,
    rows: list[dict],
    groups: list[list[Any]],
    rewards: list[list[Any]],
    pad_id: int,
) -> dict[str, torch.Tensor]:
    """Right-padded prompt + completion tokens, completion mask, behaviour logprobs, advantages."""
    seqs, masks, old, advantages, flat_rewards = [], [], [], [], []
    for row, group, scored in zip(rows, groups, rewards, strict=True):
        r = torch.tensor([s.reward for s in scored], dtype=torch.float32)
        adv = r - r.mean()
        if config.loss.adv_std_norm:
            adv = adv / (r.std(unbiased=False) + 1e-6)
        prompt = engine.encode(row["prompt"])
        for sample, a in zip(group, adv.tolist(), strict=True):
            completion = sample.completion_tokens.tolist()
            seqs.append(prompt + completion)
            masks.append([0] * len(prompt) + [1] * len(completion))
            old.append([0.0] * len(prompt) + sample.logprobs.tolist())
            advantages.append(a)
        flat_rewards.append(r)
    width = max(len(s) for s in seqs)

    def pad(rows_: list[list[float]], value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([x + [value] * (width - len(x)) for x in rows_], dtype=dtype)

    tokens = pad(seqs, pad_id, torch.long)
    return {
        "tokens": tokens,
        "attention_mask": pad([[1] * len(s) for s in seqs], 0, torch.long),
        "loss_mask": pad(masks, 0, torch.float32)[:, 1:],
        "old_logprobs": pad(old, 0.0, torch.float32)[:, 1:],
        "advantages": torch.tensor(advantages, dtype=torch.float32),
        "rewards": torch.cat(flat_rewards),
    }


def _train_step(
    config: RunConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict
) -> None:
    """One AdamW step of the token-mean PPO-clip loss, accumulated over micro-batches."""
    num_tokens = batch["loss_mask"].sum().clamp(min=1.0)
    size, micro = len(batch["tokens"]), config.learner.micro_batch_samples
    optimizer.zero_grad(set_to_none=True)
    for lo in range(0, size, micro):
        part = {k: v[lo : lo + micro] for k, v in batch.items()}
        logits = model(input_ids=part["tokens"], attention_mask=part["attention_mask"]).logits
        logp = torch.log_softmax(logits[:, :-1].float() / config.actor.temperature, dim=-1)
        logp = logp.gather(2, part["tokens"][:, 1:].unsqueeze(2)).squeeze(2)
        ratio = torch.exp(logp - part["old_logprobs"])
        adv = part["advantages"].unsqueeze(1)
        clipped = ratio.clamp(1 - config.loss.clip_low, 1 + config.loss.clip_high)
        token_loss = -torch.minimum(ratio * adv, clipped * adv)
        ((token_loss * part["loss_mask"]).sum() / num_tokens).backward()
    if config.learner.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.learner.grad_clip)
    optimizer.step()


# ------------------------------------------------------------------------------- script


def summarize(history: list[dict]) -> dict[str, float]:
    """Reward of the first and last tenth of the steps, their gain, and the wall time used."""
    tenth = max(1, len(history) // 10)
    first = statistics.fmean(h["reward_mean"] for h in history[:tenth])
    last = statistics.fmean(h["reward_mean"] for h in history[-tenth:])
    return {
        "steps": len(history),
        "time_s": history[-1]["time_s"],
        "reward_first_tenth": first,
        "reward_last_tenth": last,
        "reward_gain": last - first,
        "steps_per_s": len(history) / history[-1]["time_s"],
    }


def _print_curve(history: list[dict], every_s: float) -> None:
    next_t = 0.0
    for h in history:
        if h["time_s"] >= next_t or h is history[-1]:
            print(f"  t={h['time_s']:6.1f}s  step={h['step']:4d}  reward={h['reward_mean']:.3f}")
            next_t += every_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny_cpu.toml"))
    parser.add_argument("--set", action="append", default=[], help="section.key=value")
    parser.add_argument("--max-wall-s", type=float, default=90.0)
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3, help="runs with seeds seed, seed+1, ...")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 = one core)")
    parser.add_argument("--out", default=str(RESULTS / "minimal_grpo.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = load_config(args.config, args.set)
    ensure_model(base.model, base.task)  # build outside the timed runs (warm-up)

    def one(i: int) -> dict[str, Any]:
        config = load_config(args.config, [*args.set, f"run.seed={base.run.seed + i}"])
        history = run_minimal(config, args.max_wall_s, args.max_steps)
        print(f"run {i} (seed {config.run.seed}):")
        _print_curve(history, every_s=10.0)
        summary = summarize(history)
        print("  " + json.dumps({k: round(v, 3) for k, v in summary.items()}))
        return {"seed": config.run.seed, "summary": summary, "history": history}

    runs = repeat(one, reps=args.repeats, warmup=0)  # seeds seed, seed+1, ...
    metrics = {
        key: spread([r["summary"][key] for r in runs])
        for key in ("reward_first_tenth", "reward_last_tenth", "reward_gain", "steps_per_s")
    }
    print("over runs:", json.dumps(metrics, indent=1))
    result = {
        "benchmark": "minimal_grpo",
        "command": command_line(__file__),
        "config": base.to_dict(),
        **environment(("torch", "transformers")),
        "torch_threads": torch.get_num_threads(),
        "metrics": metrics,
        "runs": runs,
    }
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
