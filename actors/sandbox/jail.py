"""What runs inside a sandbox execution: namespaces, mounts, the jail's init and the runner.

Imported by `zygote.py` (standard library only; it runs with `python -I -S`). The zygote forks
A (`fork_init`): A joins the worker's pids cgroup, unshares a pid and a mount namespace and
forks B (`init_main`), pid 1 there (an IPC namespace of its own too), which mounts /proc, waits for its job on a socket, mounts a
private tmpfs /tmp, forks C (`runner_main`) and reaps everything; C chroots into the read-only
root, sets rlimits, drops to the run's own uid and runs the code as `__main__`.
"""

import ctypes
import fcntl
import json
import os
import resource
import signal
import socket
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUTS = 0x04000000
PR_SET_NO_NEW_PRIVS = 38
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
    _unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWUTS, "net+mount+uts")
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


def fork_init(cgroup: str | None, root: str, sock_fd: int, pipes: tuple, pid_w: int) -> None:
    """A: join the pids cgroup, unshare pid+mount ns, fork B, report B's pid; never returns."""
    code = 0
    try:
        keep_only({sock_fd, pid_w, *pipes})
        if cgroup:
            with open(cgroup + "/cgroup.procs", "w") as f:
                f.write("0")
        _unshare(CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC, "pid+mount+ipc")
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
        for fd in (stdin_fd, out_w, err_w, *extra_fds.values()):
            os.close(fd)  # C's alone now: its output ends when C and its children are gone
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
        _libc_call(LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
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
