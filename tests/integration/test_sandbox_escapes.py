"""Escapes tried against the real sandbox (real namespaces, real processes), each contained."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.sandbox import Sandbox, SandboxError, SandboxLimits, isolation_problem

REPO = Path(__file__).resolve().parents[2]
SECRET = "hunter2-not-for-the-sandbox"

pytestmark = pytest.mark.skipif(
    isolation_problem() is not None, reason=f"no isolation here: {isolation_problem()}"
)


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    os.environ["ASYNCRL_TEST_SECRET"] = SECRET
    try:
        with Sandbox(num_workers=2, limits=SandboxLimits(timeout_s=5.0, cpu_s=5.0)) as pool:
            yield pool
    finally:
        del os.environ["ASYNCRL_TEST_SECRET"]


def _processes_with(marker: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if marker in comm:
            found.append(pid)
    return found


def test_statuses(sandbox: Sandbox) -> None:
    short = SandboxLimits(timeout_s=1.0, cpu_s=5.0, memory_mb=256, max_output_bytes=1000)
    cases = {
        "print('fine')": "ok",
        "raise ValueError('no')": "error",
        "import time\ntime.sleep(30)": "timeout",
        "x = bytearray(1 << 30)": "memory",
        "while True: print('y' * 100)": "output_limit",
        "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)": "killed",
    }
    for code, status in cases.items():
        result = sandbox.run(code, limits=short)
        assert result.status == status, (code, result)
    ok = sandbox.run("import sys; print(sys.stdin.read().upper()); sys.exit(0)", stdin="abc")
    assert (ok.status, ok.exit_code, ok.stdout) == ("ok", 0, "ABC\n")
    assert sandbox.run("import sys; sys.exit(7)").exit_code == 7


def test_fork_bomb_is_capped_and_reaped(sandbox: Sandbox) -> None:
    code = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(60)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "except OSError as exc:\n"
        "    print(n, exc.errno)\n"
    )
    result = sandbox.run(code, limits=SandboxLimits(max_procs=16, timeout_s=5.0))
    assert result.status == "ok", result
    started = int(result.stdout.split()[0])
    assert 0 < started < 16
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    result = sandbox.run(bomb, limits=SandboxLimits(timeout_s=1.5, max_procs=16))
    assert result.status == "timeout"
    assert sandbox.run("print('after')").stdout == "after\n"


def test_infinite_loop_hits_wall_and_cpu_limits(sandbox: Sandbox) -> None:
    wall = sandbox.run("while True: pass", limits=SandboxLimits(timeout_s=1.0, cpu_s=30.0))
    assert wall.status == "timeout" and wall.exit_code is None, wall
    cpu = sandbox.run("while True: pass", limits=SandboxLimits(timeout_s=120.0, cpu_s=1.0))
    assert cpu.status == "timeout" and 0.9 <= cpu.cpu_s < 30.0, cpu


def test_memory_hog_is_stopped(sandbox: Sandbox) -> None:
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
    result = sandbox.run(code, limits=SandboxLimits(memory_mb=200))
    assert result.status == "memory", result
    assert result.max_rss_mb < 200


def test_huge_output_is_capped(sandbox: Sandbox) -> None:
    result = sandbox.run(
        "import sys\nwhile True:\n    sys.stdout.write('z' * 65536)\n",
        limits=SandboxLimits(max_output_bytes=4096),
    )
    assert result.status == "output_limit"
    assert len(result.stdout) + len(result.stderr) <= 4096


def test_cannot_write_outside_its_dir(sandbox: Sandbox, tmp_path: Path) -> None:
    targets = ["/x", "/usr/x", "/etc/x", "/proc/x", str(REPO / "escaped.txt"), str(tmp_path / "e")]
    code = (
        "import json, os\n"
        "report = {}\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        with open(path, 'w') as f:\n"
        "            f.write('escaped')\n"
        "        report[path] = 'written'\n"
        "    except OSError as exc:\n"
        "        report[path] = exc.strerror\n"
        "open('/tmp/mine.txt', 'w').write('ok')\n"
        "report['own'] = open('/tmp/mine.txt').read()\n"
        "print(json.dumps(report))\n"
    )
    result = sandbox.run(code)
    report = json.loads(result.stdout)
    assert report.pop("own") == "ok"
    assert "written" not in report.values(), report
    assert not (REPO / "escaped.txt").exists() and not (tmp_path / "e").exists()


def test_no_network_not_even_loopback(sandbox: Sandbox) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        code = (
            "import socket\n"
            f"for host in [('127.0.0.1', {port}), ('10.0.0.1', 80), ('1.1.1.1', 53)]:\n"
            "    try:\n"
            "        socket.create_connection(host, timeout=1).close()\n"
            "        print('connected', host)\n"
            "    except OSError as exc:\n"
            "        print('refused', exc.errno)\n"
            "print([name for _, name in socket.if_nameindex()])\n"
        )
        result = sandbox.run(code)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert "connected" not in result.stdout and result.stdout.count("refused") == 3
    assert result.stdout.strip().endswith("['lo']")


def test_no_parent_environment_files_or_descriptors(sandbox: Sandbox, tmp_path: Path) -> None:
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(SECRET)
    code = (
        "import os\n"
        "print(sorted(os.environ.items()))\n"
        "print(sorted(os.listdir('/proc/self/fd')))\n"
        f"for path in [{str(secret_file)!r}, {str(REPO / 'pyproject.toml')!r}, '/proc/1/environ']:\n"
        "    try:\n"
        "        print(open(path, 'rb').read())\n"
        "    except OSError as exc:\n"
        "        print('denied', path, exc.strerror)\n"
    )
    result = sandbox.run(code)
    assert result.status == "ok", result
    assert SECRET not in result.stdout and "ASYNCRL_TEST_SECRET" not in result.stdout
    lines = result.stdout.splitlines()
    assert lines[0] == "[('HOME', '/tmp'), ('LANG', 'C.UTF-8'), ('PATH', '/usr/bin:/bin')]"
    assert lines[1] == "['0', '1', '2', '3']"  # 3: the listing's own descriptor
    assert all(line.startswith("denied") for line in lines[2:4]), lines
    assert "asyncrl" not in result.stdout


def test_cannot_kill_its_parent_or_init(sandbox: Sandbox) -> None:
    code = (
        "import os, signal\n"
        "print(os.getpid(), os.getppid())\n"
        "for target in (os.getppid(), 1, -1):\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "    except OSError as exc:\n"
        "        print('denied', exc.errno)\n"
        "print('still here')\n"
    )
    result = sandbox.run(code)
    assert result.status == "ok" and result.stdout.startswith("2 1\n"), result
    assert result.stdout.endswith("still here\n")
    assert sandbox.run("print(2 + 2)").stdout == "4\n"


def test_daemon_left_behind_is_gone_after_the_run(sandbox: Sandbox) -> None:
    marker = "sbxdaemon42"
    code = (
        "import ctypes, os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        ctypes.CDLL(None).prctl(15, b'{marker}', 0, 0, 0)\n"
        "        time.sleep(600)\n"
        "    os._exit(0)\n"
        "print('forked')\n"
        "deadline = time.time() + 4\n"  # until the grandchild renamed itself (run limit: 5 s)
        "while True:\n"
        "    alive = [p for p in os.listdir('/proc') if p.isdigit() and\n"
        f"             open('/proc/%s/comm' % p).read().strip() == '{marker}']\n"
        "    if alive or time.time() > deadline:\n"
        "        break\n"
        "    time.sleep(0.05)\n"
        "print(len(alive))\n"
    )
    result = sandbox.run(code)
    assert result.status == "ok", result
    assert result.stdout.splitlines() == ["forked", "1"]  # the daemon ran during the run
    assert _processes_with(marker) == []


def test_a_run_after_a_hostile_run_is_clean() -> None:
    with Sandbox(num_workers=1) as single:
        hostile = (
            "import builtins, ctypes, sys\n"
            "assert ctypes.CDLL(None).shmget(4242, 4096, 0o1666) >= 0  # SysV shm: IPC_CREAT\n"
            "open('/tmp/left.txt', 'w').write('x')\n"
            "builtins.LEFT = 1\n"
            "sys.modules['left_module'] = sys\n"
            "sys.setrecursionlimit(50)\n"
        )
        assert single.run(hostile).status == "ok"
        probe = (
            "import builtins, ctypes, os, sys\n"
            "print(os.listdir('/tmp'), hasattr(builtins, 'LEFT'), 'left_module' in sys.modules,\n"
            "      sys.getrecursionlimit() > 50, ctypes.CDLL(None).shmget(4242, 0, 0))\n"
        )
        assert single.run(probe).stdout == "[] False False True -1\n"


def test_concurrent_runs_from_threads(sandbox: Sandbox) -> None:
    results: dict[int, str] = {}

    def one(index: int) -> None:
        results[index] = sandbox.run(
            f"import sys\nprint(sys.stdin.read() * {index})", stdin="ab"
        ).stdout

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {i: "ab" * i + "\n" for i in range(8)}


def test_refuses_without_the_rights_to_isolate(tmp_path: Path) -> None:
    code = (
        "import os\n"
        "from actors.sandbox import Sandbox, SandboxError, isolation_problem\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "print(isolation_problem())\n"
        "try:\n"
        "    Sandbox(num_workers=1)\n"
        "except SandboxError as exc:\n"
        "    print('refused:', exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"]},
    )
    assert done.returncode == 0, done.stderr
    problem, refusal = done.stdout.splitlines()
    assert (
        "root" in problem and refusal.startswith("refused: sandbox refuses") and problem in refusal
    )


def test_cli_prints_one_json_object(tmp_path: Path) -> None:
    program, stdin = tmp_path / "p.py", tmp_path / "in.txt"
    program.write_text("import sys\nprint(sys.stdin.read()[::-1])\n")
    stdin.write_text("olleh")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl",
            "sandbox",
            "run",
            str(program),
            "--stdin",
            str(stdin),
            "--timeout",
            "5",
            "--memory-mb",
            "256",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(done.stdout)
    assert result["status"] == "ok" and result["stdout"] == "hello\n"
    assert set(result) == {
        "status",
        "exit_code",
        "stdout",
        "stderr",
        "wall_s",
        "cpu_s",
        "max_rss_mb",
    }


def test_a_dead_worker_is_reported_then_replaced() -> None:
    with Sandbox(num_workers=1) as single:
        worker = single._workers[0]
        assert worker.proc is not None
        os.killpg(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait()
        with pytest.raises(SandboxError, match="worker"):
            single.run("print(1)")
        assert single.run("print(1)").stdout == "1\n"


def test_python_tool_runs_in_the_shared_pool() -> None:
    from actors.envs.toolbox import python
    from actors.sandbox import shared_pool

    assert shared_pool() is shared_pool()
    assert python("print(6 * 7)") == "42\n"
    refused = python("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)")
    assert refused.startswith("[error, exit code 1]") and "OSError" in refused
