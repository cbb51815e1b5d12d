"""The sandbox pool: pre-started isolated workers that run untrusted code, one fresh jail a run.

```
 thread --run(code)--> idle queue --> worker (zygote.py, own net+mount ns, read-only root)
                                        | fork per run: own pid ns, private /tmp, rlimits,
                                        | pids cgroup, unprivileged uid, clean env and fds
 thread <--ExecResult-- JSON reply <----+ (wall-clock deadline kills the whole pid namespace)
```

Each worker serves one run at a time; `run` takes an idle worker from a queue, so many threads
may call it at once. Isolation that cannot be made here is refused with the reason
(`isolation_problem`), never silently weakened.
"""

from __future__ import annotations

import functools
import glob
import itertools
import json
import os
import queue
import select
import shutil
import site
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

ZYGOTE = Path(__file__).with_name("zygote.py")
CGROUP_PIDS = Path("/sys/fs/cgroup/pids")
_SERIALS = itertools.count()
Status = Literal["ok", "error", "timeout", "memory", "output_limit", "killed"]


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program it ran): no isolation, a worker died."""


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Limits of one execution."""

    timeout_s: float = 10.0
    """Wall-clock limit; at it the whole process tree is killed (status "timeout")."""
    cpu_s: float = 10.0
    """CPU-time limit (RLIMIT_CPU, rounded up to whole seconds)."""
    memory_mb: int = 512
    """Address-space limit (RLIMIT_AS) in MiB."""
    max_output_bytes: int = 65536
    """stdout + stderr beyond this kills the run (status "output_limit")."""
    max_procs: int = 32
    """Processes at once (pids cgroup and RLIMIT_NPROC of the run's own uid)."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    max_file_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE), MiB; its /tmp holds 4x this."""

    def __post_init__(self) -> None:
        for key, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"sandbox.{key}: must be > 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ExecResult:
    """What one execution did."""

    status: Status
    """ok (exit 0), error (non-zero exit), timeout (wall or CPU), memory (MemoryError),
    output_limit, killed (ended by a signal)."""
    exit_code: int | None
    """Exit status when the program exited on its own, else None."""
    stdout: str
    """Captured stdout (at most `max_output_bytes`, decoded as UTF-8 with replacement)."""
    stderr: str
    """Captured stderr (what fits beside stdout)."""
    wall_s: float
    """Wall-clock time of the run."""
    cpu_s: float
    """User + system CPU time of the program and the children it waited for."""
    max_rss_mb: float
    """Peak resident memory of the program, MiB."""

    def to_json(self) -> dict[str, Any]:
        """Plain dict for JSON output."""
        return asdict(self)


@functools.cache
def isolation_problem() -> str | None:
    """Why the sandbox cannot isolate code on this machine, or None when it can (probed once
    per process: a child tries to unshare every namespace a run uses)."""
    if sys.platform != "linux":
        return f"needs Linux namespaces, this is {sys.platform}"
    if os.geteuid() != 0:
        return "needs root to create network, pid and mount namespaces and drop to a spare uid"
    probe = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "if libc.unshare(0x20000000 | 0x40000000 | 0x00020000 | 0x08000000 | 0x04000000):\n"
        "    raise SystemExit('unshare(pid+net+mount+ipc+uts): ' + os.strerror(ctypes.get_errno()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True, env={}
    )
    if done.returncode != 0:
        return (done.stderr.strip() or f"namespace probe exited {done.returncode}")[-300:]
    return None


def _root_binds() -> tuple[list[str], list[str]]:
    """Read-only paths of the jail's root and the package dirs masked inside them."""
    binds = ["/usr", "/bin", "/lib", "/lib64", "/sbin"]
    for prefix in {sys.base_prefix, sys.prefix}:
        if not prefix.startswith("/usr/"):
            binds.append(prefix)
    masks = list(site.getsitepackages()) + [site.getusersitepackages()]
    masks += glob.glob("/usr/lib/python3*/*-packages") + glob.glob(
        "/usr/local/lib/python3*/*-pack*"
    )
    return binds, sorted({os.path.realpath(m) for m in masks})


