"""The learner's alarms: the `Alarm` record, its detectors and reading alarms.jsonl.

```
  learner step -> row (metrics.jsonl) -> AlarmMonitor.observe(row) ----> [Alarm ...]
       |                                      history: the last 2 windows of rows,     |
       |                                      the warm-up's medians, component ranges  |
       +-> batch.groups -> RewardMonitor.step(groups, row) -> reward/<...> metrics     |
                              history of the last 2 x reward.alarm_window_steps steps  |
                              ---> take_alarms() -> [Alarm ...] -----------------------+
                                                                                       v
        learner/observe.py LearnerObserver.raise_alarm, the one writer: a log line,
        run_dir/alarms.jsonl (Alarm.record), AlarmRaised to the hub; then the action
        alarms.stop_on / pause_on give the name: warn | pause actors (hub) | stop (checkpoint)
```

## Stability alarms (`AlarmMonitor`): detectors over the rows of metrics.jsonl

Each detector looks at the recent window (the last `alarms.window_steps` rows) and compares it
with the window before it or with the warm-up (the first `alarms.warmup_steps` rows); medians
over a window make single noisy steps harmless (a healthy tiny run has steps with ESS 0.07 and
IS weights of 60, see tests/data/). What they catch:

    nan                   a non-finite value in any metric (fires at once, no warm-up)
    ess_collapse          window median ESS < ess_min
    is_weight_blowup      window median of the step's largest IS weight > is_weight_max
    kl_spike              the last spike_steps' median mismatch KL > kl_spike_factor × the
                          earlier window's median, and >= kl_min
    entropy_collapse      window median entropy < entropy_collapse_frac × the earlier window's
    reward_jump_length    mean reward up by >= reward_jump while the mean length shrinks below
                          length_collapse_ratio or grows above length_blowup_ratio of before
    reward_jump_entropy   the same jump while the mean entropy falls below entropy_drop_ratio
    grad_norm_spike       the same for the gradient norm (grad_norm_spike_factor, grad_norm_min)
    staleness_drift       window mean staleness >= warm-up mean + staleness_drift
    component_saturation  a `reward/<name>` component, having varied, sits flat at the top of
                          its range for a whole window (a reward being gamed)

A fired detector is quiet for `alarms.cooldown_steps`.

## Reward alarms (`RewardMonitor`): from the groups of each batch

Each step it also makes the step's reward metrics (merged into the row):

    reward/<component>    mean over the step's trajectories
    reward/failed         trajectories whose reward failed (with a reason)
    reward/flag/<name>    defences that fired (hedged, gate:format, ...)
    reward/canary_alarms  known-wrong canaries that earned reward (actors)

and raises alarms named reward:<kind>, with evidence:

    reward:reward_jump_collapse  the reward mean rose by > alarm_reward_jump between the two
                                 windows while response length or entropy fell by
                                 > alarm_collapse_ratio
    reward:saturated:<name>      a component with one value and no spread for
                                 alarm_saturate_steps
    reward:canary                an actor's canary alarm, repeated here with its evidence

Provenance: each new reward provenance seen (rule hash, reward-model checkpoint, rubric hash)
is appended to run_dir/reward_provenance.jsonl with the step it first appeared at.

A sudden reward gain that comes with shorter or less varied answers is the usual signature of
a policy that found a hole in the reward; a component stuck at one value no longer tells the
samples of a group apart (it only shifts the reward), so it carries no signal.

This module is pure Python (no torch): the tests feed it recorded metric streams, and tools
read the records (`read_alarms`).
"""

from __future__ import annotations

import collections
import json
import math
import statistics
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.config import AlarmsConfig, RewardConfig
from asyncrl.protocol.messages import Group

ALARMS_FILE = "alarms.jsonl"

Row = dict[str, Any]


@dataclass(frozen=True)
class Alarm:
    """One fired detector: what, when, and the evidence (values and window)."""

    name: str
    step: int
    policy_version: int
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able record (non-finite numbers become null)."""
        return {
            "name": self.name,
            "step": self.step,
            "policy_version": self.policy_version,
            "message": self.message,
            "evidence": json_safe(self.evidence),
        }

    def record(self, action: str) -> dict[str, Any]:
        """The line of alarms.jsonl: `to_json()` and the action taken (warn | pause | stop)."""
        return {**self.to_json(), "action": action}


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def number(row: Row, key: str) -> float:
    """The row's value for `key` as a float: NaN when missing, null or not a number."""
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    return float(value)


