"""The trajectory store: trained trajectories kept in the run directory, columnar, for tools.

```
  learner step ──(sampled / outlier / alarm trajectories + learner logprobs)──> build_table
      ──> TrajectoryWriter
      run_dir/trajectories/meta.json                 tokenizer dir, task, sampling stride, counts
      run_dir/trajectories/sample-000000120.npz      one regular sample (a step's chosen groups)
      run_dir/trajectories/flagged-000000371.npz     outliers and alarm batches from step 371 on,
                                                     written together (256 or at flush())
  asyncrl inspect / asyncrl report ──> load_table(run_dir) ──> Table (all shards, one index)
```

A shard is one `.npz` file (numpy, no pickle: strings are fixed-width unicode arrays) holding a
table: one row per trajectory (ids, actor, task, finish reason, reward and its components,
versions, lengths, why it was kept) and the token-level columns of all its trajectories
concatenated (`tokens` from `token_start`, completion-aligned `loss_mask`, `behavior_logprobs`,
`learner_logprobs` from `completion_start`). numpy rather than parquet: it is already a
dependency of every process, the shards are small (a kept group of the tiny run is ~3 KB), and
a shard is written in one call with no schema to keep; the reader still loads any shard
subset as columns. Files are written to a temporary name and renamed, so a reader never sees
half a shard.

Bounded: the regular sample keeps one step of every `sample_every_steps`; past
`max_sampled_steps` shards the stride doubles and the sampled shards off the new stride are
deleted, so the sample stays spread over the whole run in a fixed number of files. Flagged
trajectories (outliers, alarms) are kept up to `max_flagged`, then only counted.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.config import TrajectoriesConfig
from asyncrl.files import replace_text
from asyncrl.protocol.messages import Group, Trajectory

STORE_DIR = "trajectories"
META_FILE = "meta.json"
TOKEN_COLUMNS = ("tokens",)
COMPLETION_COLUMNS = ("loss_mask", "behavior_logprobs", "learner_logprobs")
COMPONENT_PREFIX = "component."
FLUSH_ROWS = 256  # flagged trajectories written together in one shard


@dataclass(frozen=True)
class Kept:
    """One trajectory chosen for the store: where it is in the step's batch, and why."""

    group: int
    index: int
    reason: str  # "sample", "outlier:reward", "alarm:kl_spike", ...


class TrajectoryWriter:
    """Writes shards into run_dir/trajectories and keeps the store within its bounds."""

    def __init__(self, run_dir: str | Path, cfg: TrajectoriesConfig, meta: Mapping[str, Any]):
        self.root = Path(run_dir) / STORE_DIR
        self.root.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg
        old = read_meta(run_dir)
        self.meta: dict[str, Any] = {"stride": 1, "num_flagged": 0, "flagged_dropped": 0}
        self.meta.update({k: old[k] for k in self.meta if k in old})  # a resumed run continues
        self.meta.update(meta)
        self.pending: list[dict[str, np.ndarray]] = []  # flagged tables not yet written
        self.save_meta()

    def sample_due(self, step: int) -> bool:
        """Is this step one of the regular sample (at the current stride)?"""
        every = self.cfg.sample_every_steps
        return every > 0 and step % (every * self.meta["stride"]) == 0

    def write_sample(self, step: int, table: dict[str, np.ndarray]) -> Path:
        """The sampled trajectories of one step, as one shard (then thin the sample)."""
        path = self._save(f"sample-{step:09d}", table)
        self.thin()
        self.save_meta()
        return path

    def room(self, num_flagged: int) -> int:
        """How many of `num_flagged` new flagged trajectories may be kept (the others are
        counted in meta.json's flagged_dropped)."""
        room = max(0, min(num_flagged, self.cfg.max_flagged - self.meta["num_flagged"]))
        if room < num_flagged:
            self.meta["flagged_dropped"] += num_flagged - room
            self.save_meta()
        return room

    def add_flagged(self, table: dict[str, np.ndarray]) -> None:
        """Flagged trajectories (fitting in `room()`); written together by `flush()`."""
        self.meta["num_flagged"] += len(table["step"])
        assert self.meta["num_flagged"] <= self.cfg.max_flagged
        self.pending.append(table)
        if sum(len(t["step"]) for t in self.pending) >= FLUSH_ROWS:
            self.flush()

    def flush(self) -> Path | None:
        """Write the pending flagged trajectories as one shard (named by the first step)."""
        if not self.pending:
            return None
        table = concat_tables(self.pending)
        self.pending = []
        path = self._save(f"flagged-{int(table['step'][0]):09d}", table)
        self.save_meta()
        return path

    def _save(self, stem: str, table: dict[str, np.ndarray]) -> Path:
        path, n = self.root / f"{stem}.npz", 0
        while path.exists():  # a second shard starting at the same step
            n += 1
            path = self.root / f"{stem}-{n}.npz"
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
        np.savez(tmp, **table)
        os.replace(tmp, path)
        return path

    def thin(self) -> None:
        """Past max_sampled_steps sampled shards: double the stride, drop the shards off it."""
        shards = sorted(self.root.glob("sample-*.npz"))
        while len(shards) > self.cfg.max_sampled_steps:
            self.meta["stride"] *= 2
            every = self.cfg.sample_every_steps * self.meta["stride"]
            for path in shards:
                if shard_step(path) % every != 0:
                    path.unlink()
            shards = sorted(self.root.glob("sample-*.npz"))

    def save_meta(self) -> None:
        replace_text(self.root / META_FILE, json.dumps(self.meta, indent=1, sort_keys=True))


