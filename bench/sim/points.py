"""Measured runs as the calibration reads them: `load_points` takes bench/staleness.py's JSON
and normalises each run into a `Point` (its config, throughput, wait fractions, time records
and spreads), refusing a malformed one with a `ValueError` naming the point and the field."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.config import RunConfig, from_dict

from .timing import check_spread


@dataclass(frozen=True)
class Point:
    """One measured run, normalised."""

    cfg: RunConfig
    max_staleness: int
    samples_per_s: float
    learner_wait_fraction: float
    actor_wait_fraction: float
    step_time_s: float
    generate_time_s: float
    response_lengths: tuple[int, ...]
    prompt_tokens: float
    batch_seqs: float
    step_tokens: float
    sync_s: float
    generation_batches: tuple[tuple[float, float, float, float], ...]
    step_records: tuple[tuple[float, float], ...]
    step_spread: tuple[float, ...]
    generate_spread: tuple[float, ...]
    loss: str
    learner_outside_s: float
    actor_outside_s: float
    mean_staleness: float | None
    dropped_per_step: float | None
    inflight_updates: float = 0.0
    inflight_pause_s: float = 0.0


def load_points(path: str | Path) -> list[Point]:
    """Read and validate measured points (ValueError names the point and field)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"measured points: {path} not found (run bench/staleness.py first)")
    data = json.loads(path.read_text())
    if not isinstance(data.get("points"), list) or not data["points"]:
        raise ValueError(f"{path}: needs a non-empty list `points`")
    base = data.get("config") or {}
    return [parse_point(base, raw, f"{path}: points[{i}]") for i, raw in enumerate(data["points"])]


def parse_point(base: dict[str, Any], raw: dict[str, Any], where: str) -> Point:
    """One point of the JSON (`raw`, over the file's shared `config`), normalised; `where` names
    it in errors."""
    eta = int(_num(raw, "max_staleness", where))
    merged = {k: dict(v) for k, v in base.items() if isinstance(v, dict)}
    for section, values in (raw.get("config") or {}).items():
        merged.setdefault(section, {}).update(values)
    merged.setdefault("replay", {})["max_staleness"] = eta
    cfg = from_dict(_known_keys(merged))
    lengths = tuple(max(1, round(float(x))) for x in raw.get("response_lengths") or ())
    if not lengths or min(lengths) < 1:
        raise ValueError(f"{where}.response_lengths: need lengths >= 1 token")
    prompt = _num(raw, "prompt_tokens", where)
    seqs = _num(raw, "generate_batch_seqs", where, cfg.actor.concurrency * cfg.actor.group_size)
    tokens = cfg.samples_per_step * (prompt + float(np.mean(lengths)))
    samples_per_s = _num(raw, "samples_per_s", where)
    period = cfg.samples_per_step / samples_per_s
    step_s = _num(raw, "step_time_s", where)
    learner_wait = _num(raw, "learner_wait_fraction", where)
    actor_wait = _num(raw, "actor_wait_fraction", where)
    generate_s = _num(raw, "generate_time_s", where)
    actor_outside = 0.0
    updates = _num(raw, "inflight_updates", where, 0.0)
    pause = _num(raw, "inflight_pause_s", where, 0.0)
    if isinstance(raw.get("steps"), (int, float)) and raw["steps"] > 1:
        n = float(raw["steps"])
        dropped = _num(raw, "dropped_stale", where, 0.0)
        rounds = (n * cfg.learner.groups_per_step + dropped) / cfg.actor.concurrency
        actor_outside = max(0.0, (1 - actor_wait) * n * period / rounds - generate_s)
        generate_s = max(1e-9, generate_s - updates * pause / rounds)  # the pauses come off
    return Point(
        cfg=cfg,
        max_staleness=eta,
        samples_per_s=samples_per_s,
        learner_wait_fraction=learner_wait,
        actor_wait_fraction=actor_wait,
        step_time_s=step_s,
        generate_time_s=generate_s,
        response_lengths=lengths,
        prompt_tokens=prompt,
        batch_seqs=seqs,
        step_tokens=_num(raw, "step_tokens", where, tokens),
        sync_s=_num(raw, "sync_s", where, 0.0),
        generation_batches=tuple(tuple(map(float, b)) for b in raw.get("generation_batches", ())),
        step_records=tuple(tuple(map(float, s)) for s in raw.get("step_records", ())),
        step_spread=_spread(raw, "step_time_quantiles", where),
        generate_spread=_spread(raw, "generate_time_quantiles", where),
        loss=str(raw.get("loss", "")),
        learner_outside_s=max(0.0, period * (1 - learner_wait) - step_s),
        actor_outside_s=actor_outside,
        mean_staleness=_num(raw, "staleness_mean", where) if "staleness_mean" in raw else None,
        dropped_per_step=_num(raw, "dropped_stale", where) / float(raw["steps"])
        if isinstance(raw.get("steps"), (int, float)) and "dropped_stale" in raw
        else None,
        inflight_updates=updates,
        inflight_pause_s=pause,
    )


def _spread(raw: dict[str, Any], key: str, where: str) -> tuple[float, ...]:
    values = tuple(float(x) for x in raw.get(key) or ())
    check_spread(values, f"{where}.{key}")
    return values


def _known_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """Drop keys this version of asyncrl.config does not know (results may be newer or older)."""
    defaults = RunConfig()
    out: dict[str, Any] = {}
    for section, values in raw.items():
        if section in {f.name for f in dataclasses.fields(RunConfig)}:
            section_defaults = getattr(defaults, section)
            known = {f.name for f in dataclasses.fields(section_defaults)}
            # Lists and maps that older results recorded as comma-separated strings are dropped.
            out[section] = {
                k: v
                for k, v in values.items()
                if k in known
                and not (
                    isinstance(v, str) and isinstance(getattr(section_defaults, k), tuple | dict)
                )
            }
    return out


def _num(raw: dict[str, Any], key: str, where: str, default: float | None = None) -> float:
    value = raw.get(key, default)
    if isinstance(value, dict):
        value = value.get("median")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
        raise ValueError(f"{where}.{key}: must be a finite number, got {value!r}")
    return float(value)
