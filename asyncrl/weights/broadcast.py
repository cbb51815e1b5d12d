"""The weight broadcast, both ends of one protocol: the learner's `WeightPublisher` (snapshot,
announce, (re)form, broadcast) and the actor's `WeightReceiver` (join the announced group,
receive, hand over).

```
 learner ── publish(v) ──> WeightPublisher ── announcement ──> hub ──> actor: on_announce(ann)
                             │  TCPStore rendezvous; epoch = one membership       │
                             └── buckets, gloo | nccl (backends.py) ──> WeightReceiver
                                                                               └─> poll() -> engine
```

The announcement is a plain msgpack-able dict (`ANNOUNCEMENT_KEYS`): the policy version, the
bucket plan's hash, the backend, the membership epoch, where the rendezvous store listens, the
group's size and each actor's rank in it, and NCCL's unique id. The learner is rank 0 of every
group; a new epoch (new members, or a failed publication) forms a new group.

## The learner's end: `WeightPublisher`

```
 learner thread                      publisher thread (one publication in flight)
 --------------                      --------------------------------------------
 publish(v, tensors, members)
   pack tensors -> snapshot buckets   waits for a queued job
   queue job (replaces a queued,  --> members changed or last failed? -> epoch += 1
   not yet started one)               announce({policy_version, epoch, ranks, ...})  -> hub
   return (training goes on)          new epoch: form the group (<= timeout_s)
                                      broadcast buckets, two in flight (<= timeout_s each)
                                      record PublishResult; return the snapshot buffers
```

`publish` costs the learner one copy of the parameters into flat bucket buffers (the
snapshot, on the parameters' device for nccl, on the CPU for gloo); everything else happens on
the publisher thread. At most one publication is in flight and at most one is queued behind
it: a newer `publish` replaces the queued one (counted as superseded) and reuses its buffers,
so the publisher holds at most two snapshots. A failing receiver never blocks the learner:
forming and broadcasting are bounded by `timeout_s`; on failure the group is dropped, the
result says why, and the next publication forms a new epoch with the members it is given.

The rendezvous store (a `TCPStore` server) lives here, on `store_host:store_port` (port 0
picks a free one; `store_port` tells which). `announce` must deliver the announcement to
every member (the hub forwards it), and may be called again for
the next publication before receivers finished the previous one.

## The actor's end: `WeightReceiver`

```
 socket thread                  receiver thread                      actor loop
 -------------                  ---------------                      ----------
 on_announce(ann) ---queue--->  skip announcements whose group a     at a generation boundary:
   plan_hash checked here         later one replaced                   got = poll()
                                new (store, epoch)? join the group     if got: load(got)
                                receive buckets straight into a
                                free buffer set, two in flight;
                                a newer group announced meanwhile
                                interrupts the wait
                                ready = (policy_version, buffers) --> newest ready one;
                                  (an unclaimed older one is          older unclaimed ones
                                   superseded and its buffers reused)  are dropped
```

Announcements arrive in the learner's order; every one whose group is still current is
received in turn (the learner broadcasts each one it announced). Buckets land directly in the
buffers that `poll()`'s named tensors view, so unpacking copies nothing. Those buffers are
reused: the tensors of one `poll()` stay valid until the next `poll()` that returns weights,
so the actor copies them into its engine (`load_weights` does) before polling again. At most
three buffer sets exist (receiving, ready, handed out), and none is allocated in the steady
state (fresh sets cost page faults, on a busy CPU as much as the transfer). A wrong `plan_hash`
is refused in `on_announce` (`ValueError` naming both hashes) and nothing is joined or loaded.
A failed or timed-out receive drops the group and waits for the next announcement.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import TCPStore

from asyncrl.weights.backends import (
    BroadcastError,
    BroadcastGroup,
    buffer_device,
    check_backend,
    lower_thread_priority,
    new_unique_id,
    open_group,
)
from asyncrl.weights.bucket_plan import BucketPlan, allocate_buckets, pack, unpack

log = logging.getLogger(__name__)

ANNOUNCEMENT_KEYS = (
    "policy_version",
    "plan_hash",
    "backend",
    "epoch",
    "store_host",
    "store_port",
    "world_size",
    "ranks",
    "nccl_unique_id",
)
"""Fields of a weights announcement (see `WeightPublisher`)."""


# --- the learner's end: publish -------------------------------------------------------------------


@dataclass(frozen=True)
class PublishResult:
    """How one publication went."""

    policy_version: int
    ok: bool
    epoch: int
    num_receivers: int
    num_bytes: int = 0
    snapshot_s: float = 0.0
    """Time `publish` spent copying parameters (the learner's stall)."""
    form_s: float = 0.0
    """Time spent forming a new group (0 when the epoch's group was reused)."""
    broadcast_s: float = 0.0
    error: str = ""

    @property
    def gbps(self) -> float:
        """Broadcast throughput in GB/s (1e9 bytes)."""
        return self.num_bytes / self.broadcast_s / 1e9 if self.broadcast_s > 0 else 0.0


@dataclass(frozen=True)
class PublisherStats:
    """Counters since the publisher started."""

    num_published: int = 0
    num_failed: int = 0
    num_superseded: int = 0
    bytes_sent: int = 0
    broadcast_s: float = 0.0


@dataclass
class _Job:
    policy_version: int
    buffers: Iterable[torch.Tensor]
    members: tuple[str, ...]
    snapshot_s: float
    ready: torch.cuda.Event | None


class WeightPublisher:
    """Non-blocking, bucketed publication of the learner's weights to a changing set of actors."""

    def __init__(
        self,
        plan: BucketPlan,
        *,
        backend: str = "gloo",
        store_host: str = "127.0.0.1",
        store_port: int = 0,
        timeout_s: float = 60.0,
        announce: Callable[[dict[str, Any]], None],
        nice: int = 10,
    ) -> None:
        check_backend(backend)
        if timeout_s <= 0:
            raise ValueError(f"weights.timeout_s: must be > 0, got {timeout_s}")
        self.plan, self.backend, self.timeout_s = plan, backend, timeout_s
        self.store_host = store_host
        self._store = TCPStore(
            store_host, store_port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False
        )
        self.store_port: int = self._store.port
        self._announce = announce
        self._nice = nice
        self._device = buffer_device(backend)
        self._cond = threading.Condition()
        self._queued: _Job | None = None
        self._busy = False
        self._closed = False
        self._free: list[list[torch.Tensor]] = []
        self._stats = PublisherStats()
        self._last: PublishResult | None = None
        self._group: BroadcastGroup | None = None
        self._members: tuple[str, ...] = ()
        self._epoch = 0
        self._thread = threading.Thread(
            target=self._loop, name="asyncrl-weights-publisher", daemon=True
        )
        self._thread.start()

    # -- learner thread ------------------------------------------------------------------------

    def publish(
        self,
        policy_version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        members: Sequence[str],
    ) -> None:
        """Snapshot `named_tensors` and queue their broadcast to `members`; returns at once.

        Call it from one thread. The tensors may change as soon as it returns.
        """
        if len(set(members)) != len(members):
            raise ValueError(f"publish: duplicate actor ids in members {list(members)}")
        start = time.perf_counter()
        with self._cond:
            if self._closed:
                raise ValueError("publish: the publisher is closed")
            buffers = self._take_buffers()
        try:
            pack(self.plan, dict(named_tensors), buffers)
        except BaseException:
            with self._cond:
                self._free.append(buffers)
            raise
        ready = None
        if self._device.type == "cuda":  # the snapshot copies run on the caller's stream
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._device))
        snapshot_s = time.perf_counter() - start
        job = _Job(policy_version, buffers, tuple(sorted(members)), snapshot_s, ready)
        with self._cond:
            self._queued = job
            self._cond.notify_all()

    def publish_blocking(
        self, policy_version: int, buckets: Iterator[torch.Tensor], members: Sequence[str]
    ) -> PublishResult:
        """Announce and broadcast `buckets` now, on the calling thread (a sharded learner's
        path: its buckets are gathered from the shards as they are sent, never snapshot whole).

        `buckets` is consumed to its end even when the broadcast fails: producing a bucket may
        be a collective that the learner's other ranks take part in. Use either this or
        `publish` on one publisher, not both.
        """
        if len(set(members)) != len(members):
            raise ValueError(f"publish: duplicate actor ids in members {list(members)}")
        job = _Job(policy_version, buckets, tuple(sorted(members)), 0.0, None)
        try:
            result = self._run(job)
        finally:
            for _ in buckets:  # the rest of the gathers, so that no rank waits for them
                pass
        with self._cond:
            self._record(result)
        return result

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or in flight; False if `timeout` (s) passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._queued is None and not self._busy, timeout)

    @property
    def last_result(self) -> PublishResult | None:
        """The most recent finished publication (successful or not)."""
        with self._cond:
            return self._last

    @property
    def stats(self) -> PublisherStats:
        """A copy of the counters."""
        with self._cond:
            return replace(self._stats)

    @property
    def epoch(self) -> int:
        """Current membership epoch (0 before the first group)."""
        return self._epoch

    def close(self) -> None:
        """Drop a queued publication, let the one in flight end (bounded), release everything."""
        with self._cond:
            self._closed = True
            self._queued = None
            self._cond.notify_all()
        self._thread.join(timeout=2 * self.timeout_s + 5)
        if self._thread.is_alive():
            log.warning("weights: publisher thread still busy at close; leaving it behind")
            return
        self._drop_group()

    def _take_buffers(self) -> list[torch.Tensor]:
        """The queued job's buffers (it is superseded), a free set, or a new one."""
        if self._queued is not None:
            job, self._queued = self._queued, None
            self._stats = replace(self._stats, num_superseded=self._stats.num_superseded + 1)
            log.info("weights: policy_version %d superseded before it started", job.policy_version)
            return job.buffers
        if self._free:
            return self._free.pop()
        return allocate_buckets(self.plan, self._device)

    # -- publisher thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        lower_thread_priority(self._nice)  # the transfer yields the CPU to training
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queued is not None or self._closed)
                if self._closed:
                    return
                job, self._queued, self._busy = self._queued, None, True
            result = self._run(job)
            with self._cond:
                assert isinstance(job.buffers, list)
                self._free.append(job.buffers)
                self._record(result)
                self._busy = False
                self._cond.notify_all()

    def _run(self, job: _Job) -> PublishResult:
        if not job.members:
            return PublishResult(
                job.policy_version, True, self._epoch, 0, snapshot_s=job.snapshot_s
            )
        form_s = 0.0
        try:
            fresh = self._group is None or job.members != self._members
            if fresh:
                self._next_epoch(job.members)
            unique_id = new_unique_id(self.backend) if fresh else None
            self._announce(self._announcement(job.policy_version, unique_id))
            if fresh:
                t0 = time.perf_counter()
                self._group = self._form(unique_id)
                form_s = time.perf_counter() - t0
            if job.ready is not None:
                torch.cuda.current_stream(self._device).wait_event(job.ready)
            t0 = time.perf_counter()
            assert self._group is not None
            num_bytes = self._group.broadcast(job.buffers)
            seconds = time.perf_counter() - t0
        except Exception as exc:  # the thread must survive any failure, including announce's
            log.warning("weights: publishing policy_version %d failed: %s", job.policy_version, exc)
            self._drop_group()
            return PublishResult(
                job.policy_version,
                False,
                self._epoch,
                len(job.members),
                snapshot_s=job.snapshot_s,
                form_s=form_s,
                error=f"{type(exc).__name__}: {exc}",
            )
        return PublishResult(
            job.policy_version,
            True,
            self._epoch,
            len(job.members),
            num_bytes,
            job.snapshot_s,
            form_s,
            seconds,
        )

    def _next_epoch(self, members: tuple[str, ...]) -> None:
        self._drop_group()
        self._epoch += 1
        self._members = members

    def _announcement(self, policy_version: int, unique_id: bytes | None) -> dict[str, Any]:
        return {
            "policy_version": policy_version,
            "plan_hash": self.plan.plan_hash,
            "backend": self.backend,
            "epoch": self._epoch,
            "store_host": self.store_host,
            "store_port": self.store_port,
            "world_size": len(self._members) + 1,
            "ranks": {actor: i + 1 for i, actor in enumerate(self._members)},
            "nccl_unique_id": unique_id,
        }

    def _form(self, unique_id: bytes | None) -> BroadcastGroup:
        return open_group(
            self.backend,
            self._store,
            epoch=self._epoch,
            rank=0,
            world_size=len(self._members) + 1,
            timeout_s=self.timeout_s,
            unique_id=unique_id,
        )

    def _drop_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def _record(self, result: PublishResult) -> None:
        s = self._stats
        if result.ok:
            self._stats = replace(
                s,
                num_published=s.num_published + 1,
                bytes_sent=s.bytes_sent + result.num_bytes,
                broadcast_s=s.broadcast_s + result.broadcast_s,
            )
        else:
            self._stats = replace(s, num_failed=s.num_failed + 1)
        self._last = result


