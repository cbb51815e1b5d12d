"""Publishing weights from FSDP2 shards: one bucket gathered, broadcast and released at a time.

```
  every rank, bucket by bucket (plan order):   all-gather the bucket's parameters (full_tensor)
  rank 0 only:                                 pack them into one of two staging buffers,
                                               hand the buffer to the broadcast (two in flight),
                                               release the gathered tensors
```

The whole model is never gathered on one rank: at any time rank 0 holds the two staging buffers
of its dtype plus the one parameter being gathered (copied into its place in the bucket and
released at once), so a publication costs two buckets plus one parameter of extra memory. The
gathers are collectives, so ranks > 0 run the same loop (`gather_all`) whenever rank 0
publishes; rank 0 drains the loop to the end even when the broadcast to the actors fails, so the
other ranks never wait on a gather that never comes.

With one rank the learner keeps the non-blocking snapshot path of `WeightPublisher.publish`
(asyncrl/weights/broadcast.py); with several, the learner waits for the publication
(`publish_blocking`; its time is the step's `weight_sync_s`). This stays in the learner because
it needs the learner's FSDP2 shards; the core's broadcast only sees buckets. At the end of a
run, `actors_loaded` asks the hub which version each actor has loaded.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import replace

import torch

from asyncrl.protocol.messages import Stats, StatsRequest
from asyncrl.transport.connection import HubConnection
from asyncrl.weights.bucket_plan import Bucket, BucketPlan, Entry, allocate_staging, pack_bucket
from asyncrl.weights.digest import update_digest


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter (all-gathered when it is a sharded DTensor)."""
    from torch.distributed.tensor import DTensor

    return param.full_tensor() if isinstance(param, DTensor) else param


def gathered_buckets(
    plan: BucketPlan, model: torch.nn.Module, staging: dict[str, list[torch.Tensor]] | None
) -> Iterator[torch.Tensor | None]:
    """Yield each bucket of `plan` packed into staging (rank 0), or None (ranks > 0).

    Bucket k reuses the staging buffer of bucket k-2 of its dtype: the consumer must be done
    with a buffer two yields later (the broadcast keeps two in flight).
    """
    params = dict(model.named_parameters())
    used = {dtype: 0 for dtype in (staging or {})}
    with torch.no_grad():
        for bucket in plan.buckets:
            slot = None
            if staging is not None:
                slot = staging[bucket.dtype][used[bucket.dtype] % 2][: bucket.numel]
                used[bucket.dtype] += 1
            for entry in bucket.entries:  # one parameter gathered at a time, copied, released
                full = _full(params[entry.name])
                if slot is not None:
                    pack_bucket(_single(bucket, entry), {entry.name: full}, slot)
                del full
            yield slot


def _single(bucket: Bucket, entry: Entry) -> Bucket:
    """A view of `bucket` holding only `entry` (at its offset in the bucket's buffer)."""
    return replace(bucket, entries=(entry,))


def gather_all(plan: BucketPlan, model: torch.nn.Module) -> None:
    """Ranks > 0: take part in every gather of one publication."""
    for _ in gathered_buckets(plan, model, None):
        pass


class ShardedSource:
    """Rank 0's staging buffers, allocated once and reused by every publication."""

    def __init__(self, plan: BucketPlan, model: torch.nn.Module, device: torch.device) -> None:
        self.plan = plan
        self.model = model
        self.staging = allocate_staging(plan, device)

    def buckets(self) -> Iterator[torch.Tensor]:
        """The packed buckets, for `BroadcastGroup.broadcast`."""
        for buf in gathered_buckets(self.plan, self.model, self.staging):
            assert buf is not None
            yield buf


def sharded_digest(model: torch.nn.Module, leader: bool) -> str:
    """Collective: the weights digest of asyncrl/weights/digest.py over the full parameters,
    gathered one at a time (rank 0 returns it; the other ranks return "")."""
    h = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        full = _full(param)
        if leader:
            update_digest(h, name, full)
        del full
    return h.hexdigest()[:32] if leader else ""


def actors_loaded(conn: HubConnection, policy_version: int, timeout_s: float) -> dict[str, int]:
    """Each actor's loaded version, polled from the hub's stats until every live actor has
    `policy_version` (or time runs out)."""
    deadline = time.monotonic() + timeout_s
    loaded: dict[str, int] = {}
    while time.monotonic() < deadline:
        conn.send(StatsRequest())
        msg = conn.recv(timeout_s=1.0)
        if isinstance(msg, Stats):
            clients = msg.stats.get("clients", {})
            actors = {k: v for k, v in clients.items() if v.get("role") == "actor"}
            loaded = {k: int(v.get("loaded_version", -1)) for k, v in actors.items()}
            alive = [k for k, v in actors.items() if v.get("alive")]
            if all(loaded[a] >= policy_version for a in alive):
                break
        time.sleep(0.2)
    return loaded
