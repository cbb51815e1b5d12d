"""Weight broadcast over NCCL (cupy) between real processes, one GPU per rank.

NCCL refuses two ranks of one communicator on the same GPU, so the learner takes cuda:0 and
each receiver its own device: two receivers need three GPUs, and with two GPUs the test runs
with one receiver. Announcements travel as msgpack bytes over a queue (standing in for the
hub); received tensors come back to the test and are compared bit for bit.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import torch.multiprocessing as mp

from asyncrl.weights.broadcast import WeightPublisher, WeightReceiver
from asyncrl.weights.bucket_plan import BucketPlan, params_from_module, params_from_safetensors

pytestmark = pytest.mark.gpu

BUCKET_BYTES = 64 * 1024
TIMEOUT_S = 60.0


def _receiver_main(model_dir: str, actor_id: str, device: int, inbox: Any, outbox: Any) -> None:
    torch.cuda.set_device(device)
    plan = BucketPlan.from_params(params_from_safetensors(model_dir), BUCKET_BYTES)
    receiver = WeightReceiver(plan, actor_id, timeout_s=TIMEOUT_S, backend="nccl")

    def report() -> None:
        while receiver.wait_ready(None):
            got = receiver.poll()
            if got is not None:
                outbox.put((actor_id, got[0], {n: t.cpu() for n, t in got[1]}))

    threading.Thread(target=report, daemon=True).start()
    outbox.put((actor_id, "ready", None))
    while (blob := inbox.get()) is not None:
        receiver.on_announce(msgpack.unpackb(blob))
    receiver.close()


def test_receivers_get_the_senders_weights_bit_for_bit_over_nccl(tiny_model_dir: Path) -> None:
    num_gpus = torch.cuda.device_count()
    if num_gpus < 2:
        pytest.skip(f"gpu test skipped: NCCL needs one GPU per rank, found {num_gpus}")
    from transformers import AutoModelForCausalLM

    torch.cuda.set_device(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to("cuda:0")
    plan = BucketPlan.from_params(params_from_module(model), BUCKET_BYTES)
    actors = [f"actor-{i}" for i in range(1, min(3, num_gpus))]
    ctx = mp.get_context("spawn")
    outbox, inboxes = ctx.Queue(), {a: ctx.Queue() for a in actors}
    procs = [
        ctx.Process(target=_receiver_main, args=(str(tiny_model_dir), a, i + 1, inboxes[a], outbox))
        for i, a in enumerate(actors)
    ]
    for p in procs:
        p.start()
    try:
        assert sorted(outbox.get(timeout=4 * TIMEOUT_S)[0] for _ in actors) == actors

        def announce(ann: dict[str, Any]) -> None:
            for inbox in inboxes.values():
                inbox.put(msgpack.packb(ann))

        publisher = WeightPublisher(plan, backend="nccl", timeout_s=TIMEOUT_S, announce=announce)
        for v in (1, 2):  # the second publication reuses the communicator
            want = {n: (p.detach() * v + v) for n, p in model.named_parameters()}
            publisher.publish(v, want.items(), actors)
            assert publisher.wait(4 * TIMEOUT_S)
            assert publisher.last_result is not None and publisher.last_result.ok, (
                publisher.last_result
            )
            got = {}
            while len(got) < len(actors):
                try:
                    actor, version, tensors = outbox.get(timeout=2 * TIMEOUT_S)
                except queue.Empty:
                    raise AssertionError(f"weights missing from {set(actors) - set(got)}") from None
                if version == v:
                    got[actor] = tensors
            for tensors in got.values():
                assert tensors.keys() == want.keys()
                for name, t in want.items():
                    assert torch.equal(
                        tensors[name].view(torch.uint8), t.cpu().view(torch.uint8)
                    ), name
        publisher.close()
    finally:
        for inbox in inboxes.values():
            inbox.put(None)
        for p in procs:
            p.join(timeout=TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join()
