"""bench/staleness.py's pictures: throughput and idle fractions against η, and the reward
curves, one line (one panel) per loss and weight-update mode; `by` looks up the median of a
measure over the points of one (loss, η, mode)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any


def by(
    points: list[dict[str, Any]], loss: str, eta: int, key: str, mode: str = "between_groups"
) -> float | None:
    values = [
        p[key]
        for p in points
        if p["loss"] == loss
        and p["max_staleness"] == eta
        and p.get("weight_update", "between_groups") == mode
        and p.get(key) is not None
    ]
    return statistics.median(values) if values else None


def plot(
    points: list[dict[str, Any]], losses: list[str], etas: list[int], out: Path, modes: list[str]
) -> None:
    """<out stem>_throughput.png (samples/s, idle fractions vs η) and <out stem>_reward.png
    (reward vs wall-clock): a line (a panel) per loss and weight-update mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    etas = sorted(etas)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for loss, mode in [(loss, mode) for loss in losses for mode in modes]:
        name = f"{loss}, {mode}" if len(modes) > 1 else loss
        ax1.plot(
            etas, [by(points, loss, e, "samples_per_s", mode) for e in etas], marker="o", label=name
        )
        ax2.plot(
            etas,
            [by(points, loss, e, "learner_wait_fraction", mode) for e in etas],
            marker="o",
            label=f"learner waits ({name})",
        )
        ax2.plot(
            etas,
            [by(points, loss, e, "actor_wait_fraction", mode) for e in etas],
            marker="s",
            ls="--",
            label=f"actor waits ({name})",
        )
    ax1.set(xlabel="max_staleness η", ylabel="learner samples/s", title="throughput vs η")
    ax2.set(
        xlabel="max_staleness η",
        ylabel="fraction of wall time",
        title="idle fractions vs η",
        ylim=(0, 1),
    )
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_name(f"{out.stem}_throughput.png"), dpi=120)
    plt.close(fig)

    panels = [(loss, mode) for loss in losses for mode in modes]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (loss, mode) in zip(axes[0], panels, strict=True):
        for p in [p for p in points if p["loss"] == loss and p["weight_update"] == mode]:
            t = [c[0] for c in p["curve"]]
            r = [c[2] for c in p["curve"]]
            k = max(1, len(r) // 25)
            smooth = [statistics.fmean(r[max(0, j - k + 1) : j + 1]) for j in range(len(r))]
            ax.plot(t, smooth, label=f"η={p['max_staleness']} seed {p['seed']}")
        ax.set(
            xlabel="wall-clock s (learner)",
            ylabel="mean reward (smoothed)",
            title=f"{loss}, {mode}",
            ylim=(0, 1),
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_name(f"{out.stem}_reward.png"), dpi=120)
    plt.close(fig)
