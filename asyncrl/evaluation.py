"""Evaluation results: pass@k, the summary of one evaluation, and its log (eval.jsonl + TensorBoard).

```
  hub ──EvalRequest(every K versions)──> one actor ──EvalResult──> hub ──forward──> learner
                                                                                     │
  asyncrl eval CHECKPOINT (tools/eval.py) ──the same EvalResult──────────────────────┤
                                                                                     v
                          summarize(result) -> EvalLog: run_dir/eval.jsonl, run_dir/tb/eval/
```

One line of eval.jsonl per evaluation: the policy version its samples were generated with (and
the version the hub asked for), the actor, prompt and sample counts, mean reward, pass@1 and
pass@n (a sample passes when its reward >= `eval.pass_threshold`; unbiased estimator of Chen et
al. 2021 averaged over prompts), mean completion length, finish-reason fractions, reward
failures and generation time. TensorBoard gets the numbers as `eval/<key>` at step =
policy_version. Pure Python + tensorboard's own writer (no torch), so the hub-side tools can use
it too.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from asyncrl.protocol.messages import EvalResult

EVAL_FILE = "eval.jsonl"
GREEDY_TOP_P = 1e-9
"""Greedy decoding through any engine: a nucleus this small keeps only the most likely token."""


def sampling(temperature: float) -> tuple[float, float]:
    """(temperature, top_p) for the engines, which sample only: temperature 0 means greedy."""
    return (1.0, GREEDY_TOP_P) if temperature == 0 else (temperature, 1.0)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn from n (c of which pass) passes."""
    assert 0 <= c <= n and 1 <= k <= n
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(result: EvalResult) -> dict[str, Any]:
    """The eval.jsonl record of one evaluation."""
    n = result.num_samples
    prompts = len(result.prompt_ids)
    assert len(result.rewards) == prompts * n, "rewards: num_samples per prompt"
    passes = [
        sum(r >= result.pass_threshold for r in result.rewards[i * n : (i + 1) * n])
        for i in range(prompts)
    ]
    finishes = Counter(result.finish_reasons)
    total = max(len(result.rewards), 1)
    record: dict[str, Any] = {
        "policy_version": result.policy_version,
        "requested_version": result.requested_version,
        "eval_id": result.eval_id,
        "actor_id": result.actor_id,
        "num_prompts": prompts,
        "num_samples": n,
        "reward_mean": sum(result.rewards) / total,
        "pass@1": sum(pass_at_k(n, c, 1) for c in passes) / max(prompts, 1),
        f"pass@{n}": sum(pass_at_k(n, c, n) for c in passes) / max(prompts, 1),
        "length_mean": sum(result.lengths) / total,
        "reward_failures": sum(1 for f in result.reward_failed if f),
        "generate_s": result.generate_s,
    }
    record.update({f"finish_{k}_frac": v / total for k, v in sorted(finishes.items())})
    return record


class EvalLog:
    """Appends evaluation records to run_dir/eval.jsonl and TensorBoard (thread-safe: the
    learner's connection thread writes results as they arrive)."""

    def __init__(self, run_dir: str | Path, name: str = EVAL_FILE) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / name
        self.lock = threading.Lock()
        self._writer: Any = None

    def write(self, record: dict[str, Any], **extra: Any) -> dict[str, Any]:
        """Append one record (plus `extra` keys and the wall time); return what was written."""
        row = {**record, **extra, "time": time.time()}
        with self.lock:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row, allow_nan=False) + "\n")
            self._tensorboard(row)
        return row

    def _tensorboard(self, row: dict[str, Any]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        if self._writer is None:
            self._writer = EventFileWriter(str(self.run_dir / "tb" / "eval"))
        summary = Summary()
        for key, value in row.items():
            if isinstance(value, int | float) and not isinstance(value, bool) and key != "time":
                summary.value.add(tag=f"eval/{key}", simple_value=float(value))
        event = Event(wall_time=row["time"], step=int(row["policy_version"]), summary=summary)
        self._writer.add_event(event)
        self._writer.flush()

    def close(self) -> None:
        with self.lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None


def read_evals(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of run_dir/eval.jsonl (none when the run did not evaluate)."""
    path = Path(run_dir) / EVAL_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a crash
    return rows
