"""Run configuration: one frozen dataclass per component, composed into `RunConfig`.

TOML is the source of truth; `--set section.key=value` overrides a single field. Loading is
strict: an unknown section or key, a value of the wrong type, or a value out of range raises
`ValueError` naming the key (e.g. ``replay.max_staleness: must be >= 0, got -1``).
Derived values are properties, never written back. `config_hash` covers the fields that
processes must agree on (the `Hello` handshake compares it).

The sections live by owner: asyncrl/config_core.py (run, model, task, replay, actor),
config_learner.py (loss, learner, weights), config_ops.py (metrics, eval, alarms, trajectories,
launch), config_rewards.py (reward_model, reward, judge); all are importable from here.

This module and those import no torch and no vllm: the hub loads them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from asyncrl.config_checks import require
from asyncrl.config_core import ActorConfig, ModelConfig, ReplayConfig, RunSection, TaskConfig
from asyncrl.config_learner import LearnerConfig, LossConfig, WeightsConfig
from asyncrl.config_ops import (
    AlarmsConfig,
    EvalConfig,
    LaunchConfig,
    MetricsConfig,
    TrajectoriesConfig,
)
from asyncrl.config_rewards import JudgeConfig, RewardConfig, RewardModelConfig

__all__ = [
    "ActorConfig",
    "AlarmsConfig",
    "EvalConfig",
    "JudgeConfig",
    "LaunchConfig",
    "LearnerConfig",
    "LossConfig",
    "MetricsConfig",
    "ModelConfig",
    "ReplayConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RunConfig",
    "RunSection",
    "TaskConfig",
    "TrajectoriesConfig",
    "WeightsConfig",
    "from_dict",
    "load_config",
    "to_toml",
]


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one run needs; each section belongs to one component."""

    run: RunSection = field(default_factory=RunSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    alarms: AlarmsConfig = field(default_factory=AlarmsConfig)
    trajectories: TrajectoriesConfig = field(default_factory=TrajectoriesConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)

    def __post_init__(self) -> None:
        # The learner at version v takes only groups made with weights >= v - η, and actors
        # only ever hold published versions: every publish_every-th. A gap wider than η + 1
        # leaves a version no actor can serve, and the learner would wait for it forever.
        require(
            self.learner.publish_every <= self.replay.max_staleness + 1,
            "learner.publish_every",
            f"must be <= replay.max_staleness + 1 = {self.replay.max_staleness + 1} (actors hold "
            "only published weights, and the learner takes nothing staler than η)",
            self.learner.publish_every,
        )

    @property
    def samples_per_step(self) -> int:
        """Trajectories per optimizer step."""
        return self.learner.groups_per_step * self.actor.group_size

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict, as written to the run directory."""
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        """Hash of the settings all processes must agree on (model, task, sampling shape)."""
        shared = {
            "model": dataclasses.asdict(self.model),
            "task": dataclasses.asdict(self.task),
            "group_size": self.actor.group_size,
            "groups_per_step": self.learner.groups_per_step,
            "max_staleness": self.replay.max_staleness,
            "weights": {"backend": self.weights.backend, "bucket_bytes": self.weights.bucket_bytes},
        }
        blob = json.dumps(shared, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Read a TOML file (or defaults when `path` is None) and apply `section.key=value` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file not found: {p}")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{p}: invalid TOML: {exc}") from exc
    for item in overrides:
        section, key, value = _parse_override(item)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ValueError(f"{section}: must be a table, got {raw[section]!r}")
        raw[section][key] = value
    return from_dict(raw)


def from_dict(raw: dict[str, Any]) -> RunConfig:
    """Build a `RunConfig` from nested dicts, strictly (unknown keys and bad types fail)."""
    sections = {f.name: f for f in dataclasses.fields(RunConfig)}
    kwargs: dict[str, Any] = {}
    for name, values in raw.items():
        if name not in sections:
            raise ValueError(f"{name}: unknown config section (known: {', '.join(sections)})")
        if not isinstance(values, dict):
            raise ValueError(f"{name}: must be a table, got {values!r}")
        cls = _section_class(name)
        kwargs[name] = _build_section(name, cls, values)
    return RunConfig(**kwargs)


def _section_class(name: str) -> type:
    hints = typing.get_type_hints(RunConfig)
    return hints[name]


def _build_section(section: str, cls: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            raise ValueError(f"{section}.{key}: unknown key (known: {', '.join(sorted(known))})")
        kwargs[key] = _coerce(f"{section}.{key}", hints[key], value)
    return cls(**kwargs)


def _coerce(key: str, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ValueError(f"{key}: must be one of {list(choices)}, got {value!r}")
        return value
    if origin in (types.UnionType, typing.Union):
        raise AssertionError(f"{key}: union config fields are not supported")
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}: must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}: must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key}: must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{key}: must be a string, got {value!r}")
        return value
    raise AssertionError(f"{key}: unsupported config type {hint!r}")


def _parse_override(item: str) -> tuple[str, str, Any]:
    if "=" not in item:
        raise ValueError(f"--set {item!r}: expected section.key=value")
    dotted, text = item.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"--set {item!r}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word such as `vllm` is a string
    return parts[0], parts[1], value


def to_toml(config: RunConfig) -> str:
    """Render the resolved config as TOML (written into the run directory)."""
    lines: list[str] = []
    for section, values in config.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {json.dumps(value)}")
        lines.append("")
    return "\n".join(lines)
