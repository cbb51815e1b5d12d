"""Broadcast groups: the protocol both backends implement, its gloo implementation and its NCCL
implementation (GPU, through `cupy.cuda.nccl`, imported lazily).

One `BroadcastGroup` is one epoch of the weight-broadcast membership: rank 0 is the learner,
ranks 1..n the actors of the announcement. Groups are formed over the learner's `TCPStore`
under a per-epoch `PrefixStore` namespace and are never the default process group (the
learner's default group trains). A group moves every bucket of a publication with
`broadcast(buffers)`, the same call on every rank: rank 0 reads the buffers, the others write
into them. Two buckets are on the wire at once: while bucket k is in flight the caller's
iterator produces bucket k+1 (the sender packs it into a staging buffer; receivers hand in the
next destination buffer), and bucket k+2 is only requested once bucket k has completed, so
two staging buffers per dtype suffice.

Failure is bounded: forming a group and every bucket wait at most `timeout_s`, and a waiter
can be interrupted (a newer epoch was announced). gloo cannot cancel an operation in flight
(`abort()` is a no-op and destroying the group blocks until its operations time out), so a
failed group is parked in a graveyard and released once its operations have finished; it is
never used again.

The NCCL broadcast group (`NcclGroup`): same contract as `GlooGroup`: one group per epoch, rank 0 sends, every rank calls
`broadcast(buffers)` with the plan's buckets in order. Differences that matter on GPUs:

- rank 0 makes a fresh NCCL unique id per epoch; it travels in the announcement
  (`nccl_unique_id`, 128 bytes). Before `ncclCommInitRank`, which cannot time out, every rank
  checks in under the epoch's store namespace and waits at most `timeout_s` for the others,
  so a dead actor fails the formation instead of hanging it;
- buckets go out on a side CUDA stream that first waits (an event, not a synchronize) for
  the caller's stream, so packing bucket k+1 on the caller's stream overlaps bucket k on the
  wire; a done event per bucket limits the window to two buckets;
- on a timeout or an interruption the communicator is aborted (`ncclCommAbort`), which ends
  its kernels; the group is not used again.

Buckets are sent as bytes (`ncclUint8`), so every plan dtype works the same way. cupy is
imported lazily: CPU machines import this module fine and only creating a group needs cupy.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, Protocol

import torch
from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroupGloo, Store

log = logging.getLogger(__name__)

WINDOW = 2
"""Buckets on the wire at once (= staging buffers needed per dtype)."""


class BroadcastError(RuntimeError):
    """A group could not be formed, or a broadcast failed, timed out or was interrupted."""


class BroadcastGroup(Protocol):
    """One epoch of the broadcast membership, formed on construction."""

    device: torch.device
    """Where this backend's buffers live."""

    def broadcast(
        self, buffers: Iterable[torch.Tensor], interrupted: Callable[[], bool] | None = None
    ) -> int:
        """Broadcast every buffer from rank 0 in order, two in flight; return bytes moved."""
        ...

    def close(self) -> None:
        """Release the group; a broken group is parked until its operations finish."""
        ...


def lower_thread_priority(nice: int) -> None:
    """Raise the calling thread's nice value (Linux: per thread, inherited by threads it starts).

    Publisher and receiver threads call this before forming groups, so the transfer and the
    gloo threads behind it yield the CPU to training and generation when cores are contended.
    """
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except OSError as exc:  # not permitted: keep the priority we have
        log.debug("weights: cannot lower thread priority: %s", exc)


def store_prefix(epoch: int) -> str:
    """Namespace of one epoch's rendezvous keys in the learner's store."""
    return f"asyncrl/weights/epoch{epoch}"


