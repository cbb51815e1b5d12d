"""Multi-turn episodes against single-turn generation of the same tokens, side by side.

    python bench/envs.py [--groups 24] [--reps 5] [--turns 3]

`multi_turn`: the episode runner (actors/episodes.py) drives tool episodes on the torch engine
and the tiny model: the real `ToolEnv` with its `Toolbox` (the lookup tool over each row's
table) and observations tokenized on their own, `--concurrency` groups of `--group-size`
episodes in flight, a new group started as one finishes. So that every episode really makes
`--turns - 1` tool calls whatever an untrained model writes, the call syntax is scripted
(`EveryTurnCalls`: turns before the last are lookup calls; the last is the answer).
`single_turn`: the same engine generates, for every episode of the multi-turn repetition just
measured, exactly as many tokens as that episode held after its prompt (model turns and tool
observations: the episode's token count), from the same prompts, in waves of the same number
of episodes, stop tokens off. `single_turn_model_tokens`: the same with only the model turns'
token count (a stricter baseline: it leaves out the observation tokens, which the multi-turn
engine must still run through the model).

`multi_turn_over_single_turn` = episodes/s multi-turn / episodes/s single-turn of the same
token count (goal >= 0.8): what the turn structure costs (tool calls, the hand-over between
the engine and the environments, feeding observations into the batch, bookkeeping).
`multi_turn_over_single_turn_model_tokens` is the ratio against the stricter baseline.
Repetitions alternate the three, so machine noise hits them alike. The torch engine continues
each episode inside one generate call (actors/episodes.py, continuous batching across turns),
so `multi_turn_generate_share` (the part of the multi-turn time inside `engine.generate`)
includes the environments' steps. Writes bench/results/envs.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from bench.common import RESULTS, command_line, environment, repeat, spread, write_json


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--groups", type=int, default=24, help="groups (prompts) per repetition")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4, help="groups in flight")
    p.add_argument("--turns", type=int, default=3, help="model turns per episode")
    p.add_argument("--max-new-tokens", type=int, default=8, help="per model turn")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(RESULTS / "envs.json"))
    return p.parse_args()


class EveryTurnCalls:
    """Call syntax for the benchmark: turns before the last look the row's key up."""

    def __init__(self, turns: int, key: str) -> None:
        from actors.envs.tool_calls import CompactCalls

        self.turns, self.key, self.seen = turns, key, 0
        self.results = CompactCalls()  # writes results back as `=value=`

    def parse(self, text: str) -> Any:
        from actors.envs.tool_calls import ParsedTurn, ToolCall

        self.seen += 1
        if self.seen < self.turns:
            return ParsedTurn(calls=(ToolCall("lookup", {"key": self.key}),), answer="")
        return ParsedTurn(calls=(), answer=text)

    def observation(self, results: Sequence[Any]) -> Any:
        return self.results.observation(results)


def make_env(turns: int, rows_key: str) -> Any:
    from actors.envs.lookup import lookup_reward
    from actors.envs.tool_env import ToolEnv
    from actors.envs.toolbox import Toolbox

    return ToolEnv(
        Toolbox(["lookup"]),
        EveryTurnCalls(turns, rows_key),
        lookup_reward,
        max_tool_calls=turns,
        max_tool_errors=turns,
        raw_text=True,
    )


def multi_turn(engine: Any, tok: Any, rows: Sequence[Any], args: argparse.Namespace) -> dict:
    """Episodes through the runner; the model tokens of each finished episode."""
    from actors.episodes import EpisodeLimits, EpisodeRunner

    limits = EpisodeLimits(max_turns=args.turns, max_new_tokens=args.max_new_tokens)
    engine = TimedEngine(engine)
    keys = iter([r.info["key"] for r in rows for _ in range(args.group_size)])
    runner = EpisodeRunner(engine, tok, lambda: make_env(args.turns, next(keys)), limits, workers=0)
    todo = list(enumerate(rows))
    episodes = []
    start = time.perf_counter()
    while todo or runner.num_groups:
        while todo and runner.num_groups < args.concurrency:
            i, row = todo.pop(0)
            runner.start(i, row, seed=i, n=args.group_size)
        for group in runner.advance():
            episodes += [(e.prompt, _model_tokens(e), _all_tokens(e)) for e in group.episodes]
    seconds = time.perf_counter() - start
    runner.close()
    return {
        "seconds": seconds,
        "generate_s": engine.seconds,
        "episodes": len(episodes),
        "episode_tokens": episodes,
    }