def shard_step(path: Path) -> int:
    """The learner step a shard's name records (`sample-000000120.npz` -> 120)."""
    return int(path.stem.split("-")[1])


def read_meta(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / STORE_DIR / META_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def build_table(
    step: int, groups: Sequence[Group], kept: Sequence[Kept], columns: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    """The columns of one shard (see the module docstring)."""
    views: dict[int, list[Trajectory]] = {}
    trajs = []
    for k in kept:
        group = groups[k.group]
        if k.group not in views:
            views[k.group] = group.trajectories()
        trajs.append((group, views[k.group][k.index], k))
    comp_lens = [len(t.loss_mask) for _, t, _ in trajs]
    learner = columns.get("learner_logprobs") or [np.full(n, np.nan, np.float32) for n in comp_lens]
    table: dict[str, np.ndarray] = {
        "trajectory_id": _strings([t.trajectory_id for _, t, _ in trajs]),
        "group_id": _strings([g.group_id for g, _, _ in trajs]),
        "prompt_id": _strings([g.prompt_id for g, _, _ in trajs]),
        "actor_id": _strings([g.actor_id for g, _, _ in trajs]),
        "finish_reason": _strings([t.finish_reason for _, t, _ in trajs]),
        "reward_failed": _strings([t.reward_failed for _, t, _ in trajs]),
        "reason": _strings([k.reason for _, _, k in trajs]),
        "step": np.full(len(trajs), step, np.int64),
        "reward": np.array([t.reward for _, t, _ in trajs], np.float64),
        "min_version": np.array([t.min_policy_version for _, t, _ in trajs], np.int64),
        "max_version": np.array([t.max_policy_version for _, t, _ in trajs], np.int64),
        "prompt_len": np.array([t.prompt_len for _, t, _ in trajs], np.int64),
        "completion_len": np.array(comp_lens, np.int64),
        "tokens": _concat([t.tokens for _, t, _ in trajs], np.int32),
        "loss_mask": _concat([t.loss_mask for _, t, _ in trajs], np.uint8),
        "behavior_logprobs": _concat([t.behavior_logprobs for _, t, _ in trajs], np.float32),
        "learner_logprobs": _concat(learner, np.float32),
    }
    for name, values in columns.items():
        if name == "learner_logprobs":
            continue
        arr = np.asarray(values)
        table[name] = _strings(list(values)) if arr.dtype.kind in "US" else arr
    for name, values in components(groups, kept).items():
        table[COMPONENT_PREFIX + name] = values
    assert len(learner) == len(trajs), "one learner logprob array per kept trajectory"
    return table


def components(groups: Sequence[Group], kept: Sequence[Kept]) -> dict[str, np.ndarray]:
    """Per-trajectory reward components (name -> value; NaN where a trajectory has none), from
    a group's `reward_components` (name -> one value per trajectory), where the reward
    pipeline puts them, or its metadata's entry of that name."""
    found: dict[str, np.ndarray] = {}
    for row, k in enumerate(kept):
        group = groups[k.group]
        comps = getattr(group, "reward_components", None) or group.metadata.get(
            "reward_components", {}
        )
        for name, values in dict(comps).items():
            column = found.setdefault(str(name), np.full(len(kept), np.nan))
            if isinstance(values, Sequence) and k.index < len(values):
                column[row] = float(values[k.index])
    return found


def _strings(values: Sequence[str]) -> np.ndarray:
    return np.array([str(v) for v in values], dtype=str) if values else np.array([], "<U1")


def _concat(arrays: Sequence[np.ndarray], dtype: type) -> np.ndarray:
    arrays = [np.asarray(a, dtype) for a in arrays]
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype)


# --- reading --------------------------------------------------------------------------------


class Table:
    """Every kept trajectory of a run: per-trajectory columns plus the ragged token columns."""

    def __init__(self, columns: dict[str, np.ndarray]) -> None:
        self.columns = columns
        n = len(columns.get("step", ()))
        plen, clen = columns.get("prompt_len"), columns.get("completion_len")
        self.token_start = _starts(plen + clen) if n else np.zeros(0, np.int64)
        self.completion_start = _starts(clen) if n else np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self.columns.get("step", ()))

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    def component_names(self) -> list[str]:
        prefix = COMPONENT_PREFIX
        return sorted(k[len(prefix) :] for k in self.columns if k.startswith(prefix))

    def record(self, i: int) -> dict[str, Any]:
        """Trajectory i as a dict: scalars, components, and its token-level arrays."""
        out: dict[str, Any] = {}
        for name, column in self.columns.items():
            if name in TOKEN_COLUMNS or name in COMPLETION_COLUMNS:
                continue
            value = column[i].item()
            if name.startswith(COMPONENT_PREFIX):
                if not (isinstance(value, float) and math.isnan(value)):
                    out.setdefault("components", {})[name[len(COMPONENT_PREFIX) :]] = value
            else:
                out[name] = value
        t0, length = int(self.token_start[i]), int(self.columns["prompt_len"][i])
        length += int(self.columns["completion_len"][i])
        c0, clen = int(self.completion_start[i]), int(self.columns["completion_len"][i])
        out["tokens"] = self.columns["tokens"][t0 : t0 + length]
        for name in COMPLETION_COLUMNS:
            out[name] = self.columns[name][c0 : c0 + clen]
        return out


