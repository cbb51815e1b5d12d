"""Reward-model serving: scored samples/s through `asyncrl reward-server` against calling the
same model in this process, side by side in one run, and the dynamic-batching win.

```
  variant          who batches                        what is timed (same texts, same model)
  -------          -----------                        ---------------------------------------
  inprocess_B      this process: RewardModel.score    tokenize + forward, batches of B, in turn
  server_B         client sends requests of B texts   submit all (max_in_flight at once), wait
  server_dynamic   server groups 1-text requests      the same texts sent one per request
  server_batch1    a server with max_batch = 1        the same, every forward pass holds one
  inprocess_1      this process, batches of 1         reference only
  forward_only_B   this process, batches of B         forward passes of pre-tokenized texts
```

`server_over_inprocess` = server_B / inprocess_B (goal >= 0.8): what serving costs over a
local call at the same batch size. `batching_over_batch1` = server_dynamic / server_batch1:
what the server's dynamic batching gains over scoring one sample per forward pass.
`server_over_forward_only` = server_B / forward_only_B: serving against the model's bare
compute (the server tokenizes on its I/O thread while the model thread runs, so it can beat
an in-process call that tokenizes and runs in turn). Variants
are interleaved rep by rep so machine noise hits them alike. The model is a randomly
initialised `LlamaForSequenceClassification` (num_labels=1) built locally with the tiny
character tokenizer, twice the tiny sort reward model's width (hidden 128, 2 layers); texts
of 8-40 characters by default, the size of the `sort` task's (one token a character).
Writes bench/results/reward_server.json.

    python bench/reward_server.py [--batch 32] [--samples 256] [--reps 5] [--threads 1] [--text-chars 8 40]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from actors.rewards.rm_client import RewardModelClient
from actors.rewards.rm_model import RewardModel
from asyncrl.models.tiny import BOS, EOS, MAX_POSITIONS, PAD, build_tokenizer, vocab
from bench.common import REPO, RESULTS, command_line, environment, interleave, spread, write_json

SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}
START_WAIT_S = 120.0


def build_model(out: Path) -> Path:
    """A random-weight scalar-head model with the tiny tokenizer (never downloaded)."""
    ids = vocab()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(ids),
        max_position_embeddings=MAX_POSITIONS,
        num_labels=1,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        **SHAPE,
    )
    LlamaForSequenceClassification(config).save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    return out


def make_texts(num: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    """`num` texts of lo..hi characters (one token each) and `<eos>`."""
    rng = random.Random(seed)
    return [
        "".join(rng.choice("0123456789: ") for _ in range(rng.randint(lo, hi))) + EOS
        for _ in range(num)
    ]


@contextmanager
def served(
    model_dir: Path, tmp: Path, max_batch: int, max_wait_ms: float, threads: int
) -> Iterator[str]:
    """`asyncrl reward-server` in a child process; yields its endpoint; SIGTERM by pid."""
    endpoint_file = tmp / f"endpoint-{max_batch}"
    sets = {"max_batch": max_batch, "max_wait_ms": max_wait_ms, "max_queue_samples": 8192}
    cmd = [
        sys.executable,
        "-m",
        "asyncrl",
        "reward-server",
        "--model",
        str(model_dir),
        "--endpoint-file",
        str(endpoint_file),
        "--log-level",
        "WARNING",
    ]
    for key, value in sets.items():
        cmd += ["--set", f"reward_model.{key}={json.dumps(value)}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # the server's torch threads
    proc = subprocess.Popen(cmd, cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + START_WAIT_S
        while not endpoint_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the reward server did not start ({' '.join(cmd)})")
            time.sleep(0.05)
        yield endpoint_file.read_text().strip()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def time_inprocess(model: RewardModel, texts: list[str], batch: int) -> float:
    start = time.perf_counter()
    for lo in range(0, len(texts), batch):
        part = texts[lo : lo + batch]
        model.score([""] * len(part), part)
    return time.perf_counter() - start


def time_forward(model: RewardModel, texts: list[str], batch: int) -> float:
    """The model's forward passes alone: tokenized before the clock starts."""
    tokens = model.tokenize([""] * len(texts), texts)
    start = time.perf_counter()
    for lo in range(0, len(tokens), batch):
        model.score_tokens(tokens[lo : lo + batch])
    return time.perf_counter() - start


