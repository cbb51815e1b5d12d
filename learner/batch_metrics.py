"""What the learner logs about each batch besides the loss: how its episodes ended (finish
reasons, failed rewards, turns and tool calls) and how stale it was (per trajectory, per model
token, and the share of trajectories made by more than one policy version)."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import numpy as np

from asyncrl.protocol.messages import Group


def episode_metrics(groups: Sequence[Group]) -> dict[str, float]:
    """Per-sample means of how the batch's episodes went: finish reasons (`finish/<reason>`,
    fractions), failed rewards, and for multi-turn tasks turns, tool calls, failed and malformed
    calls, tool and environment seconds."""
    num = sum(g.size for g in groups)
    reasons = collections.Counter(r for g in groups for r in g.finish_reasons)
    out = {f"finish/{reason}": count / num for reason, count in sorted(reasons.items())}
    out["reward_failed_frac"] = sum(1 for g in groups for f in g.reward_failed if f) / num
    if any(g.num_turns for g in groups):
        out["turns_mean"] = sum(sum(g.num_turns) for g in groups) / num
        out["tool_s_mean"] = sum(sum(g.tool_s) for g in groups) / num
        out["env_s_mean"] = sum(sum(g.env_s) for g in groups) / num
        for key in ("tool_calls", "tool_errors", "malformed_calls"):
            out[f"{key}_per_episode"] = sum(int(g.metadata.get(key, 0)) for g in groups) / num
    return out


def version_metrics(groups: Sequence[Group], version: int, eta: int) -> dict[str, Any]:
    """Staleness (`version` minus the producing version) counted per trajectory (its oldest
    token, what the hub's bound uses) and per model token; and the share of trajectories
    made by more than one version (in-flight updates, multi-turn episodes)."""
    per_traj, per_token, mixed = [], np.zeros(eta + 2, np.int64), 0
    for g in groups:
        for t in g.trajectories():
            per_traj.append(version - t.min_policy_version)
            mixed += t.max_policy_version > t.min_policy_version
            ages = version - t.token_versions()[t.loss_mask.astype(bool)]
            per_token += np.bincount(np.clip(ages, 0, eta + 1), minlength=eta + 2)
    return {
        "staleness_hist_trajectories": staleness_histogram(per_traj, eta),
        "staleness_hist_tokens": per_token.tolist(),
        "staleness_tokens_mean": float(
            (per_token * np.arange(eta + 2)).sum() / max(per_token.sum(), 1)
        ),
        "mixed_version_frac": mixed / max(len(per_traj), 1),
    }


def staleness_histogram(values: Sequence[int], max_staleness: int) -> list[int]:
    """Counts of staleness 0..max_staleness, then one bin for anything staler."""
    hist = [0] * (max_staleness + 2)
    for v in values:
        hist[min(max(v, 0), max_staleness + 1)] += 1
    return hist