class TimedEngine:
    """The engine, with the seconds spent in `generate` added up."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seconds = inner, 0.0
        self.supports_kv_reuse = getattr(inner, "supports_kv_reuse", False)
        self.supports_turns = getattr(inner, "supports_turns", False)

    def release(self, keys: Sequence[str]) -> None:
        self.inner.release(keys)

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def generate(self, requests: Sequence[Any], **kwargs: Any) -> list[list[Any]]:
        start = time.perf_counter()
        out = self.inner.generate(requests, **kwargs)
        self.seconds += time.perf_counter() - start
        return out


def _model_tokens(ep: Any) -> int:
    return sum(len(tokens) for tokens, lps in ep.chunks if lps is not None)


def _all_tokens(ep: Any) -> int:
    return sum(len(tokens) for tokens, _ in ep.chunks)


def single_turn(engine: Any, episodes: Sequence[tuple[list[int], int]], wave: int) -> float:
    """Seconds to generate each episode's token count in one turn, `wave` at a time."""
    from actors.engines.base import GenerationRequest

    start = time.perf_counter()
    for at in range(0, len(episodes), wave):
        requests = [
            GenerationRequest(
                prompt_tokens=list(prompt),
                n=1,
                max_new_tokens=max(count, 1),
                stop_token_ids=(),
                seed=at + i,
            )
            for i, (prompt, count) in enumerate(episodes[at : at + wave])
        ]
        engine.generate(requests)
    return time.perf_counter() - start


def main() -> int:
    args = parse_args()
    import torch
    from transformers import AutoTokenizer

    from actors.engines.torch_engine import TorchEngine
    from actors.envs.lookup import make_rows
    from asyncrl.config import ModelConfig, TaskConfig
    from asyncrl.models.tiny import ensure_model

    torch.set_num_threads(args.threads)
    task = TaskConfig(name="lookup", num_digits=3, num_prompts=args.groups)
    with tempfile.TemporaryDirectory() as cache:
        model_dir = ensure_model(ModelConfig(cache_dir=cache, extra_chars="?=!"), task)
        engine = TorchEngine(model_dir, seed=0)
        tok = AutoTokenizer.from_pretrained(model_dir)
    rows = make_rows(task)
    multi_turn(engine, tok, rows[: args.concurrency], args)  # warm-up
    wave = args.concurrency * args.group_size

    def one(rep: int) -> dict[str, float]:
        run = multi_turn(engine, tok, rows, args)
        eps = run["episode_tokens"]
        single_s = single_turn(engine, [(p, n) for p, _, n in eps], wave)
        model_s = single_turn(engine, [(p, n) for p, n, _ in eps], wave)
        figures = {
            "multi": run["episodes"] / run["seconds"],
            "single": run["episodes"] / single_s,
            "model": run["episodes"] / model_s,
            "ratio": single_s / run["seconds"],
            "model_ratio": model_s / run["seconds"],
            "tokens": sum(n for _, _, n in eps) / run["episodes"],
            "model_tokens": sum(n for _, n, _ in eps) / run["episodes"],
            "share": run["generate_s"] / run["seconds"],
        }
        print(
            f"rep {rep}: multi-turn {figures['multi']:.1f} episodes/s, single-turn "
            f"{figures['single']:.1f} (ratio {figures['ratio']:.3f}), single-turn of the model "
            f"tokens {figures['model']:.1f} (ratio {figures['model_ratio']:.3f})",
            flush=True,
        )
        return figures

    reps = repeat(one, reps=args.reps, warmup=0)  # warmed up above, on fewer groups
    multi_rates, single_rates, model_rates, ratios, model_ratios, tokens, model_tokens, shares = (
        [r[key] for r in reps]
        for key in (
            "multi",
            "single",
            "model",
            "ratio",
            "model_ratio",
            "tokens",
            "model_tokens",
            "share",
        )
    )
    result = {
        "command": command_line(__file__),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        **environment(),
        "multi_turn_episodes_per_s": spread(multi_rates),
        "single_turn_episodes_per_s": spread(single_rates),
        "single_turn_model_tokens_episodes_per_s": spread(model_rates),
        "tokens_per_episode": spread(tokens),
        "model_tokens_per_episode": spread(model_tokens),
        "multi_turn_over_single_turn": spread(ratios)["median"],
        "ratio_spread": spread(ratios),
        "multi_turn_over_single_turn_model_tokens": spread(model_ratios)["median"],
        "model_tokens_ratio_spread": spread(model_ratios),
        "multi_turn_generate_share": spread(shares),
        "goal": {"multi_turn_over_single_turn": 0.8},
    }
    write_json(args.out, result)
    print(f"multi_turn_over_single_turn {result['multi_turn_over_single_turn']:.3f} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