class _Worker:
    """One zygote process and its pipes; used by one run at a time."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.root = tempfile.mkdtemp(prefix="asyncrl-sandbox-")
        serial = next(_SERIALS)  # unique in this process: uid pair and cgroup of its own
        self.uid = 1_000_000 + ((os.getpid() % 100_000) * 1024 + serial % 1024) * 2
        self.cgroup: str | None = None
        if os.access(CGROUP_PIDS, os.W_OK):
            path = CGROUP_PIDS / f"asyncrl-sandbox-{os.getpid()}-{serial}"
            path.mkdir(exist_ok=True)
            self.cgroup = str(path)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(ZYGOTE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={},
            cwd="/",
            start_new_session=True,
        )
        binds, masks = _root_binds()
        config = {"root": self.root, "binds": binds, "masks": masks, "uid": self.uid}
        self._send(dict(config, cgroup=self.cgroup), [])

    def wait_ready(self) -> None:
        reply = self._receive(time.monotonic() + 60.0)
        if not reply.get("ready"):
            raise SandboxError(reply.get("error", f"sandbox worker did not start: {reply}"))

    def _send(self, header: dict, blobs: list[bytes]) -> None:
        data = json.dumps(header).encode()
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(struct.pack(">I", len(data)) + data + b"".join(blobs))
        self.proc.stdin.flush()

    def _read(self, size: int, deadline: float) -> bytes:
        assert self.proc is not None and self.proc.stdout is not None
        fd, chunks, got = self.proc.stdout.fileno(), [], 0
        while got < size:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise SandboxError("sandbox worker did not answer in time")
            chunk = os.read(fd, size - got)
            if not chunk:
                raise SandboxError(f"sandbox worker exited (code {self.proc.poll()})")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _receive(self, deadline: float) -> dict:
        (size,) = struct.unpack(">I", self._read(4, deadline))
        return json.loads(self._read(size, deadline))

    def job(self, programs: list[dict], limits: SandboxLimits) -> dict:
        """Send one job (1 program, or a linked candidate + judge pair), return the reply."""
        blobs = [json.dumps(p).encode() for p in programs]
        header = {"programs": [{"limits": asdict(limits), "blob_bytes": len(b)} for b in blobs]}
        try:
            if self.proc is None:  # stopped after a failure: start afresh
                self.start()
                self.wait_ready()
            self._send(header, blobs)
            return self._receive(time.monotonic() + limits.timeout_s + 30.0)
        except (OSError, SandboxError) as exc:
            self.stop()
            raise SandboxError(f"sandbox worker failed: {exc}") from exc

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
        if self.proc is not None:
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                try:
                    if pipe is not None:
                        pipe.close()
                except OSError:  # unsent job bytes of a dead worker
                    pass
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
        for _ in range(50 if self.cgroup else 0):
            try:
                os.rmdir(self.cgroup)
                break
            except FileNotFoundError:
                break
            except OSError:  # EBUSY: a killed run's processes are still leaving
                time.sleep(0.02)


class Sandbox:
    """A pool of isolated workers; thread-safe: many threads may call `run` at once."""

    def __init__(self, num_workers: int = 2, limits: SandboxLimits = SandboxLimits()) -> None:
        if num_workers < 1:
            raise ValueError(f"sandbox.num_workers: must be >= 1, got {num_workers}")
        problem = isolation_problem()
        if problem is not None:
            raise SandboxError(f"sandbox refuses to run untrusted code here: {problem}")
        self.limits = limits
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._workers = [_Worker(i) for i in range(num_workers)]
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_all, self._workers)
        try:
            for worker in self._workers:
                worker.start()
            for worker in self._workers:
                worker.wait_ready()
                self._idle.put(worker)
        except BaseException:
            self.close()
            raise

    def run(
        self,
        code: str,
        *,
        stdin: str = "",
        limits: SandboxLimits | None = None,
        files: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run `code` as a Python program in a fresh jail; `files` are written to its /tmp."""
        program = {"code": code, "stdin": stdin, "files": _checked_files(files)}
        reply = self._job([program], limits or self.limits)
        return _result(reply["results"][0])

    def run_linked(
        self, candidate: Mapping[str, Any], judge: Mapping[str, Any], limits: SandboxLimits
    ) -> tuple[ExecResult, ExecResult, str]:
        """Run two programs in separate jails (own pid ns, own uid) joined by two pipes.

        The candidate reads fd 3 and writes fd 4; the judge reads fd 3, writes fd 4, and
        writes its verdict to fd 5, which only the worker reads. The job ends when the judge
        ends. Returns (candidate result, judge result, verdict text)."""
        programs = [
            {"code": p["code"], "files": _checked_files(p.get("files"))} for p in (candidate, judge)
        ]
        reply = self._job(programs, limits)
        results = reply["results"]
        return _result(results[0]), _result(results[1]), reply["verdict"]

    def _job(self, programs: list[dict], limits: SandboxLimits) -> dict:
        if self._closed:
            raise SandboxError("sandbox is closed")
        worker = self._idle.get()
        try:
            reply = worker.job(programs, limits)
        finally:
            self._idle.put(worker)  # a failed worker is stopped; its next job restarts it
        for result in reply["results"]:
            if result["status"] == "setup_error":
                raise SandboxError(f"sandbox could not set up a run: {result['stderr']}")
        return reply

    def close(self) -> None:
        """Stop every worker and remove its files."""
        with self._lock:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SHARED: Sandbox | None = None
_SHARED_LOCK = threading.Lock()


def shared_pool() -> Sandbox:
    """The process-wide pool (created on first use: one worker per CPU, at most 8; closed at
    exit). Environments and tools share it so a process pays for its workers once."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = Sandbox(num_workers=min(8, os.cpu_count() or 2))
        return _SHARED


def _close_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.close()


def _checked_files(files: Mapping[str, str] | None) -> dict[str, str]:
    out = {}
    for name, text in (files or {}).items():
        norm = os.path.normpath(name)
        if norm.startswith(("/", "..")) or norm == ".":
            raise ValueError(f"files: {name!r} must be a relative path inside the sandbox dir")
        out[norm] = str(text)
    return out


def _result(raw: dict) -> ExecResult:
    return ExecResult(**{k: raw[k] for k in ExecResult.__dataclass_fields__})
