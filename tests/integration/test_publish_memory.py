"""Publishing from shards never gathers the whole model: peak extra memory <= 3 buckets.

Two real FSDP2 ranks (gloo) over a 16-layer, 40 MB model cut into 4 MB buckets (as in real
models, one parameter is much smaller than a bucket: gathering a parameter briefly takes about
twice its size); publish_memory_worker.py
measures rank 0's peak resident set during a publication and, as a control, during a gather of
the whole model (which the measure must see: else it could not tell the two apart).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import ModelConfig, TaskConfig
from asyncrl.transport.sockets import free_port

WORKER = Path(__file__).with_name("publish_memory_worker.py")
BUCKET_BYTES = 4 << 20


@pytest.mark.slow
def test_publish_from_shards_holds_at_most_three_buckets(tmp_path: Path) -> None:
    from asyncrl.models.tiny import ensure_model

    shape = ModelConfig(
        cache_dir=str(tmp_path / "models"),
        hidden_size=256,
        num_layers=16,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=688,
    )
    model_dir = ensure_model(shape, TaskConfig())
    out = tmp_path / "memory.json"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MALLOC_MMAP_THRESHOLD_="65536",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE="2",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(model_dir), str(BUCKET_BYTES), str(out)],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
        )
        for rank in range(2)
    ]
    for proc in procs:
        try:
            assert proc.wait(timeout=300) == 0
        finally:
            if proc.poll() is None:
                proc.kill()  # by pid
    result = json.loads(out.read_text())
    bucket, model = result["largest_bucket_bytes"], result["model_bytes"]
    assert result["num_buckets"] >= 10
    assert result["whole_gather_peak_bytes"] >= 0.9 * model, result  # the measure sees a gather
    assert result["bucketed_peak_bytes"] <= 3 * bucket, result
