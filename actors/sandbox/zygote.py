r"""The sandbox worker: an isolated, pre-started process that forks one fresh jail per execution.

Run as a script (`python -I -S zygote.py`, standard library only) by `actors/sandbox/pool.py`.
At start it enters its own network namespace (no interfaces up, loopback included) and mount
namespace, builds a read-only root (the system's /usr and the interpreter's prefix bound
read-only, site-packages masked, a few /dev nodes) and then waits for jobs on stdin.

```
 host --job--> zygote --fork--> A (joins the pids cgroup, unshares pid+mount ns)
                  ^                \--fork--> B = pid 1 of a new pid ns: private tmpfs /tmp,
                  |                           fresh /proc, reaps everything, reports C's status
                  |                              \--fork--> C: chroot, rlimits, uid drop, clean
                  |                                        env and fds, exec(code) as __main__
                  +-- stdout/stderr/status pipes (capped, deadline) <--+
 host <--result--+   on deadline or overflow: SIGKILL B, the kernel ends the whole pid namespace
```

The zygote never runs untrusted code; each execution is a fork of it, so nothing of one run is
visible to the next. Program blobs are read into bytearrays that are zeroed once forked, and a
linked job forks its first program before it reads the second, so the candidate of a linked
pair never holds the other program's text in memory.

Wire (both ways): 4-byte big-endian length + JSON. A job header lists its programs with the
byte length of each program's blob (JSON {"code", "stdin", "files"}), which follows raw.
"""

import json
import os
import select
import signal
import socket
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # jail.py beside this script
from jail import fork_init, setup  # noqa: E402


def _read_exact(fd: int, size: int) -> bytearray:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise EOFError
        got += n
    return buf


def read_message(fd: int) -> dict:
    (size,) = struct.unpack(">I", bytes(_read_exact(fd, 4)))
    return json.loads(bytes(_read_exact(fd, size)))


def write_message(fd: int, obj: dict) -> None:
    data = json.dumps(obj).encode()
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(fd, data) :]


