"""`asyncrl launch CONFIG --ray [ADDRESS]`: hub, actors and learner ranks placed on a Ray cluster.

```
 launcher (this process: the Ray driver)
   prepare the run directory (config, prompts, model)               as `asyncrl run` does
   hub     RoleRunner(replay) on a node with [launch] hub_cpus       -> endpoint: node IP + port
   learner RoleRunner(learner) x learner.world in a placement group (PACK: ranks fill a node
           before the next); rank 0's node IP and a free port there are MASTER_ADDR/PORT
   actors  RoleRunner(actor-i) x run.num_actors, actor_cpus/gpus/memory/custom resources,
           Ray restarts a lost worker (max_restarts); a runner restarts a crashed process
   loop    progress from metrics.jsonl; restarts of actors, with backoff, logged
   end     rank 0 of the learner exits (max_steps, SIGTERM, Ctrl-C) -> actors, then the hub,
           get SIGTERM through their runners (by pid); Ray actors are killed last
```

Ray only places and supervises processes: every role runs the usual `asyncrl replay | actor |
learner` command as a child of its Ray actor (`RoleRunner`), talking ZeroMQ to the hub and
torch.distributed inside the learner, exactly as on one machine. A child dies with its runner
(PR_SET_PDEATHSIG), so a lost Ray worker leaves no stray process behind. Each role's output goes
to `<run_dir>/<role>.log`; the run directory must be on a file system every node sees (it is
on a single machine). A restarted actor reconnects to the hub under the same actor id, and the
hub hands it the current weights before it generates. The hub binds the node's IP: a
non-loopback address needs CURVE auth (`replay.auth_dir`) or `launch.allow_insecure`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.config import RunConfig, load_config
from asyncrl.files import replace_text


class RoleRunner:
    """One role's process on a Ray node (made a Ray actor class by `remote_runner`)."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log: str) -> None:
        self.name, self.args, self.env, self.log = name, args, env, log
        self.restarts = 0
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        env = dict(os.environ, **self.env)
        out = open(self.log, "ab")  # noqa: SIM115 - the child keeps it
        return subprocess.Popen(
            [sys.executable, "-m", "asyncrl", *self.args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent,
        )

    def pids(self) -> tuple[int, int]:
        """(this Ray worker's pid, the role process's pid)."""
        return os.getpid(), self.proc.pid

    def node_ip(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def free_port(self) -> int:
        from asyncrl.transport.sockets import free_port

        return free_port(self.node_ip())

    def poll(self) -> int | None:
        return self.proc.poll()

    def state(self) -> tuple[int, int | None]:
        """(this Ray worker's pid, the role process's exit code or None while it runs)."""
        return os.getpid(), self.proc.poll()

    def restart(self) -> int:
        """Start the role's process again (after it exited); returns the new pid."""
        self.restarts += 1
        self.proc = self._spawn()
        return self.proc.pid

    def read(self, path: str) -> str:
        """A small file on this node ("" when absent): the hub's endpoint file."""
        p = Path(path)
        return p.read_text().strip() if p.is_file() else ""

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM the role's process, wait up to grace_s, then SIGKILL it (by pid)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent (the Ray worker) dies (Linux)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def remote_runner(options: dict[str, Any]) -> Any:
    """RoleRunner as a Ray actor class with these resource options."""
    import ray

    return ray.remote(**options)(RoleRunner)


# --- placement ---------------------------------------------------------------------------------


def resource_options(cfg: RunConfig, role: str) -> dict[str, Any]:
    """Ray options of a role from `[launch]` (CPUs, GPUs, memory, custom resources)."""
    launch = cfg.launch
    if role == "hub":
        return {"num_cpus": launch.hub_cpus}
    if role == "actor":
        opts: dict[str, Any] = {
            "num_cpus": launch.actor_cpus,
            "num_gpus": launch.actor_gpus,
            "max_restarts": launch.actor_max_restarts,
            "max_task_retries": 0,
        }
        if launch.actor_memory_gb:
            opts["memory"] = int(launch.actor_memory_gb * 2**30)
        if launch.actor_resources:
            opts["resources"] = dict(launch.actor_resources)
        return opts
    opts = {"num_cpus": launch.learner_cpus, "num_gpus": launch.learner_gpus}
    if launch.learner_memory_gb:
        opts["memory"] = int(launch.learner_memory_gb * 2**30)
    return opts


def start_hub(cfg: RunConfig, config_path: Path, dataset: Path, run_dir: Path) -> tuple[Any, str]:
    """The hub on some node; returns (runner, endpoint) once it has bound."""
    import ray

    runner = remote_runner(resource_options(cfg, "hub")).remote(
        "hub", [], {}, str(run_dir / "hub.log")
    )
    ip = ray.get(runner.node_ip.remote())
    ray.kill(runner)  # placed only to learn the node: the real one binds that node's address
    loopback = ip.startswith("127.")
    if not loopback and not cfg.replay.auth_dir and not cfg.launch.allow_insecure:
        raise ValueError(
            f"launch: the hub would bind {ip} (not loopback) without auth: set replay.auth_dir "
            "(asyncrl keygen) or launch.allow_insecure = true"
        )
    endpoint_file = run_dir / "hub.endpoint"
    endpoint_file.unlink(missing_ok=True)
    args = [
        "replay",
        "--config",
        str(config_path),
        "--dataset",
        str(dataset),
        "--bind",
        f"tcp://{ip}:0",
        "--endpoint-file",
        str(endpoint_file),
    ]
    if not loopback and not cfg.replay.auth_dir:
        args.append("--allow-insecure")
    options = dict(resource_options(cfg, "hub"), scheduling_strategy=_node_affinity(ip))
    runner = remote_runner(options).remote("hub", args, {}, str(run_dir / "hub.log"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        endpoint = ray.get(runner.read.remote(str(endpoint_file)))
        if endpoint:
            return runner, endpoint
        if ray.get(runner.poll.remote()) is not None:
            raise RuntimeError(f"launch: the hub exited before binding; see {run_dir / 'hub.log'}")
        time.sleep(0.2)
    raise TimeoutError("launch: the hub did not report its endpoint within 120 s")


def _node_affinity(ip: str) -> Any:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == ip)
    return NodeAffinitySchedulingStrategy(node_id=node, soft=False)


def start_actors(cfg: RunConfig, config_path: Path, endpoint: str, run_dir: Path) -> dict[str, Any]:
    runners = {}
    for i in range(cfg.run.num_actors):
        name = f"actor-{i}"
        args = [
            "actor",
            "--config",
            str(config_path),
            "--hub",
            endpoint,
            "--actor-id",
            name,
            "--index",
            str(i),
            "--status-file",
            str(run_dir / f"{name}.json"),
        ]
        runners[name] = remote_runner(resource_options(cfg, "actor")).remote(
            name, args, {"OMP_NUM_THREADS": "1"}, str(run_dir / f"{name}.log")
        )
    return runners


def start_learner(cfg: RunConfig, config_path: Path, endpoint: str, run_dir: Path) -> list[Any]:
    """learner.world ranks in one placement group (PACK), rank 0 first."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    world = cfg.learner.world
    bundle = {"CPU": cfg.launch.learner_cpus, "GPU": cfg.launch.learner_gpus}
    group = placement_group([{k: v for k, v in bundle.items() if v}] * world, strategy="PACK")
    ray.get(group.ready(), timeout=600)
    args = ["learner", "--config", str(config_path), "--hub", endpoint, "--run-dir", str(run_dir)]
    runners: list[Any] = []
    env: dict[str, str] = {"OMP_NUM_THREADS": str(max(1, int(cfg.launch.learner_cpus)))}
    for rank in range(world):
        options = dict(resource_options(cfg, "learner"))
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=rank
        )
        if world > 1:
            if rank == 0:  # rank 0's node and a free port there: the rendezvous of the ranks
                probe = remote_runner(options).remote("probe", ["--help"], {}, os.devnull)
                master = ray.get([probe.node_ip.remote(), probe.free_port.remote()])
                ray.kill(probe)
                env.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), WORLD_SIZE=str(world))
            # Ray gives each rank only its own GPU (CUDA_VISIBLE_DEVICES): it is cuda:0 there
            env = dict(env, RANK=str(rank), LOCAL_RANK="0")
        log = run_dir / ("learner.log" if rank == 0 else f"learner-rank{rank}.log")
        runners.append(remote_runner(options).remote("learner", args, dict(env), str(log)))
    return runners


# --- the run ----------------------------------------------------------------------------------


class Supervisor:
    """Watches the actors: restarts a crashed process (bounded, with backoff) and logs a lost
    Ray worker, which Ray itself restarts (`launch.actor_max_restarts`): seen either while it is
    gone (its calls fail) or, when Ray brought it back between two checks, by its new pid."""

    def __init__(self, actors: dict[str, Any], max_restarts: int) -> None:
        self.actors, self.max_restarts = actors, max_restarts
        self.restarts = dict.fromkeys(actors, 0)
        self.next_try = dict.fromkeys(actors, 0.0)
        self.unavailable: set[str] = set()
        self.workers: dict[str, int] = {}  # each actor's Ray worker pid at the last check

    def check(self) -> None:
        import ray
        from ray.exceptions import RayActorError

        for name, runner in self.actors.items():
            try:
                worker, code = ray.get(runner.state.remote(), timeout=30)
            except (RayActorError, ray.exceptions.GetTimeoutError) as exc:
                if name not in self.unavailable:
                    print(
                        f"launch: {name}'s Ray worker is gone ({type(exc).__name__}); "
                        "Ray restarts it",
                        flush=True,
                    )
                self.unavailable.add(name)
                continue
            known = self.workers.get(name, worker)
            self.workers[name] = worker
            if name in self.unavailable:
                self.unavailable.discard(name)
                print(f"launch: {name} is back (restarted by Ray)", flush=True)
            elif worker != known:  # died and came back between two checks
                print(
                    f"launch: {name}'s Ray worker is gone (pid {known}); Ray restarted it "
                    f"(pid {worker})",
                    flush=True,
                )
            if code is None or code == 0 or time.monotonic() < self.next_try[name]:
                continue
            if self.restarts[name] >= self.max_restarts:
                raise RuntimeError(f"{name} failed {self.restarts[name] + 1} times (exit {code})")
            self.restarts[name] += 1
            self.next_try[name] = time.monotonic() + min(60.0, 2.0 ** self.restarts[name])
            pid = ray.get(runner.restart.remote())
            print(
                f"launch: {name} exited with {code}; restarted it (pid {pid}, restart "
                f"{self.restarts[name]} of {self.max_restarts})",
                flush=True,
            )


def launch(cfg: RunConfig, run_dir: Path, address: str) -> dict[str, Any]:
    """Place everything on the Ray cluster at `address`, run until the learner ends."""
    import ray

    from launch.run import plot_reward, prepare, progress_line, summarize
    from learner.metrics_log import MetricsTail, read_metrics

    config_path, dataset = prepare(cfg, run_dir)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    ray.init(
        address=address or None,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}},
    )
    hub, endpoint = start_hub(cfg, config_path, dataset, run_dir)
    actors = start_actors(cfg, config_path, endpoint, run_dir)
    learner = start_learner(cfg, config_path, endpoint, run_dir)
    _write_pids(
        run_dir, {"hub": hub, **actors, **{f"learner-{i}": r for i, r in enumerate(learner)}}
    )
    print(
        f"launch: hub at {endpoint}, {len(actors)} actors, {len(learner)} learner rank(s)",
        flush=True,
    )
    supervisor, tail, start, reason = (
        Supervisor(actors, cfg.launch.actor_max_restarts),
        None,
        time.monotonic(),
        "",
    )
    tail = MetricsTail(run_dir / "metrics.jsonl")
    try:
        while (code := ray.get(learner[0].poll.remote())) is None:
            supervisor.check()
            print(progress_line(tail.poll(), time.monotonic() - start), flush=True)
            time.sleep(cfg.run.progress_every_s)
        reason = f"learner exited with {code}"
    except KeyboardInterrupt:
        reason = "interrupted"
        print("launch: interrupted: stopping the learner, actors and hub", flush=True)
    except RuntimeError as exc:
        reason = str(exc)
    finally:
        _stop(learner, cfg.weights.timeout_s + 30)
        _stop(list(actors.values()), 30)
        _stop([hub], 10)
        for runner in [*learner, *actors.values(), hub]:
            ray.kill(runner)
    rows = read_metrics(run_dir / "metrics.jsonl")
    summary = {**summarize(rows), "ended": reason, "actor_restarts": supervisor.restarts}
    if rows:
        plot_reward(rows, run_dir / "reward.png", f"{cfg.task.name} under Ray")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _stop(runners: Sequence[Any], grace_s: float) -> None:
    import ray

    refs = [r.stop.remote(grace_s) for r in runners]
    try:
        ray.get(refs, timeout=grace_s + 30)
    except Exception as exc:  # a runner that is gone cannot stop its process: it died with it
        print(f"launch: stopping: {type(exc).__name__}: {exc}", flush=True)


def _write_pids(run_dir: Path, runners: dict[str, Any]) -> None:
    """Each role's (Ray worker pid, process pid), for operators and tests."""
    import ray

    pids = dict(zip(runners, ray.get([r.pids.remote() for r in runners.values()]), strict=True))
    replace_text(run_dir / "pids.json", json.dumps(pids))


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl launch", description="Run on a Ray cluster.")
    p.add_argument("config", help="run config TOML")
    p.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        default=None,
        metavar="ADDRESS",
        help="Ray cluster address (default: auto, i.e. RAY_ADDRESS or a local one)",
    )
    p.add_argument("--run-dir", default="", help="overrides run.run_dir (shared by all nodes)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    return p.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    """`asyncrl launch CONFIG --ray [ADDRESS]`."""
    args = parse_args(argv)
    if args.ray is None:
        print("asyncrl launch: choose a cluster engine: --ray [ADDRESS]", file=sys.stderr)
        return 2
    overrides = list(args.set) + (
        [f"run.run_dir={json.dumps(args.run_dir)}"] if args.run_dir else []
    )
    cfg = load_config(args.config, overrides)
    run_dir = Path(cfg.run.run_dir).resolve()
    try:
        import ray  # noqa: F401
    except ImportError:
        print("asyncrl launch: Ray is not installed (pip install 'asyncrl[ray]')", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's stop ends the run like Ctrl-C
    summary = launch(cfg, run_dir, "" if args.ray == "auto" else args.ray)
    print(
        f"launch: done ({summary['ended']}): {summary.get('steps', 0)} steps; "
        f"actor restarts {summary['actor_restarts']}",
        flush=True,
    )
    return 0 if summary["ended"].endswith("exited with 0") else 1
