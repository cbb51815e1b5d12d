"""GPU weight sync: NCCL broadcast bus bandwidth vs the device-to-device copy ceiling, and the
time to sync a ~7 B-parameter model from a learner GPU into a vLLM engine. One short script
(a few minutes on one GPU node); needs CUDA, cupy and a CUDA build of vLLM.

- `nccl`: with >= 2 GPUs, cuda:0 broadcasts 1 GiB buckets to a receiver process on cuda:1
  through asyncrl's own NCCL group (asyncrl/weights/backends.py: side stream, two buffers in
  flight), against a peer-to-peer `copy_` cuda:0 -> cuda:1 of the same bytes (the ceiling).
  With one GPU NCCL cannot form a 2-rank group and the JSON says so.
- `sync_7b`: a Qwen2-7B-shaped model (random bf16 weights; vLLM starts with load_format
  "dummy", so nothing is read from disk) in an in-process vLLM engine on cuda:0, and learner
  tensors of the same names and shapes on the same GPU: the time of the worker extension's
  `load_hf_weights` (what VllmEngine.load_weights calls) for the whole model, then a
  generation with the new weights. Goal: < 0.5 s.

    python bench/weights_gpu.py [--reps 5] [--out bench/results/weights_gpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from bench.common import RESULTS, command_line, environment, repeat, spread, write_json

GIB = 1 << 30
QWEN2_7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def _receiver(port: int, nbytes: int, reps: int) -> None:
    from torch.distributed import TCPStore

    from asyncrl.weights.backends import NcclGroup

    torch.cuda.set_device(1)
    store = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=120))
    uid = bytes(store.get("uid"))
    group = NcclGroup(store, epoch=1, rank=1, world_size=2, timeout_s=120.0, unique_id=uid)
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    for _ in range(reps):
        group.broadcast([buf])
        torch.cuda.synchronize()
    group.close()


def nccl_bandwidth(reps: int, nbytes: int = GIB) -> dict[str, Any]:
    """Broadcast of `nbytes` cuda:0 -> cuda:1 over NCCL vs a peer copy of the same bytes."""
    if torch.cuda.device_count() < 2:
        return {"skipped": f"NCCL needs 2 GPUs for 2 ranks; found {torch.cuda.device_count()}"}
    from torch.distributed import TCPStore

    from asyncrl.weights.backends import NcclGroup, nccl_unique_id

    torch.cuda.set_device(0)
    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=120), wait_for_workers=False)
    uid = nccl_unique_id()
    store.set("uid", uid)
    proc = mp.get_context("spawn").Process(target=_receiver, args=(store.port, nbytes, reps + 1))
    proc.start()
    group = NcclGroup(store, epoch=1, rank=0, world_size=2, timeout_s=120.0, unique_id=uid)
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")

    def one(_rep: int) -> tuple[float, float]:
        """Seconds of the broadcast, then of the peer copy."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        group.broadcast([src])
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(1)
        return t1 - t0, time.perf_counter() - t1

    bcast, copy = map(list, zip(*repeat(one, reps=reps, warmup=1), strict=True))
    group.close()
    proc.join(timeout=120)
    if proc.is_alive():
        proc.kill()  # by pid
    med_b, med_c = statistics.median(bcast), statistics.median(copy)
    return {
        "bytes": nbytes,
        "broadcast_gbps": nbytes / med_b / 1e9,
        "copy_ceiling_gbps": nbytes / med_c / 1e9,
        "broadcast_vs_ceiling": med_c / med_b,
        "broadcast_s": spread(bcast),
        "copy_s": spread(copy),
    }


def sync_7b(reps: int) -> dict[str, Any]:
    """Whole-model weight update of a 7 B model into an in-process vLLM engine on cuda:0."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoModelForCausalLM, Qwen2Config
    from vllm import LLM, SamplingParams

    from actors.engines.vllm_engine import WORKER_EXTENSION
    from asyncrl.models.tiny import build_tokenizer

    model_dir = Path(tempfile.mkdtemp(prefix="asyncrl-7b-"))
    config = Qwen2Config(**QWEN2_7B, torch_dtype="bfloat16")
    config.save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    with torch.device("meta"):
        shapes = {
            n: p.shape for n, p in AutoModelForCausalLM.from_config(config).named_parameters()
        }
    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16",
        load_format="dummy",
        enforce_eager=True,
        gpu_memory_utilization=0.4,
        worker_extension_cls=WORKER_EXTENSION,
    )
    learner = [
        (n, torch.randn(s, dtype=torch.bfloat16, device="cuda:0")) for n, s in shapes.items()
    ]
    nbytes = sum(t.numel() * t.element_size() for _, t in learner)

    def one(_rep: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.collective_rpc("load_hf_weights", args=(learner,))
        llm.reset_prefix_cache()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    times = repeat(one, reps=reps, warmup=1)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4))
    return {
        "params": sum(t.numel() for _, t in learner),
        "bytes": nbytes,
        "sync_s": spread(times),
        "sync_gbps": nbytes / statistics.median(times) / 1e9,
        "generated_after_sync": len(out[0].outputs[0].token_ids),
        "goal_s": 0.5,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "weights_gpu.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("weights_gpu: no CUDA device; this benchmark runs on a GPU machine", file=sys.stderr)
        return 2
    result = {
        "benchmark": "weights_gpu",
        "command": command_line(__file__),
        **environment(("torch", "cupy", "vllm")),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "nccl": nccl_bandwidth(args.reps),
        "sync_7b": sync_7b(args.reps),
    }
    write_json(args.out, result)
    print(json.dumps({k: result[k] for k in ("gpus", "nccl", "sync_7b")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