class Tree:
    """One execution: the pid of its namespace's init (B) and the pipes it reports on."""

    def __init__(self, b_pid: int, out_r: int, err_r: int, status_r: int, limits: dict) -> None:
        self.b_pid, self.limits = b_pid, limits
        self.streams = {out_r: bytearray(), err_r: bytearray(), status_r: bytearray()}
        self.out_r, self.err_r, self.status_r = out_r, err_r, status_r
        self.start, self.end = time.monotonic(), None
        self.reason = None  # "timeout" / "output_limit" when we killed it
        self.wait_status = None

    def kill(self, reason: str) -> None:
        if self.reason is None and self.end is None:
            self.reason = reason
        try:
            os.kill(self.b_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def output_bytes(self) -> int:
        return len(self.streams[self.out_r]) + len(self.streams[self.err_r])


class Jail:
    """A pre-forked execution: B (pid 1 of a fresh pid ns, /proc mounted) waits for its job."""

    def __init__(self, cgroup: str | None, root: str) -> None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        st_r, st_w = os.pipe()
        pid_r, pid_w = os.pipe()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.a_pid = os.fork()
        if self.a_pid == 0:
            mine.close()
            fork_init(cgroup, root, theirs.fileno(), (out_w, err_w, st_w), pid_w)
        for fd in (out_w, err_w, st_w, pid_w):
            os.close(fd)
        theirs.close()
        self.sock, self.pid_r = mine, pid_r
        self.out_r, self.err_r, self.st_r = out_r, err_r, st_r

    def start(self, prog: dict, blob: bytearray, extra_fds: dict, uid: int) -> Tree:
        """Hand B its program; the running tree."""
        raw = os.read(self.pid_r, 32)
        try:
            os.waitpid(self.a_pid, 0)
        except ChildProcessError:
            pass  # already reaped with the orphans of an earlier job
        os.close(self.pid_r)
        tree = Tree(int(raw) if raw else -1, self.out_r, self.err_r, self.st_r, prog["limits"])
        header = {"limits": prog["limits"], "uid": uid, "blob_bytes": len(blob)}
        header["targets"] = list(extra_fds)
        try:
            socket.send_fds(self.sock, [json.dumps(header).encode()], list(extra_fds.values()))
            view = memoryview(blob)
            for offset in range(0, len(blob), 32768):
                self.sock.send(view[offset : offset + 32768])
        except OSError:
            tree.kill("killed")  # B is gone; its status pipe reports a setup error
        self.sock.close()
        return tree


def supervise(trees: list, verdict_fd: int | None, deadline: float) -> bytearray:
    """Collect every tree's output until all have reported; enforce deadline and output caps."""
    verdict = bytearray()
    fds = {fd: tree for tree in trees for fd in tree.streams}
    if verdict_fd is not None:
        fds[verdict_fd] = None
    while fds:
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            for tree in trees:
                tree.kill("timeout")
            timeout = 5.0
        ready, _, _ = select.select(list(fds), [], [], timeout)
        for fd in ready:
            if fd not in fds:
                continue  # closed above in this round
            data = os.read(fd, 65536)
            tree = fds[fd]
            if not data:
                os.close(fd)
                del fds[fd]
                if tree is not None and fd == tree.status_r:
                    tree.end = time.monotonic()
                    if tree is trees[-1]:  # the last program (a pair's judge) ends the job
                        for other in trees[:-1]:
                            other.kill("done")
                            for gone in [f for f in fds if fds[f] is other]:
                                os.close(gone)  # no need to wait for its namespace to end
                                del fds[gone]
                continue
            if tree is None:
                verdict += data[: 65536 - len(verdict)]
                continue
            tree.streams[fd] += data
            if fd != tree.status_r and tree.output_bytes() > tree.limits["max_output_bytes"]:
                tree.kill("output_limit")
    return verdict


def finish(tree: Tree) -> dict:
    """Reap B and turn what the tree reported into an ExecResult-shaped dict."""
    report = json.loads(bytes(tree.streams[tree.status_r]) or b"{}")
    if tree.b_pid > 0 and not report and tree.reason != "done":
        os.waitpid(tree.b_pid, 0)  # killed: its pid namespace is gone once B is reaped
    # (B that reported had already killed and reaped everything; it is reaped later)
    end = tree.end or time.monotonic()
    limit = tree.limits["max_output_bytes"]
    stdout = bytes(tree.streams[tree.out_r][:limit])
    stderr = bytes(tree.streams[tree.err_r][: max(0, limit - len(stdout))])
    result = {
        "stdout": stdout.decode("utf-8", "replace"),
        "stderr": stderr.decode("utf-8", "replace"),
        "wall_s": end - tree.start,
        "cpu_s": report.get("cpu_s", 0.0),
        "max_rss_mb": report.get("max_rss_mb", 0.0),
        "exit_code": None,
    }
    if "setup_error" in report:
        result.update(status="setup_error", stderr=report["setup_error"])
        return result
    status = report.get("wait_status")
    if status is not None and os.WIFEXITED(status):
        result["exit_code"] = os.WEXITSTATUS(status)
    result["status"] = classify(tree, status, result)
    return result


def classify(tree: Tree, status: int | None, result: dict) -> str:
    if tree.reason in ("timeout", "output_limit"):
        return tree.reason
    if tree.reason == "done" and (status is None or os.WIFSIGNALED(status)):
        return "ok"  # ended by the worker because its judge had finished
    if status is None:
        return "killed"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        over_cpu = result["cpu_s"] >= tree.limits["cpu_s"]
        return (
            "timeout" if sig == signal.SIGXCPU or (sig == signal.SIGKILL and over_cpu) else "killed"
        )
    if result["exit_code"] == 0:
        return "ok"
    last = result["stderr"].rstrip().rsplit("\n", 1)[-1]
    return "memory" if last.startswith("MemoryError") else "error"


def run_job(header: dict, config: dict) -> dict:
    """Launch the job's programs (linked by pipes when there are two), supervise, report."""
    progs = header["programs"]
    links, verdict_r = {}, None
    if len(progs) == 2:
        c2j_r, c2j_w = os.pipe()
        j2c_r, j2c_w = os.pipe()
        verdict_r, verdict_w = os.pipe()
        links = [{3: j2c_r, 4: c2j_w}, {3: c2j_r, 4: j2c_w, 5: verdict_w}]
    trees = []
    for index, prog in enumerate(progs):
        blob = _read_exact(0, prog["blob_bytes"])
        set_pids_max(config, prog["limits"]["max_procs"] * len(progs))
        jail = WARM.pop(0) if WARM else Jail(config["cgroup"], config["root"])
        uid = config["uid"] + index
        trees.append(jail.start(prog, blob, links[index] if links else {}, uid))
        blob[:] = bytes(len(blob))
    for fd in (fd for link in links for fd in link.values()):
        os.close(fd)
    timeout = max(p["limits"]["timeout_s"] for p in progs)
    verdict = supervise(trees, verdict_r, trees[0].start + timeout)
    results = [finish(tree) for tree in trees]
    reap_orphans()
    return {"results": results, "verdict": verdict.decode("utf-8", "replace")}


WARM: list[Jail] = []
"""Jails forked ahead (for two jobs like the last one), so a job rarely waits for one."""


def set_pids_max(config: dict, count: int) -> None:
    """The worker's pids cgroup bounds the run's processes plus the jails waiting beside it
    (each run's own uid has RLIMIT_NPROC = max_procs as well)."""
    if config["cgroup"]:
        with open(config["cgroup"] + "/pids.max", "w") as f:
            f.write(str(count + 2 + len(WARM) + 2))


def reap_orphans() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main() -> None:
    config = read_message(0)
    try:
        setup(config)
    except OSError as exc:
        write_message(1, {"error": f"sandbox isolation failed: {exc}"})
        return
    WARM.append(Jail(config["cgroup"], config["root"]))
    write_message(1, {"ready": True})
    while True:
        try:
            header = read_message(0)
        except EOFError:
            return
        write_message(1, run_job(header, config))
        while len(WARM) < 2 * len(header["programs"]):  # two jobs ahead
            WARM.append(Jail(config["cgroup"], config["root"]))


if __name__ == "__main__":
    main()