# --- the actor's end: receive ---------------------------------------------------------------------


@dataclass(frozen=True)
class ReceiverStats:
    """Counters since the receiver started."""

    num_received: int = 0
    num_failed: int = 0
    num_superseded: int = 0
    num_skipped: int = 0
    """Announcements not received because a later one replaced their group."""


def _check_types(ann: Mapping[str, Any]) -> None:
    """Raise `ValueError` naming the first field of the wrong type or range."""
    for key in ("policy_version", "epoch", "store_port", "world_size"):
        if not isinstance(ann[key], int) or isinstance(ann[key], bool) or ann[key] < 0:
            raise ValueError(f"weights announcement: {key} must be an int >= 0, got {ann[key]!r}")
    for key in ("plan_hash", "backend", "store_host"):
        if not isinstance(ann[key], str):
            raise ValueError(f"weights announcement: {key} must be a string, got {ann[key]!r}")
    ranks = ann["ranks"]
    if not isinstance(ranks, Mapping) or sorted(ranks.values()) != list(
        range(1, ann["world_size"])
    ):
        raise ValueError(
            f"weights announcement: ranks must map actors to 1..world_size-1, got {ranks!r}"
        )
    if ann["nccl_unique_id"] is not None and not isinstance(ann["nccl_unique_id"], bytes):
        raise ValueError("weights announcement: nccl_unique_id must be bytes or None")


