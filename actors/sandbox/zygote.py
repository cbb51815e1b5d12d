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

import ctypes
import fcntl
import json
import os
import resource
import select
import signal
import socket
import struct
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_CHILD_SUBREAPER = 36
DEV_NODES = ("null", "zero", "full", "random", "urandom")
LIBC = ctypes.CDLL(None, use_errno=True)


def _libc_call(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str = "") -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    ret = LIBC.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data or None))
    _libc_call(ret, f"mount {dst}")


def _unshare(flags: int, what: str) -> None:
    _libc_call(LIBC.unshare(ctypes.c_int(flags)), f"unshare({what})")


def setup(config: dict) -> None:
    """Enter the worker's namespaces and build the read-only root under config["root"]."""
    _unshare(CLONE_NEWNS | CLONE_NEWNET, "net+mount")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = config["root"]
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in config["binds"]:
        target = root + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.readlink(path), target)
        elif os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
            _mount(path, target, None, MS_BIND | MS_REC)
            _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID)
    for path in config["masks"]:
        if os.path.isdir(root + path):
            _mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")
    for name in ("tmp", "proc", "dev"):
        os.makedirs(f"{root}/{name}", exist_ok=True)
    for node in DEV_NODES:
        open(f"{root}/dev/{node}", "w").close()
        _mount(f"/dev/{node}", f"{root}/dev/{node}", None, MS_BIND)
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _libc_call(LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(SUBREAPER)")


def keep_only(fds: set) -> None:
    """Close every open descriptor of this process except `fds`."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in fds:
            try:
                os.close(fd)
            except OSError:
                pass


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


def fork_init(cgroup: str | None, root: str, sock_fd: int, pipes: tuple, pid_w: int) -> None:
    """A: join the pids cgroup, unshare pid+mount ns, fork B, report B's pid; never returns."""
    code = 0
    try:
        keep_only({sock_fd, pid_w, *pipes})
        if cgroup:
            with open(cgroup + "/cgroup.procs", "w") as f:
                f.write("0")
        _unshare(CLONE_NEWPID | CLONE_NEWNS, "pid+mount")
        b_pid = os.fork()
        if b_pid == 0:
            os.close(pid_w)
            init_main(root, sock_fd, pipes)
        os.write(pid_w, str(b_pid).encode())
    except BaseException as exc:  # report, never hang the zygote
        os.write(pipes[2], json.dumps({"setup_error": repr(exc)}).encode())
        code = 1
    os._exit(code)


def receive_job(sock_fd: int) -> tuple[dict, bytearray, dict]:
    """B: the job header, the program blob and the descriptors passed along."""
    sock = socket.socket(fileno=sock_fd)
    raw, fds, _, _ = socket.recv_fds(sock, 65536, 8)
    if not raw:
        os._exit(0)  # the worker is shutting down
    header = json.loads(raw)
    blob = bytearray()
    while len(blob) < header["blob_bytes"]:
        chunk = sock.recv(65536)
        if not chunk:
            raise EOFError("job blob cut short")
        blob += chunk
    sock.close()
    return header, blob, dict(zip(header["targets"], fds, strict=True))


def init_main(root: str, sock_fd: int, pipes: tuple) -> None:
    """B: pid 1 of the execution's pid namespace. Waits for its job, runs C, reaps all."""
    out_w, err_w, st_w = pipes
    report = {}
    try:
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        header, blob, extra_fds = receive_job(sock_fd)
        limits, uid = header["limits"], header["uid"]
        job = json.loads(bytes(blob))
        blob[:] = bytes(len(blob))
        work = root + "/tmp"
        size_mb = max(4 * limits["max_file_mb"], 16)
        _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,mode=0700")
        os.chown(work, uid, uid)
        for name, text in (job.get("files") or {}).items():
            path = os.path.normpath(os.path.join(work, name))
            assert path.startswith(work + "/"), f"file name leaves the sandbox dir: {name!r}"
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
            os.chown(path, uid, uid)
        stdin_fd = os.memfd_create("stdin")
        os.write(stdin_fd, job.get("stdin", "").encode())
        os.lseek(stdin_fd, 0, 0)
        c_pid = os.fork()
        if c_pid == 0:
            runner_main(job["code"], root, limits, uid, [stdin_fd, out_w, err_w], extra_fds)
        report = reap_until(c_pid)
        try:
            os.kill(-1, signal.SIGKILL)  # whatever C left behind, before the run is reported
        except ProcessLookupError:
            pass  # nothing was left
        reap_all()
    except BaseException as exc:  # report, never hang the zygote
        report = {"setup_error": repr(exc)}
    os.write(st_w, json.dumps(report).encode())
    os._exit(0)


def reap_all() -> None:
    while True:
        try:
            os.wait4(-1, 0)
        except ChildProcessError:
            return


def reap_until(c_pid: int) -> dict:
    """Reap every child of the namespace until C exits; C's wait status and resource use."""
    while True:
        pid, status, usage = os.wait4(-1, 0)
        if pid == c_pid:
            return {
                "wait_status": status,
                "cpu_s": usage.ru_utime + usage.ru_stime,
                "max_rss_mb": usage.ru_maxrss / 1024.0,
            }


def runner_main(code: str, root: str, limits: dict, uid: int, stdio: list, extra: dict) -> None:
    """C: enter the jail and run `code` as __main__; never returns."""
    exit_code = 1
    try:
        wanted = dict(enumerate(stdio)) | {int(t): fd for t, fd in extra.items()}
        high = {t: fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for t, fd in wanted.items()}
        for target, fd in high.items():
            os.dup2(fd, target)
        os.closerange(3 + len(extra), 65536)
        os.chroot(root)
        os.chdir("/tmp")
        set_limits(limits)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        os.umask(0o077)
        os.environ.clear()
        os.environ.update({"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"})
        exit_code = run_main(code)
    finally:
        os._exit(exit_code)


def set_limits(limits: dict) -> None:
    cpu = max(1, int(limits["cpu_s"] + 0.999))
    memory = limits["memory_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["max_file_mb"] << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_procs"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_main(code: str) -> int:
    """Execute `code` in a fresh __main__ with fresh std streams; the process exit code."""
    import io
    import traceback
    import types

    utf8 = {"encoding": "utf-8", "errors": "backslashreplace"}
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r")), **utf8)
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w")), **utf8)
    sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w")), write_through=True, **utf8)
    sys.argv = ["/tmp/main.py"]
    main = types.ModuleType("__main__")
    main.__file__ = "/tmp/main.py"
    sys.modules["__main__"] = main
    exit_code = 0
    try:
        exec(compile(code, "/tmp/main.py", "exec"), main.__dict__)
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # the program's own failure: traceback to its stderr
        traceback.print_exc()
        exit_code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # a closed or broken stream loses only the program's output
            pass
    return exit_code & 0xFF


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
"""Jails forked ahead of the next job (as many as the last job had programs)."""


def set_pids_max(config: dict, count: int) -> None:
    if config["cgroup"]:
        with open(config["cgroup"] + "/pids.max", "w") as f:
            f.write(str(count + 2))


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
        while len(WARM) < len(header["programs"]):
            WARM.append(Jail(config["cgroup"], config["root"]))


if __name__ == "__main__":
    main()