def _starts(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)


def load_table(run_dir: str | Path) -> Table:
    """All shards of a run's store as one table (sampled first, then flagged, by step)."""
    root = Path(run_dir) / STORE_DIR
    if not root.is_dir():
        raise ValueError(f"{run_dir}: no trajectory store ({STORE_DIR}/ is missing)")
    shards = sorted(root.glob("sample-*.npz")) + sorted(root.glob("flagged-*.npz"))
    parts = []
    for path in shards:
        with np.load(path, allow_pickle=False) as npz:
            parts.append({k: npz[k] for k in npz.files})
    return Table(concat_tables(parts))


def concat_tables(parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Tables one after the other; a column some lack (a component) is NaN or "" there."""
    names = sorted({k for p in parts for k in p})
    columns: dict[str, np.ndarray] = {}
    for name in names:
        pieces = [p[name] if name in p else _missing(p, name) for p in parts]
        columns[name] = np.concatenate(pieces) if pieces else np.zeros(0)
    return columns


def _missing(part: dict[str, np.ndarray], name: str) -> np.ndarray:
    """A column one shard lacks (a component it never saw): NaN or "" per trajectory."""
    n = len(part["step"])
    return np.full(n, np.nan) if name.startswith(COMPONENT_PREFIX) else np.full(n, "", dtype=str)
