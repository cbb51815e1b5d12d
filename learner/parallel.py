"""Learner ranks: the process group, FSDP2 sharding, and how rank 0 leads the other ranks.

```
  rank 0 (leader): the hub conversation,           ranks 1..N-1 (followers): no hub socket;
  metrics, checkpoint files, the weight publisher  they mirror every collective of rank 0
      |                                                 |
      |-- command(TRAIN, batch bytes) --broadcast-->    decode the batch, train on own groups
      |-- command(PUBLISH) ------------------------>    all-gather the weights bucket by bucket
      |-- command(CHECKPOINT, step) --------------->    write own shards (DCP)
      |-- command(DIGEST) ------------------------->    all-gather for the weights digest
      |-- command(STOP) --------------------------->    leave
```

Ranks start in one of two ways, both through the standard variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT): `asyncrl learner --world N` starts N local ranks itself
(`spawn_local`: the same command per rank, with those variables set), or a launcher (torchrun,
srun, a Kubernetes indexed Job) starts each rank with them, on any number of nodes. Backend:
gloo on CPU, nccl where CUDA is present.

Batches: rank 0 receives the step's whole batch from the hub and broadcasts its encoded bytes
(the wire format of asyncrl/protocol/codec.py, no pickle); every rank trains on its own contiguous
slice of the groups (`shard_groups`), so every group is trained exactly once and a group's
samples stay together (its advantages are normalised over the group). Loss denominators are
the step's global counts divided by the world size, because FSDP2 averages gradients over the
ranks (learner/losses.py). All ranks must run the same number of forward/backward passes (each
one runs collectives), so a rank with fewer micro-batches runs padding passes with a zero loss.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.distributed as dist

from asyncrl.protocol.codec import decode, encode
from asyncrl.protocol.messages import Batch
from asyncrl.transport.sockets import free_port


class Op(IntEnum):
    """What rank 0 asks the other ranks to do next."""

    TRAIN = 1
    PUBLISH = 2
    CHECKPOINT = 3
    DIGEST = 4
    STOP = 5


@dataclass(frozen=True)
class Ranks:
    """This process's place in the learner's world."""

    rank: int
    world: int
    local_rank: int
    backend: str

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


SINGLE = Ranks(rank=0, world=1, local_rank=0, backend="gloo")
"""The world of a learner started without the rank variables."""


def ranks_from_env(env: dict[str, str] | None = None) -> Ranks:
    """The world described by RANK/WORLD_SIZE/LOCAL_RANK (SINGLE when WORLD_SIZE is absent)."""
    env = dict(os.environ if env is None else env)
    if "WORLD_SIZE" not in env:
        return SINGLE
    try:
        world, rank = int(env["WORLD_SIZE"]), int(env.get("RANK", "0"))
        local = int(env.get("LOCAL_RANK", str(rank)))
    except ValueError as exc:
        raise ValueError(f"RANK/WORLD_SIZE/LOCAL_RANK: not integers ({exc})") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} WORLD_SIZE={world}: need 0 <= RANK < WORLD_SIZE")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    return Ranks(rank=rank, world=world, local_rank=local, backend=backend)


def init_world(ranks: Ranks, timeout_s: float) -> None:
    """Join the default process group (env:// rendezvous on MASTER_ADDR:MASTER_PORT)."""
    if not ranks.distributed or dist.is_initialized():
        return
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise ValueError(f"{key}: must be set for a learner of WORLD_SIZE={ranks.world}")
    if ranks.backend == "nccl":
        torch.cuda.set_device(ranks.local_rank)
    from datetime import timedelta

    dist.init_process_group(
        ranks.backend, rank=ranks.rank, world_size=ranks.world, timeout=timedelta(seconds=timeout_s)
    )


def leave_world(clean: bool) -> None:
    """Tear the process group down: after a barrier when every rank got here normally.

    Without it gloo's threads meet the interpreter's exit while a peer may still be sending
    (an abort: "terminate called without an active exception"). After a failure the barrier
    is skipped, since the other ranks may never arrive.
    """
    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
    dist.destroy_process_group()


def shard_model(model: torch.nn.Module, ranks: Ranks) -> None:
    """FSDP2: `fully_shard` every transformer block, then the root (in place)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = "cuda" if ranks.backend == "nccl" else "cpu"
    mesh = init_device_mesh(device, (ranks.world,))
    blocks = getattr(getattr(model, "model", None), "layers", None)
    if blocks is None:
        raise ValueError(f"model: {type(model).__name__} has no .model.layers to shard")
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def shard_groups(num_groups: int, rank: int, world: int) -> tuple[int, int]:
    """[first, last) of the groups rank `rank` trains on: contiguous, sizes differ by <= 1."""
    if num_groups < world:
        raise ValueError(
            f"learner.groups_per_step: {num_groups} groups cannot be shared by {world} ranks"
        )
    base, extra = divmod(num_groups, world)
    first = rank * base + min(rank, extra)
    return first, first + base + (1 if rank < extra else 0)


# --- rank 0 leads, the others follow ---------------------------------------------------------


def comm_device() -> torch.device:
    """Where small control tensors must live for the default group (nccl: this rank's GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def send_command(op: Op, payload: bytes = b"", arg: int = 0) -> None:
    """Rank 0: tell every rank what comes next (and hand it `payload`)."""
    device = comm_device()
    header = torch.tensor([int(op), len(payload), arg], dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    if payload:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        dist.broadcast(data, src=0)


def recv_command() -> tuple[Op, bytes, int]:
    """Ranks > 0: the next command from rank 0."""
    device = comm_device()
    header = torch.zeros(3, dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    op, size, arg = (int(x) for x in header.cpu())
    payload = b""
    if size:
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        dist.broadcast(buf, src=0)
        payload = buf.cpu().numpy().tobytes()
    return Op(op), payload, arg


def pack_batch(batch: Batch) -> bytes:
    """A Batch as bytes: the frame count, each frame's length, then the frames (wire format)."""
    frames = [bytes(memoryview(f)) for f in encode(batch)]
    head = [len(frames), *(len(f) for f in frames)]
    return b"".join(x.to_bytes(8, "little") for x in head) + b"".join(frames)


def unpack_batch(data: bytes) -> Batch:
    """Inverse of `pack_batch` (the batch came from our own rank 0: values are not re-scanned)."""
    count = int.from_bytes(data[:8], "little")
    sizes = [int.from_bytes(data[8 * (i + 1) : 8 * (i + 2)], "little") for i in range(count)]
    offset, frames = 8 * (count + 1), []
    for size in sizes:
        frames.append(data[offset : offset + size])
        offset += size
    msg = decode(frames, max_message_bytes=max(len(data), 1), check_values=False)
    assert isinstance(msg, Batch), type(msg)
    return msg


def all_reduce_stats(stats: dict[str, float], weight: float, world: int) -> dict[str, float]:
    """Combine per-rank step statistics: means weighted by `weight` (this rank's share of the
    step's rows), maxima for `*_max` keys; `loss` is the mean over ranks (each rank's loss is
    already scaled by the global denominators / world); `grad_norm` is global already."""
    keys = sorted(stats)
    summed = [k for k in keys if not k.endswith("_max") and k not in ("loss", "grad_norm")]
    maxed = [k for k in keys if k.endswith("_max")]
    device = comm_device()
    values = torch.tensor(
        [stats[k] * weight for k in summed] + [stats.get("loss", 0.0) / world],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(values)
    top = torch.tensor([stats[k] for k in maxed], dtype=torch.float64, device=device)
    if maxed:
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
    values, top = values.cpu(), top.cpu()
    out = dict(zip(summed, values[:-1].tolist(), strict=True))
    out.update(zip(maxed, top.tolist(), strict=True))
    if "loss" in stats:
        out["loss"] = float(values[-1])
    if "grad_norm" in stats:
        out["grad_norm"] = stats["grad_norm"]
    return out


# --- `asyncrl learner --world N`: N local ranks ------------------------------------------------


def spawn_local(world: int, argv: Sequence[str]) -> int:
    """Run `asyncrl learner ARGV` as `world` local ranks; return the first non-zero exit code.

    SIGTERM/SIGINT are passed on to every rank (rank 0 checkpoints and says goodbye to the hub);
    when one rank fails, the others are terminated, by pid.
    """
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    procs = []
    for rank in range(world):
        child = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        cmd = [sys.executable, "-m", "asyncrl", "learner", *argv]
        procs.append(subprocess.Popen(cmd, env=child))

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return _wait_all(procs)


def _wait_all(procs: list[subprocess.Popen[bytes]]) -> int:
    code = 0
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed and code == 0:
            code = int(failed[0].returncode)
            print(f"learner: rank pid {failed[0].pid} exited with {code}; stopping the others")
            for p in procs:  # the others may wait in a collective forever: kill, by pid
                if p.poll() is None:
                    p.kill()
        try:
            procs[0].wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
    codes = [int(p.returncode) for p in procs]
    return code or next((c for c in codes if c != 0), 0)
