"""What bench/transport.py reports beside its per-size figures: the durable hub against the
volatile one, the packed hub against the unpacked one (both repetition by repetition, from the
same run), and the benchmark's goals met or not."""

from __future__ import annotations

import statistics
from typing import Any

from bench_common import spread


def durable_vs_volatile(times: dict[str, list[float]], count: int) -> dict[str, Any]:
    """`hub_durable` against `hub`, repetition by repetition (a run of just those two)."""
    if not times["hub"]:
        return {}
    ratio = [h / d for h, d in zip(times["hub"], times["hub_durable"], strict=True)]
    return {
        "durable_over_volatile": statistics.median(ratio),
        "durable_over_volatile_stats": spread(ratio),
        "hub_groups_per_s": statistics.median(count / t for t in times["hub"]),
        "hub_durable_groups_per_s": statistics.median(count / t for t in times["hub_durable"]),
    }


def packing_ab(
    times: dict[str, list[float]], cpus: dict[str, list[float]], hubs: dict[str, Any], count: int
) -> dict[str, Any]:
    """`hub` (batches packed as `replay.pack_frames_below` says) against `hub_unpacked` (never),
    repetition by repetition: throughput and CPU time per group, by process."""
    if not times["hub"]:
        return {}
    speed = [u / p for p, u in zip(times["hub"], times["hub_unpacked"], strict=True)]
    cpu = [p / u for p, u in zip(cpus["hub"], cpus["hub_unpacked"], strict=True)]
    return {
        "packed_over_unpacked_groups_per_s": spread(speed),
        "packed_over_unpacked_cpu": spread(cpu),
        "packed_groups_per_s": statistics.median(count / t for t in times["hub"]),
        "unpacked_groups_per_s": statistics.median(count / t for t in times["hub_unpacked"]),
        **{
            f"{name}_cpu_us_per_group_by_process": {
                k: spread([p[k] for p in hubs[name]["cpu_parts"][1:]])
                for k in ("actor", "hub", "hub_loop", "learner")
            }
            for name in ("hub", "hub_unpacked")
        },
    }


TARGETS = {"ratio_vs_relay": 0.8, "hub_groups_per_s_32k": 10_000, "durable_over_volatile_256k": 0.7}


def targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The goals of this benchmark (medians against them): hub >= 0.8x the two-hop relay at
    every size, >= 10,000 groups/s at 32 KB, durable >= 0.7x volatile at 256 KB."""
    done = [r for r in results if not r.get("partial")]
    near = (
        {
            size: min(done, key=lambda r: abs(r["group_bytes"] - size))
            for size in (32 << 10, 256 << 10)
        }
        if done
        else {}
    )
    met: dict[str, bool] = {
        f"ratio_vs_relay_{r['group_bytes']}": r["ratio_vs_relay"] >= TARGETS["ratio_vs_relay"]
        for r in done
    }
    if near:
        met["hub_groups_per_s_32k"] = (
            near[32 << 10]["hub_groups_per_s"] >= TARGETS["hub_groups_per_s_32k"]
        )
        met["durable_over_volatile_256k"] = (
            near[256 << 10]["durable_over_volatile"] >= TARGETS["durable_over_volatile_256k"]
        )
    return {"goals": TARGETS, "met": met}