def time_server(client: RewardModelClient, texts: list[str], batch: int) -> float:
    start = time.perf_counter()
    futures = [client.score_async(texts[lo : lo + batch]) for lo in range(0, len(texts), batch)]
    for f in futures:
        f.result()
    return time.perf_counter() - start


def run(args: argparse.Namespace, model_dir: Path, tmp: Path) -> dict[str, Any]:
    texts = make_texts(args.samples, *args.text_chars)
    model = RewardModel(model_dir, device="cpu")
    with (
        served(model_dir, tmp, args.batch, args.max_wait_ms, args.threads) as ep_b,
        served(model_dir, tmp, 1, 0.0, args.threads) as ep_1,
    ):
        big = RewardModelClient(ep_b, client_id="bench-b", timeout_s=300, max_in_flight=256)
        one = RewardModelClient(ep_1, client_id="bench-1", timeout_s=300, max_in_flight=256)

        def variants(part: list[str]) -> dict[str, Callable[[], float]]:
            return {
                "inprocess_B": lambda: time_inprocess(model, part, args.batch),
                "server_B": lambda: time_server(big, part, args.batch),
                "server_dynamic": lambda: time_server(big, part, 1),
                "server_batch1": lambda: time_server(one, part, 1),
                "inprocess_1": lambda: time_inprocess(model, part, 1),
                "forward_only_B": lambda: time_forward(model, part, args.batch),
            }

        try:
            for _ in range(args.warmup):  # a short pass of every variant
                for fn in variants(texts[: 2 * args.batch]).values():
                    fn()
            times = measure(variants(texts), args.reps)
            stats = {"server_B": big.server_stats(), "server_batch1": one.server_stats()}
        finally:
            big.close()
            one.close()
    rates = {name: spread([args.samples / t for t in ts]) for name, ts in times.items()}
    return {"rates": rates, "server_stats": stats}


def measure(variants: dict[str, Callable[[], float]], reps: int) -> dict[str, list[float]]:
    """Every variant once per rep, in turn (interleaved)."""

    def report(rep: int, got: dict[str, float]) -> None:
        line = ", ".join(f"{n} {t:.3f}s" for n, t in got.items())
        print(f"rep {rep + 1}/{reps}: {line}", flush=True)

    each = {name: (lambda _rep, fn=fn: fn()) for name, fn in variants.items()}
    return interleave(each, reps=reps, warmup=0, report=report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="B: samples per forward pass")
    parser.add_argument("--samples", type=int, default=256, help="texts scored per repetition")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--max-wait-ms", type=float, default=5.0, help="server reward_model.max_wait_ms"
    )
    parser.add_argument(
        "--text-chars",
        type=int,
        nargs=2,
        default=[8, 40],
        metavar=("LO", "HI"),
        help="text lengths (sort-task texts are 8-40)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads, here and in the servers"
    )
    parser.add_argument("--out", default=str(RESULTS / "reward_server.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # servers are stopped on the way out
    with tempfile.TemporaryDirectory(prefix="rm-bench-") as tmp:
        model_dir = build_model(Path(tmp) / "model")
        out = run(args, model_dir, Path(tmp))
    med = {name: r["median"] for name, r in out["rates"].items()}
    summary = {
        "server_over_inprocess": med["server_B"] / med["inprocess_B"],
        "batching_over_batch1": med["server_dynamic"] / med["server_batch1"],
        "inprocess_batching_over_batch1": med["inprocess_B"] / med["inprocess_1"],
        "server_over_forward_only": med["server_B"] / med["forward_only_B"],
    }
    for key, value in {**{f"{k}_samples_per_s": v for k, v in med.items()}, **summary}.items():
        print(f"{key:>32}: {value:.3f}")
    write_json(
        args.out,
        {
            "benchmark": "reward_server",
            "command": command_line(__file__),
            "config": {
                "batch": args.batch,
                "samples": args.samples,
                "reps": args.reps,
                "warmup": args.warmup,
                "threads": args.threads,
                "max_wait_ms": args.max_wait_ms,
                "model": SHAPE,
                "text_chars": args.text_chars,
                "device": "cpu",
                "dtype": "float32",
            },
            **environment(("numpy", "zmq", "msgpack", "torch", "transformers")),
            "torch_threads": torch.get_num_threads(),
            "samples_per_s": out["rates"],
            **summary,
            "server_stats": out["server_stats"],
        },
    )


if __name__ == "__main__":
    main()