def check_backend(backend: str) -> None:
    """Raise `ValueError` unless `backend` names a broadcast backend."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weights.backend: must be 'gloo' or 'nccl', got {backend!r}")


def buffer_device(backend: str) -> torch.device:
    """Where `backend` wants its bucket buffers: the CPU for gloo, the current GPU for nccl."""
    check_backend(backend)
    return (
        torch.device("cpu")
        if backend == "gloo"
        else torch.device("cuda", torch.cuda.current_device())
    )


def new_unique_id(backend: str) -> bytes | None:
    """What rank 0 hands out for a new epoch: an NCCL unique id, or None for gloo."""
    check_backend(backend)
    if backend == "gloo":
        return None
    return nccl_unique_id()


def open_group(
    backend: str,
    store: Store,
    *,
    epoch: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    unique_id: bytes | None = None,
) -> BroadcastGroup:
    """Form the group of `backend` ("gloo" or "nccl"); blocks until all ranks joined."""
    if backend == "gloo":
        return GlooGroup(store, epoch=epoch, rank=rank, world_size=world_size, timeout_s=timeout_s)
    if backend == "nccl":
        if unique_id is None:
            raise ValueError("nccl group: the announcement carries no nccl_unique_id")
        return NcclGroup(
            store,
            epoch=epoch,
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            unique_id=unique_id,
        )
    check_backend(backend)
    raise AssertionError(backend)


class GlooGroup:
    """A `ProcessGroupGloo` over the learner's store; buffers live on the CPU."""

    device = torch.device("cpu")

    def __init__(
        self, store: Store, *, epoch: int, rank: int, world_size: int, timeout_s: float
    ) -> None:
        assert 0 <= rank < world_size, (rank, world_size)
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self._pending: deque[torch.futures.Future] = deque()
        self._broken = False
        try:
            self._pg = ProcessGroupGloo(
                PrefixStore(store_prefix(epoch), store),
                rank,
                world_size,
                timedelta(seconds=timeout_s),
            )
        except RuntimeError as exc:  # DistStoreError (a rank never came) is a RuntimeError
            raise BroadcastError(f"gloo group epoch {epoch}: forming failed: {exc}") from exc

    def broadcast(
        self, buffers: Iterable[torch.Tensor], interrupted: Callable[[], bool] | None = None
    ) -> int:
        """Broadcast every buffer from rank 0 in order, two in flight; return bytes moved."""
        if self._broken:
            raise BroadcastError("gloo group: broken by an earlier failure")
        opts = BroadcastOptions()
        opts.rootRank = 0
        nbytes = 0
        try:
            for buf in buffers:
                # as bytes: gloo then moves any dtype (bfloat16, float8) as a plain copy
                self._pending.append(self._pg.broadcast([buf.view(torch.uint8)], opts).get_future())
                nbytes += buf.numel() * buf.element_size()
                if len(self._pending) == WINDOW:
                    self._wait_oldest(interrupted)
            while self._pending:
                self._wait_oldest(interrupted)
        except BroadcastError:
            self._broken = True
            raise
        return nbytes

    def _wait_oldest(self, interrupted: Callable[[], bool] | None) -> None:
        wait_future(self._pending[0], self.timeout_s, interrupted)
        self._pending.popleft()  # only once done: `close` parks whatever is still pending

    def close(self) -> None:
        """Release the group; a broken one is parked until its operations finish."""
        pending = [f for f in self._pending if not f.done()]
        if pending:
            graveyard.park(self._pg, pending)
        self._pending.clear()
        del self._pg


def wait_future(
    fut: torch.futures.Future, timeout_s: float, interrupted: Callable[[], bool] | None = None
) -> None:
    """Wait for one operation; raise `BroadcastError` on its failure, timeout or interruption."""
    done = threading.Event()
    fut.add_done_callback(lambda _: done.set())
    deadline = time.monotonic() + timeout_s
    while not done.wait(0.05):
        if interrupted is not None and interrupted():
            raise BroadcastError("interrupted: a newer group was announced")
        if time.monotonic() > deadline:
            raise BroadcastError(f"broadcast timed out after {timeout_s:.1f} s")
    try:
        fut.wait()
    except RuntimeError as exc:
        raise BroadcastError(f"broadcast failed: {exc}") from exc


