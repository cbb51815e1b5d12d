"""`asyncrl inspect RUN_DIR`: list, filter and read the trajectories a run kept.

    asyncrl inspect runs/tiny_cpu                          every kept trajectory, one line each
    asyncrl inspect runs/tiny_cpu --reward-max 0.2 --staleness-min 3 --finish length --sort reward
    asyncrl inspect runs/tiny_cpu --show 12                trajectory 12 (a row number or an id),
                                                           decoded turn by turn, token by token

```
  run_dir/trajectories/*.npz ──load_table──> Table ──filters──> rows ──table()──> stdout
                                                         └──--show──> show(): turns + tokens
```

A trajectory's turns are its prompt, then the runs of completion tokens the model produced
(loss mask 1) and those an environment or tool inserted (mask 0). Each token line has its id,
its text, the mask, the behaviour log-prob (the actor's, μ), the learner's log-prob (π, at
`learner_version`) and the IS weight π/μ. Text is decoded with the run's tokenizer (its path is
in trajectories/meta.json); without it, token ids are shown.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from learner.trajectory_store import Table, load_table, read_meta

FILTERS = {  # flag: (column, compare)
    "reward_min": ("reward", np.greater_equal),
    "reward_max": ("reward", np.less_equal),
    "staleness_min": ("staleness", np.greater_equal),
    "staleness_max": ("staleness", np.less_equal),
    "length_min": ("completion_len", np.greater_equal),
    "length_max": ("completion_len", np.less_equal),
    "version_min": ("min_version", np.greater_equal),
    "version_max": ("min_version", np.less_equal),
    "step_min": ("step", np.greater_equal),
    "step_max": ("step", np.less_equal),
}
EXACT = {"actor": "actor_id", "finish": "finish_reason", "task": "task"}
LIST_COLUMNS = (
    ("#", 5),
    ("trajectory_id", 22),
    ("step", 6),
    ("version", 7),
    ("stale", 5),
    ("actor", 9),
    ("task", 6),
    ("finish", 7),
    ("len", 4),
    ("reward", 7),
    ("kept as", 16),
)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl inspect", description="Read a run's trajectories.")
    p.add_argument("run_dir", help="run directory (with trajectories/)")
    for flag in FILTERS:
        p.add_argument("--" + flag.replace("_", "-"), type=float, default=None)
    for flag in EXACT:
        p.add_argument("--" + flag, default=None, help=f"only this {EXACT[flag]}")
    p.add_argument("--kept", default=None, help="only kept as: sample, outlier or alarm")
    p.add_argument("--sort", default="", help="sort by a column (reward, staleness, step, ...)")
    p.add_argument("--desc", action="store_true", help="sort descending")
    p.add_argument("--limit", type=int, default=50, help="rows listed (0 = all)")
    p.add_argument("--show", default=None, help="show one trajectory: row number or id")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p.parse_args(list(argv))


def select(table: Table, args: argparse.Namespace) -> np.ndarray:
    """Row numbers of the table that pass every filter, in the asked order."""
    keep = np.ones(len(table), dtype=bool)
    for flag, (column, compare) in FILTERS.items():
        value = getattr(args, flag)
        if value is not None:
            keep &= compare(table[column], value)
    for flag, column in EXACT.items():
        value = getattr(args, flag)
        if value is not None:
            keep &= table[column] == value
    if args.kept:
        keep &= np.char.startswith(table["reason"].astype(str), args.kept)
    rows = np.flatnonzero(keep)
    if args.sort:
        if args.sort not in table.columns:
            raise ValueError(f"--sort: no column {args.sort!r} (have {', '.join(table.columns)})")
        order = np.argsort(table[args.sort][rows], kind="stable")
        rows = rows[order[::-1] if args.desc else order]
    return rows


def list_line(table: Table, i: int) -> list[str]:
    c = table.columns
    version = f"{c['min_version'][i]}" + (
        "" if c["min_version"][i] == c["max_version"][i] else f"-{c['max_version'][i]}"
    )
    return [
        str(i),
        str(c["trajectory_id"][i]),
        str(c["step"][i]),
        version,
        str(c["staleness"][i]),
        str(c["actor_id"][i]),
        str(c["task"][i]),
        str(c["finish_reason"][i]),
        str(c["completion_len"][i]),
        f"{c['reward'][i]:.4g}",
        str(c["reason"][i]),
    ]


def format_table(header: Sequence[tuple[str, int]], lines: Sequence[Sequence[str]]) -> str:
    """Fixed-width columns, as wide as the widest cell (at least the given width)."""
    widths = [
        max([w, len(h)] + [len(line[k]) for line in lines]) for k, (h, w) in enumerate(header)
    ]
    out = ["  ".join(h.ljust(w) for (h, _), w in zip(header, widths, strict=True))]
    out += [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in lines
    ]
    return "\n".join(out)


def decoder(run_dir: Path) -> Callable[[Sequence[int]], str]:
    """Token ids -> text with the run's tokenizer, or the ids themselves without it."""
    path = read_meta(run_dir).get("tokenizer_dir", "")
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path) if path else None
    except (OSError, ValueError):
        tokenizer = None
    if tokenizer is None:
        return lambda ids: " ".join(f"<{int(t)}>" for t in ids)
    return lambda ids: tokenizer.decode([int(t) for t in ids], skip_special_tokens=False)