def _values(rows: Sequence[Row], key: str) -> list[float]:
    return [number(r, key) for r in rows]


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _median(values: Sequence[float]) -> float:
    finite = _finite(values)
    return statistics.median(finite) if finite else math.nan


def _mean(values: Sequence[float]) -> float:
    finite = _finite(values)
    return sum(finite) / len(finite) if finite else math.nan


def _window(rows: Sequence[Row]) -> list[int]:
    return [int(rows[0].get("step", 0)), int(rows[-1].get("step", 0))]


def _rounded(values: Sequence[float]) -> list[float]:
    return [round(v, 6) if math.isfinite(v) else v for v in values]


# --- stability alarms ---------------------------------------------------------------------------

Finding = tuple[str, dict[str, Any]] | None
"""A detector's result: None, or (message, evidence)."""


class AlarmMonitor:
    """Feeds each learner step's metrics to the detectors; returns the alarms that fire."""

    def __init__(self, cfg: AlarmsConfig) -> None:
        self.cfg = cfg
        w = cfg.window_steps
        self.history: collections.deque[Row] = collections.deque(maxlen=2 * w + 1)
        self.warmup: list[Row] = []
        self.quiet_until: dict[str, int] = {}
        self.ranges: dict[str, list[float]] = {}  # reward component -> [min, max] so far
        self.num_rows = 0
        self.detectors: dict[str, Callable[[], Finding]] = {
            "ess_collapse": self.ess_collapse,
            "is_weight_blowup": self.is_weight_blowup,
            "kl_spike": self.kl_spike,
            "entropy_collapse": self.entropy_collapse,
            "reward_jump_length": self.reward_jump_length,
            "reward_jump_entropy": self.reward_jump_entropy,
            "grad_norm_spike": self.grad_norm_spike,
            "staleness_drift": self.staleness_drift,
            "component_saturation": self.component_saturation,
        }

    def observe(self, row: Row) -> list[Alarm]:
        """Add one step's metrics; return the alarms this step fires (usually none)."""
        self.history.append(row)
        self.num_rows += 1
        if len(self.warmup) < self.cfg.warmup_steps:
            self.warmup.append(row)
        self.track_components(row)
        step = int(row.get("step", self.num_rows))
        found = [("nan", self.nan())]
        if self.num_rows > self.cfg.warmup_steps and len(self.history) > self.cfg.window_steps:
            found += [(name, detect()) for name, detect in self.detectors.items()]
        fired = []
        for name, finding in found:
            if finding is None or step < self.quiet_until.get(name, -1):
                continue
            self.quiet_until[name] = step + self.cfg.cooldown_steps
            message, evidence = finding
            version = int(number(row, "policy_version")) if "policy_version" in row else step
            fired.append(Alarm(name, step, version, message, evidence))
        return fired

    # --- windows ----------------------------------------------------------------------------

    @property
    def recent(self) -> list[Row]:
        """The last `window_steps` rows (this step included)."""
        return list(self.history)[-self.cfg.window_steps :]

    @property
    def earlier(self) -> list[Row]:
        """The rows before the recent window (up to one window of them)."""
        rows = list(self.history)[: -self.cfg.window_steps]
        return rows[-self.cfg.window_steps :]

    def track_components(self, row: Row) -> None:
        for key in row:
            if key.startswith("reward/"):
                value = number(row, key)
                if math.isfinite(value):
                    lo, hi = self.ranges.setdefault(key, [value, value])
                    self.ranges[key] = [min(lo, value), max(hi, value)]

    # --- detectors ---------------------------------------------------------------------------

    def nan(self) -> Finding:
        row = self.history[-1]
        bad = sorted(k for k, v in row.items() if k not in ("step", "time") and not _is_finite(v))
        if not bad:
            return None
        shown = {k: row.get(k) for k in bad}
        return f"non-finite metrics at step {row.get('step')}: {', '.join(bad)}", {"values": shown}

    def ess_collapse(self) -> Finding:
        return self._level("ess", self.cfg.ess_min, below=True, what="effective sample size")

    def is_weight_blowup(self) -> Finding:
        return self._level(
            "is_weight_max", self.cfg.is_weight_max, below=False, what="largest IS weight"
        )

    def _level(self, key: str, bound: float, *, below: bool, what: str) -> Finding:
        values = _values(self.recent, key)
        median = _median(values)
        if not math.isfinite(median) or (median >= bound if below else median <= bound):
            return None
        side, how = ("below", "collapsed") if below else ("above", "blew up")
        message = f"{what} {how}: window median {key} = {median:.4g} {side} {bound:g}"
        return message, {
            "key": key,
            "median": median,
            "threshold": bound,
            "window": _window(self.recent),
            "values": _rounded(values),
        }

    def kl_spike(self) -> Finding:
        return self._spike("mismatch_kl", self.cfg.kl_spike_factor, self.cfg.kl_min)

    def grad_norm_spike(self) -> Finding:
        return self._spike("grad_norm", self.cfg.grad_norm_spike_factor, self.cfg.grad_norm_min)

    def _spike(self, key: str, factor: float, floor: float) -> Finding:
        latest = _values(list(self.history)[-self.cfg.spike_steps :], key)
        value = _median(latest)
        before = _values(self.earlier, key)
        median = _median(before)
        if not (math.isfinite(value) and math.isfinite(median)):
            return None
        if value < floor or value <= factor * max(median, 1e-12):
            return None
        message = (
            f"{key} spiked to {value:.4g} (median of the last {len(latest)} steps), "
            f"{value / max(median, 1e-12):.1f}x the median {median:.4g} of the "
            f"{len(before)} steps before"
        )
        return message, {
            "key": key,
            "value": value,
            "earlier_median": median,
            "factor": factor,
            "floor": floor,
            "latest_values": _rounded(latest),
            "earlier_window": _window(self.earlier),
            "earlier_values": _rounded(before),
        }

    def entropy_collapse(self) -> Finding:
        now, before = (
            _median(_values(self.recent, "entropy")),
            _median(_values(self.earlier, "entropy")),
        )
        frac = self.cfg.entropy_collapse_frac
        if not (math.isfinite(now) and math.isfinite(before)) or now >= frac * before:
            return None
        message = f"entropy collapsed from {before:.4g} to {now:.4g} within a window (< {frac:g}x)"
        return message, self._compare_evidence("entropy", before, now)

    def _compare_evidence(self, key: str, before: float, now: float) -> dict[str, Any]:
        return {
            "key": key,
            "earlier": before,
            "recent": now,
            "earlier_window": _window(self.earlier),
            "window": _window(self.recent),
            "earlier_values": _rounded(_values(self.earlier, key)),
            "values": _rounded(_values(self.recent, key)),
        }

    def _reward_jump(self) -> tuple[float, float] | None:
        before = _mean(_values(self.earlier, "reward_mean"))
        now = _mean(_values(self.recent, "reward_mean"))
        if (
            not (math.isfinite(before) and math.isfinite(now))
            or now - before < self.cfg.reward_jump
        ):
            return None
        return before, now

    def reward_jump_length(self) -> Finding:
        jump = self._reward_jump()
        if jump is None:
            return None
        before = _mean(_values(self.earlier, "response_len_mean"))
        now = _mean(_values(self.recent, "response_len_mean"))
        if not (math.isfinite(before) and math.isfinite(now)) or before <= 0:
            return None
        ratio = now / before
        if self.cfg.length_collapse_ratio <= ratio <= self.cfg.length_blowup_ratio:
            return None
        how = "collapsed" if ratio < 1 else "blew up"
        message = (
            f"reward jumped {jump[0]:.3f} -> {jump[1]:.3f} while the response length "
            f"{how} {before:.1f} -> {now:.1f} tokens"
        )
        evidence = self._compare_evidence("response_len_mean", before, now)
        evidence.update(
            reward_earlier=jump[0],
            reward_recent=jump[1],
            length_ratio=ratio,
            reward_values=_rounded(_values(self.recent, "reward_mean")),
        )
        return message, evidence

    def reward_jump_entropy(self) -> Finding:
        jump = self._reward_jump()
        if jump is None:
            return None
        before = _mean(_values(self.earlier, "entropy"))
        now = _mean(_values(self.recent, "entropy"))
        if not (math.isfinite(before) and math.isfinite(now)) or before <= 0:
            return None
        if now / before >= self.cfg.entropy_drop_ratio:
            return None
        message = (
            f"reward jumped {jump[0]:.3f} -> {jump[1]:.3f} while the entropy collapsed "
            f"{before:.3g} -> {now:.3g}"
        )
        evidence = self._compare_evidence("entropy", before, now)
        evidence.update(
            reward_earlier=jump[0],
            reward_recent=jump[1],
            reward_values=_rounded(_values(self.recent, "reward_mean")),
        )
        return message, evidence

    def staleness_drift(self) -> Finding:
        base = _mean(_values(self.warmup, "staleness_mean"))
        now = _mean(_values(self.recent, "staleness_mean"))
        if (
            not (math.isfinite(base) and math.isfinite(now))
            or now - base < self.cfg.staleness_drift
        ):
            return None
        message = f"staleness drifted from {base:.2f} (warm-up) to {now:.2f} versions (window)"
        return message, {
            "key": "staleness_mean",
            "warmup": base,
            "recent": now,
            "warmup_window": _window(self.warmup),
            "window": _window(self.recent),
            "values": _rounded(_values(self.recent, "staleness_mean")),
        }

    def component_saturation(self) -> Finding:
        eps = self.cfg.saturation_eps
        for key, (lo, hi) in sorted(self.ranges.items()):
            span = hi - lo
            values = _finite(_values(self.recent, key))
            if span <= 0 or len(values) < self.cfg.window_steps:
                continue
            if max(values) - min(values) > eps * span or min(values) < hi - eps * span:
                continue
            message = (
                f"reward component {key} saturated: flat at {values[-1]:.4g} (the top of "
                f"its range [{lo:.4g}, {hi:.4g}]) for {len(values)} steps"
            )
            return message, {
                "key": key,
                "range": [lo, hi],
                "window": _window(self.recent),
                "values": _rounded(values),
            }
        return None


