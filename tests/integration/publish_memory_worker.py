"""Peak extra memory of publishing weights from FSDP2 shards, for test_publish_memory.py.

    MALLOC_MMAP_THRESHOLD_=65536 python publish_memory_worker.py MODEL_DIR BUCKET_BYTES OUT.json

Run as 2 ranks (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT). Each large allocation is then its
own mapping, returned to the kernel when freed, so the process's peak resident set (VmHWM,
reset through /proc/self/clear_refs) follows the live tensors. Rank 0 measures the peak above
its resident set before the publication for (a) learner/publish.py's bucket-by-bucket path
(staging buffers included) and (b) a whole-model gather, the control that shows the measure
sees a gathered model; it writes both with the model's and one bucket's size.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from asyncrl.weights.bucket_plan import BucketPlan, params_from_module
from learner.parallel import init_world, leave_world, ranks_from_env, shard_model
from learner.publish import ShardedSource, _full, gather_all


def resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/self/status")


def reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    return resident_kib("VmRSS")


def main(model_dir: str, bucket_bytes: str, out: str) -> int:
    ranks = ranks_from_env()
    init_world(ranks, 300.0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    plan = BucketPlan.from_params(params_from_module(model), int(bucket_bytes))
    shard_model(model, ranks)
    if not ranks.is_leader:
        gather_all(plan, model)
        for _, param in model.named_parameters():
            _full(param)
        leave_world(clean=True)
        return 0
    before = reset_peak()
    source = ShardedSource(plan, model, torch.device("cpu"))
    for _ in source.buckets():
        pass
    del source
    bucketed = resident_kib("VmHWM") - before
    before = reset_peak()
    gathered = [_full(p) for _, p in model.named_parameters()]  # noqa: F841 - held on purpose
    whole = resident_kib("VmHWM") - before
    largest = max(b.numel * 4 for b in plan.buckets)
    result = {
        "bucketed_peak_bytes": bucketed * 1024,
        "whole_gather_peak_bytes": whole * 1024,
        "model_bytes": plan.total_bytes,
        "largest_bucket_bytes": largest,
        "num_buckets": len(plan.buckets),
    }
    Path(out).write_text(json.dumps(result))
    leave_world(clean=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