def turns(record: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(who, first, last) completion index ranges: runs of equal loss mask."""
    mask = record["loss_mask"]
    out: list[tuple[str, int, int]] = []
    start = 0
    for k in range(1, len(mask) + 1):
        if k == len(mask) or mask[k] != mask[start]:
            out.append(("model" if mask[start] else "environment", start, k))
            start = k
    return out


def show(record: dict[str, Any], decode: Callable[[Sequence[int]], str]) -> str:
    """One trajectory, turn by turn, token by token."""
    r = record
    head = [
        f"trajectory {r['trajectory_id']}  (group {r['group_id']}, prompt {r['prompt_id']}, "
        f"actor {r['actor_id']}, task {r['task']})",
        f"kept as {r['reason']} at learner step {r['step']}; generated by policy versions "
        f"{r['min_version']}..{r['max_version']}, trained at version {r['train_version']} "
        f"(staleness {r['staleness']}); learner logprobs at version {r['learner_version']}",
        f"reward {r['reward']:.6g}  advantage {r['advantage']:.4g}  finish {r['finish_reason']}"
        + (f"  reward failed: {r['reward_failed']}" if r["reward_failed"] else ""),
    ]
    comps = r.get("components", {})
    if comps:
        head.append("reward components: " + ", ".join(f"{k} {v:.6g}" for k, v in comps.items()))
    plen = r["prompt_len"]
    tokens, behaviour, learner = r["tokens"], r["behavior_logprobs"], r["learner_logprobs"]
    head += ["", "[prompt]", decode(tokens[:plen])]
    for who, a, b in turns(r):
        head += ["", f"[{who}] " + decode(tokens[plen + a : plen + b])]
        lines = []
        for k in range(a, b):
            model = bool(r["loss_mask"][k])  # environment tokens have no behaviour logprob
            weight = math.exp(learner[k] - behaviour[k]) if np.isfinite(learner[k]) else math.nan
            lines.append(
                [
                    str(k),
                    str(int(tokens[plen + k])),
                    repr(decode([tokens[plen + k]])),
                    str(int(r["loss_mask"][k])),
                    f"{behaviour[k]:.4f}" if model else "-",
                    f"{learner[k]:.4f}",
                    f"{weight:.4f}" if model else "-",
                ]
            )
        header = [
            ("pos", 3),
            ("id", 5),
            ("text", 6),
            ("mask", 4),
            ("behaviour lp", 12),
            ("learner lp", 10),
            ("IS weight", 9),
        ]
        head.append(format_table(header, lines))
    return "\n".join(head)


def find(table: Table, key: str) -> int:
    """A row number from `--show`: the number itself or a trajectory id."""
    if key.isdigit() and int(key) < len(table):
        return int(key)
    hits = np.flatnonzero(table["trajectory_id"] == key)
    if not len(hits):
        raise ValueError(f"--show: no trajectory {key!r} (row numbers go to {len(table) - 1})")
    return int(hits[0])


def jsonable(record: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in record.items()}


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    run_dir = Path(args.run_dir)
    table = load_table(run_dir)
    if args.show is not None:
        record = table.record(find(table, args.show))
        text = json.dumps(jsonable(record)) if args.json else show(record, decoder(run_dir))
        print(text)
        return 0
    rows = select(table, args)
    shown = rows if args.limit == 0 else rows[: args.limit]
    if args.json:
        print(json.dumps([{"row": int(i), **jsonable(table.record(int(i)))} for i in shown]))
        return 0
    print(format_table(LIST_COLUMNS, [list_line(table, int(i)) for i in shown]))
    more = f" (first {len(shown)} listed; --limit 0 lists all)" if len(shown) < len(rows) else ""
    meta = read_meta(run_dir)
    print(
        f"{len(rows)} of {len(table)} kept trajectories match{more}; sampling stride "
        f"{meta.get('stride', 1)}, flagged {meta.get('num_flagged', 0)} kept, "
        f"{meta.get('flagged_dropped', 0)} over the limit",
        file=sys.stderr,
    )
    return 0