def _is_finite(value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_is_finite(v) for v in value)
    return True


def scan(rows: Sequence[Row], cfg: AlarmsConfig) -> list[Alarm]:
    """Every alarm a recorded metric stream fires, in order (for tests and reports)."""
    monitor = AlarmMonitor(cfg)
    return [alarm for row in rows for alarm in monitor.observe(row)]


# --- reward alarms ------------------------------------------------------------------------------


class RewardMonitor:
    """Turns each step's groups into reward metrics and raises the run-level alarms."""

    def __init__(self, cfg: RewardConfig, run_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.history: deque[dict[str, float]] = deque(maxlen=2 * cfg.alarm_window_steps)
        self.flat: dict[str, int] = Counter()
        self.version = 0  # the policy version of the step being checked
        self.alarms: list[Alarm] = []
        """Every alarm raised so far."""
        self.fresh: list[Alarm] = []
        """Alarms not yet taken by the caller (`take_alarms`)."""
        self.raised: set[str] = set()
        self.provenances: set[str] = set()

    def step(self, step: int, groups: Sequence[Group], row: dict[str, Any]) -> dict[str, float]:
        """The reward metrics of this step (merged into its metrics row by the caller)."""
        self.version = int(row.get("policy_version", step))
        out = component_means(groups)
        flags: Counter[str] = Counter()
        failed = canaries = 0
        for g in groups:
            failed += sum(1 for f in g.reward_failed if f)
            meta = g.metadata.get("reward", {}) if isinstance(g.metadata, dict) else {}
            flags.update(meta.get("flags", {}))
            self.note_provenance(step, meta.get("provenance"))
            for alarm in (meta.get("canary") or {}).get("alarms", []):
                canaries += 1
                self.alarm(step, "canary", {"actor": g.actor_id, **alarm})
        out["reward/failed"] = float(failed)
        out["reward/canary_alarms"] = float(canaries)
        out.update({f"reward/flag/{k}": float(v) for k, v in flags.items()})
        self.check_saturation(step, groups)
        self.history.append(
            {
                "reward": float(row.get("reward_mean", 0.0)),
                "length": float(row.get("response_len_mean", 0.0)),
                "entropy": float(row.get("entropy", math.nan)),
            }
        )
        self.check_jump(step)
        out["reward/alarms"] = float(len(self.alarms))
        return out

    def check_jump(self, step: int) -> None:
        """Reward jump with a length or entropy collapse between the two windows."""
        k = self.cfg.alarm_window_steps
        if len(self.history) < 2 * k:
            return
        rows = list(self.history)
        before, after = _means(rows[:k]), _means(rows[k:])
        jump = after["reward"] - before["reward"]
        if jump <= self.cfg.alarm_reward_jump:
            return
        keep = 1.0 - self.cfg.alarm_collapse_ratio
        collapsed = [
            m for m in ("length", "entropy") if before[m] > 0 and after[m] < keep * before[m]
        ]
        if collapsed:
            self.alarm(
                step,
                "reward_jump_collapse",
                {
                    "reward_before": before["reward"],
                    "reward_after": after["reward"],
                    **{f"{m}_before": before[m] for m in collapsed},
                    **{f"{m}_after": after[m] for m in collapsed},
                    "window_steps": k,
                },
            )
            self.history.clear()  # one alarm per episode of collapse

    def check_saturation(self, step: int, groups: Sequence[Group]) -> None:
        """A component with one value across every trajectory for many steps in a row."""
        need = self.cfg.alarm_saturate_steps
        if not need:
            return
        values: dict[str, list[float]] = {}
        for g in groups:
            for name, vs in g.reward_components.items():
                values.setdefault(name, []).extend(vs)
        for name, vs in values.items():
            flat = len(vs) > 1 and max(vs) == min(vs)
            self.flat[name] = self.flat[name] + 1 if flat else 0
            if self.flat[name] >= need and name not in self.raised:
                self.raised.add(name)
                self.alarm(step, f"saturated:{name}", {"value": vs[0], "steps": self.flat[name]})

    def note_provenance(self, step: int, provenance: Any) -> None:
        """Record a provenance not seen before (a new checkpoint, rubric or rule)."""
        if not provenance:
            return
        key = json.dumps(provenance, sort_keys=True)
        if key in self.provenances:
            return
        self.provenances.add(key)
        if self.run_dir is not None:
            with (self.run_dir / "reward_provenance.jsonl").open("a") as f:
                f.write(json.dumps({"step": step, "provenance": provenance}) + "\n")

    def alarm(self, step: int, kind: str, evidence: dict[str, Any]) -> None:
        message = f"reward alarm {kind}: " + json.dumps(evidence, default=str)[:300]
        alarm = Alarm(
            name=f"reward:{kind}",
            step=step,
            policy_version=self.version,
            message=message,
            evidence=evidence,
        )
        self.alarms.append(alarm)
        self.fresh.append(alarm)

    def take_alarms(self) -> list[Alarm]:
        """The alarms raised since the last call (for the learner's observer to raise)."""
        fresh, self.fresh = self.fresh, []
        return fresh


def component_means(groups: Sequence[Group]) -> dict[str, float]:
    """reward/<component>: the mean over the trajectories that carry the component."""
    sums: dict[str, float] = {}
    counts: Counter[str] = Counter()
    for g in groups:
        for name, values in g.reward_components.items():
            sums[name] = sums.get(name, 0.0) + math.fsum(values)
            counts[name] += len(values)
    return {f"reward/{name}": sums[name] / counts[name] for name in sums if counts[name]}


def _means(rows: list[dict[str, float]]) -> dict[str, float]:
    out = {}
    for key in rows[0]:
        finite = [r[key] for r in rows if math.isfinite(r[key])]
        out[key] = sum(finite) / len(finite) if finite else math.nan
    return out


# --- alarms.jsonl -------------------------------------------------------------------------------


def read_alarms(path: str | Path) -> list[dict[str, Any]]:
    """The records of an alarms.jsonl (`Alarm.record`: name, step, policy_version, message,
    evidence, action); [] when there is no file. A line torn by a crash is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a crash
        out.append(record if "name" in record else _older_reward_record(record))
    return out


def _older_reward_record(record: dict[str, Any]) -> dict[str, Any]:
    """A reward alarm as older runs wrote it, `{"alarm": kind, "step", "evidence"}`, in the
    shape of `Alarm.record`."""
    evidence = record.get("evidence", {})
    step = int(record.get("step", 0))
    return {
        "name": f"reward:{record.get('alarm', '?')}",
        "step": step,
        "policy_version": int(record.get("policy_version", step)),
        "message": str(record.get("message") or json.dumps(evidence)),
        "evidence": evidence,
        "action": str(record.get("action", "warn")),
    }