class _Graveyard:
    """Keeps abandoned groups alive until their operations end (deleting earlier blocks)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._graves: list[tuple[object, list[torch.futures.Future]]] = []

    def park(self, group: object, pending: list[torch.futures.Future]) -> None:
        """Hold `group` until every future in `pending` is done."""
        with self._lock:
            self._graves.append((group, pending))
            self._graves = [(g, fs) for g, fs in self._graves if not all(f.done() for f in fs)]
            log.info("weights: parked a broken group (%d parked)", len(self._graves))

    def __len__(self) -> int:
        with self._lock:
            return len(self._graves)


graveyard = _Graveyard()
"""Broken groups of this process waiting for their operations to time out."""


def nccl_unique_id() -> bytes:
    """A fresh NCCL unique id as 128 bytes (cupy returns bytes or, in older versions, ints)."""
    from cupy.cuda import nccl

    uid = nccl.get_unique_id()
    return uid if isinstance(uid, bytes) else bytes(v % 256 for v in uid)


class NcclGroup:
    """An NCCL communicator on the current CUDA device, formed for one epoch."""

    def __init__(
        self,
        store: Store,
        *,
        epoch: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        unique_id: bytes,
    ) -> None:
        assert 0 <= rank < world_size, (rank, world_size)
        import cupy
        from cupy.cuda import nccl

        self._nccl = nccl
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._cupy_device = cupy.cuda.Device(self.device.index)
        _check_in(PrefixStore(store_prefix(epoch) + "/nccl", store), rank, world_size, timeout_s)
        with self._cupy_device:
            self._comm = _communicator(nccl, world_size, unique_id, rank)
        self._stream = torch.cuda.Stream(device=self.device)
        self._broken = False

    def broadcast(
        self, buffers: Iterable[torch.Tensor], interrupted: Callable[[], bool] | None = None
    ) -> int:
        """Broadcast every buffer from rank 0 on the side stream, two in flight; return bytes."""
        if self._broken:
            raise BroadcastError("nccl group: broken by an earlier failure")
        pending: deque[torch.cuda.Event] = deque()
        nbytes = 0
        try:
            for buf in buffers:
                pending.append(self._issue(buf))
                nbytes += buf.numel() * buf.element_size()
                if len(pending) == WINDOW:
                    self._wait(pending.popleft(), interrupted)
            while pending:
                self._wait(pending.popleft(), interrupted)
        except BroadcastError:
            self._broken = True
            self._comm.abort()
            raise
        return nbytes

    def close(self) -> None:
        """Destroy the communicator (a broken one was aborted already)."""
        if not self._broken:
            self._comm.destroy()

    def _issue(self, buf: torch.Tensor) -> torch.cuda.Event:
        assert buf.is_cuda and buf.is_contiguous() and buf.dim() == 1, (
            "buckets are flat CUDA buffers"
        )
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self._stream.wait_event(ready)
        raw = buf.view(torch.uint8)
        with self._cupy_device:
            self._comm.bcast(
                raw.data_ptr(), raw.numel(), self._nccl.NCCL_UINT8, 0, self._stream.cuda_stream
            )
        buf.record_stream(self._stream)
        done = torch.cuda.Event()
        done.record(self._stream)
        return done

    def _wait(self, done: torch.cuda.Event, interrupted: Callable[[], bool] | None) -> None:
        deadline = time.monotonic() + self.timeout_s
        pause = 1e-4
        while not done.query():
            if interrupted is not None and interrupted():
                raise BroadcastError("interrupted: a newer group was announced")
            if time.monotonic() > deadline:
                raise BroadcastError(f"nccl broadcast timed out after {self.timeout_s:.1f} s")
            try:
                self._comm.check_async_error()
            except Exception as exc:  # cupy's NcclError
                raise BroadcastError(f"nccl broadcast failed: {exc}") from exc
            time.sleep(pause)
            pause = min(pause * 2, 5e-3)


def _check_in(store: Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Every rank announces itself, then waits (bounded) for all others."""
    store.set(f"joined/{rank}", b"1")
    try:
        store.wait([f"joined/{r}" for r in range(world_size)], timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise BroadcastError(
            f"nccl group: not every rank joined within {timeout_s:.1f} s: {exc}"
        ) from exc


def _communicator(nccl: Any, world_size: int, unique_id: bytes, rank: int) -> Any:
    """`NcclCommunicator` takes bytes in current cupy and a tuple of signed chars in older ones."""
    try:
        return nccl.NcclCommunicator(world_size, unique_id, rank)
    except TypeError:
        legacy = tuple(b - 256 if b > 127 else b for b in unique_id)
        return nccl.NcclCommunicator(world_size, legacy, rank)
