"""The NCCL broadcast group (GPU), through `cupy.cuda.nccl`.

Same contract as `gloo_backend.GlooGroup`: one group per epoch, rank 0 sends, every rank calls
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

import time
from collections import deque
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import PrefixStore, Store

from asyncrl.weights.gloo_backend import WINDOW, BroadcastError, store_prefix


def new_unique_id() -> bytes:
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