def _group_key(ann: Mapping[str, Any]) -> tuple[str, int, int]:
    return (ann["store_host"], ann["store_port"], ann["epoch"])


class WeightReceiver:
    """Receives published weights on a background thread; `poll()` hands over the newest."""

    def __init__(
        self,
        plan: BucketPlan,
        actor_id: str,
        *,
        timeout_s: float = 60.0,
        backend: str = "gloo",
        nice: int = 10,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"weights.timeout_s: must be > 0, got {timeout_s}")
        self.plan, self.actor_id, self.timeout_s, self.backend = plan, actor_id, timeout_s, backend
        self._device = buffer_device(backend)
        self._nice = nice
        self._cond = threading.Condition()
        self._queue: deque[dict[str, Any]] = deque()
        self._ready: tuple[int, list[torch.Tensor]] | None = None
        self._spare: list[list[torch.Tensor]] = []
        self._handed_out: list[torch.Tensor] | None = None
        self._closed = False
        self._stats = ReceiverStats()
        self.on_ready: Callable[[], None] | None = None
        """Called on the receiver thread each time new weights are ready for `poll()` (e.g. to
        wake a caller blocked elsewhere); must be quick and must not call back into `self`."""
        self.last_error = ""
        """Why the last receive failed ("" if none did)."""
        self._group: BroadcastGroup | None = None
        self._group_key: tuple[str, int, int] | None = None
        self._store_client: tuple[tuple[str, int], TCPStore] | None = None
        self._thread = threading.Thread(
            target=self._loop, name="asyncrl-weights-receiver", daemon=True
        )
        self._thread.start()

    # -- caller threads ------------------------------------------------------------------------

    def on_announce(self, announcement: Mapping[str, Any]) -> None:
        """Queue an announcement for the receiver thread; returns at once.

        Raises `ValueError` for a malformed announcement, another backend, or a plan whose hash
        differs from this actor's (nothing is joined or loaded then).
        """
        ann = self._validated(announcement)
        with self._cond:  # queued even when not a member: it still ends the previous group
            self._queue.append(ann)
            self._cond.notify_all()

    def poll(self) -> tuple[int, list[tuple[str, torch.Tensor]]] | None:
        """The newest fully received (policy_version, named tensors), once; None if nothing new.

        The tensors are views into receive buffers: valid until the next `poll()` that returns
        weights, which recycles them. Copy them (into the engine) before polling again.
        """
        with self._cond:
            ready, self._ready = self._ready, None
            if ready is None:
                return None
            if self._handed_out is not None:
                self._spare.append(self._handed_out)
            self._handed_out = ready[1]
        return ready[0], unpack(self.plan, ready[1])

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until `poll()` has something; False if `timeout` (s) passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._ready is not None, timeout)

    @property
    def stats(self) -> ReceiverStats:
        """A copy of the counters."""
        with self._cond:
            return replace(self._stats)

    def close(self) -> None:
        """Stop the thread (a receive in progress is interrupted) and leave the group."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=self.timeout_s + 5)
        if self._thread.is_alive():
            log.warning("weights: receiver thread still busy at close; leaving it behind")
            return
        self._drop_group()
        self._store_client = None

    def _validated(self, announcement: Mapping[str, Any]) -> dict[str, Any]:
        missing = [k for k in ANNOUNCEMENT_KEYS if k not in announcement]
        if missing:
            raise ValueError(f"weights announcement: missing fields {missing}")
        ann = dict(announcement)
        _check_types(ann)
        if ann["plan_hash"] != self.plan.plan_hash:
            raise ValueError(
                f"weights announcement: plan_hash {ann['plan_hash']} of the learner differs from "
                f"plan_hash {self.plan.plan_hash} of actor {self.actor_id}; refusing to load"
            )
        if ann["backend"] != self.backend:
            raise ValueError(
                f"weights announcement: backend {ann['backend']!r}, this actor uses {self.backend!r}"
            )
        return ann

    # -- receiver thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        lower_thread_priority(self._nice)  # receiving yields the CPU to generation
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closed)
                if self._closed:
                    return
                ann = self._queue.popleft()
                if self._replaced(ann):
                    self._stats = replace(self._stats, num_skipped=self._stats.num_skipped + 1)
                    continue
            if self.actor_id not in ann["ranks"]:
                log.info("weights: %s is not a member of epoch %d", self.actor_id, ann["epoch"])
                self._drop_group()
                continue
            self._receive(ann)

    def _replaced(self, ann: Mapping[str, Any]) -> bool:
        """True when a queued announcement belongs to another (later) group than `ann`."""
        key = _group_key(ann)
        return any(_group_key(a) != key for a in self._queue)

    def _interrupted(self) -> bool:
        with self._cond:
            return self._closed or self._replaced_current()

    def _replaced_current(self) -> bool:
        return any(_group_key(a) != self._group_key for a in self._queue)

    def _receive(self, ann: dict[str, Any]) -> None:
        buffers: list[torch.Tensor] | None = None
        try:
            if _group_key(ann) != self._group_key:
                self._join(ann)
            assert self._group is not None
            with self._cond:
                buffers = self._spare.pop() if self._spare else None
            if buffers is None:
                buffers = allocate_buckets(self.plan, self._device)
            self._group.broadcast(buffers, self._interrupted)
        except Exception as exc:  # the thread must survive; RuntimeError: store unreachable
            expected = isinstance(exc, BroadcastError | RuntimeError)
            (log.warning if expected else log.exception)(
                "weights: %s: receiving policy_version %d failed: %s",
                self.actor_id,
                ann["policy_version"],
                exc,
            )
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._drop_group()  # the buffers may still be written by a parked operation: drop them
            with self._cond:
                self._stats = replace(self._stats, num_failed=self._stats.num_failed + 1)
            return
        with self._cond:
            if self._ready is not None:
                self._spare.append(self._ready[1])
                self._stats = replace(self._stats, num_superseded=self._stats.num_superseded + 1)
            self._ready = (int(ann["policy_version"]), buffers)
            self._stats = replace(self._stats, num_received=self._stats.num_received + 1)
            self._cond.notify_all()
        if self.on_ready is not None:
            self.on_ready()

    def _join(self, ann: Mapping[str, Any]) -> None:
        self._drop_group()
        self._group = open_group(
            self.backend,
            self._store(ann["store_host"], int(ann["store_port"])),
            epoch=int(ann["epoch"]),
            rank=int(ann["ranks"][self.actor_id]),
            world_size=int(ann["world_size"]),
            timeout_s=self.timeout_s,
            unique_id=ann["nccl_unique_id"],
        )
        self._group_key = _group_key(ann)

    def _store(self, host: str, port: int) -> TCPStore:
        """A client of the learner's store, reused across epochs (a new learner: a new client)."""
        if self._store_client is None or self._store_client[0] != (host, port):
            timeout = timedelta(seconds=self.timeout_s)
            self._store_client = ((host, port), TCPStore(host, port, None, False, timeout))
        return self._store_client[1]

    def _drop_group(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group, self._group_key = None, None
