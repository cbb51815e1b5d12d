"""What the simulator measures, and over which window.

The window runs from the end of learner step `warmup_steps` (time 0 when it is 0) to the end
of step `num_steps`. Every quantity is a plain sum over events inside the window, divided once
at the end, so hand-computable cases (dyadic times) come out exact:

- learner idle fraction = Σ (batch arrival - request) over the window's steps / window;
- actor idle fraction   = ∫ (actors not generating) dt over the window / (A · window);
- staleness             = policy_version - min_policy_version of each consumed group;
- drops                 = the hub's stale-drop counter at the window's end minus its start;
- in-flight updates, weight loads and completion tokens generated count inside the window;
  mixed-version share = consumed groups spanning versions / consumed groups.
"""

from __future__ import annotations

from .config import SimConfig, SimResult


class Tracker:
    """Accumulates the measurements of one simulation."""

    def __init__(self, *, num_actors: int, max_staleness: int) -> None:
        self.num_actors = num_actors
        self.busy_actors = 0
        self.t = 0.0
        self.idle_area = 0.0
        self.open = False  # inside the window
        self.start = {"t": 0.0, "idle_area": 0.0, "dropped": 0}
        self.end = dict(self.start)
        self.hist = [0] * (max_staleness + 1)
        self.steps = 0
        self.wait_s = self.step_s = 0.0
        self.tokens = 0
        self.gen_batches = self.gen_seqs = self.generated_samples = 0
        self.gen_s = 0.0
        self.sync_latencies: list[float] = []
        self.inflight_updates = self.loads = self.gen_tokens = self.mixed = 0

    def begin(self, warmup_steps: int) -> None:
        if warmup_steps == 0:
            self.open = True

    def advance(self, t: float) -> None:
        """Time moves to `t` (the number of busy actors was constant since the last event)."""
        self.idle_area += (self.num_actors - self.busy_actors) * (t - self.t)
        self.t = t

    def actor_started(self, delta: int) -> None:
        self.busy_actors += delta

    def generation(self, seconds: float, seqs: int, tokens: int = 0) -> None:
        if self.open:
            self.gen_batches += 1
            self.gen_seqs += seqs
            self.gen_s += seconds
            self.gen_tokens += tokens

    def inflight_update(self) -> None:
        self.inflight_updates += self.open

    def weights_loaded(self) -> None:
        self.loads += self.open

    def generated(self, samples: int) -> None:
        if self.open:
            self.generated_samples += samples

    def synced(self, latency_s: float) -> None:
        if self.open:
            self.sync_latencies.append(latency_s)

    def step(
        self,
        step_index: int,
        warmup_steps: int,
        wait_s: float,
        seconds: float,
        tokens: int,
        staleness: list[int],
        mixed: int = 0,
    ) -> None:
        """A batch arrived for step `step_index` (1-based)."""
        if step_index <= warmup_steps:
            return
        self.steps += 1
        self.wait_s += wait_s
        self.step_s += seconds
        self.tokens += tokens
        self.mixed += mixed
        for s in staleness:
            assert 0 <= s < len(self.hist), f"the hub handed out a group of staleness {s}"
            self.hist[s] += 1

    def step_done(self, steps_done: int, cfg: SimConfig, dropped: int) -> None:
        mark = {"t": self.t, "idle_area": self.idle_area, "dropped": dropped}
        if steps_done == cfg.warmup_steps:
            self.start, self.open = mark, True
        if steps_done == cfg.num_steps:
            self.end, self.open = mark, False

    def result(self, cfg: SimConfig, sync_s: float) -> SimResult:
        window = self.end["t"] - self.start["t"]
        assert window > 0 and self.steps == cfg.num_steps - cfg.warmup_steps
        consumed = sum(self.hist)
        return SimResult(
            steps=self.steps,
            window_s=window,
            samples_per_s=self.steps * cfg.samples_per_step / window,
            tokens_per_s=self.tokens / window,
            generated_samples_per_s=self.generated_samples / window,
            learner_idle_fraction=self.wait_s / window,
            actor_idle_fraction=(self.end["idle_area"] - self.start["idle_area"])
            / (self.num_actors * window),
            staleness_histogram=list(self.hist),
            mean_staleness=sum(i * n for i, n in enumerate(self.hist)) / max(1, consumed),
            groups_dropped_stale=self.end["dropped"] - self.start["dropped"],
            sync_s=sync_s,
            mean_sync_latency_s=_mean(self.sync_latencies),
            mean_step_s=self.step_s / self.steps,
            mean_generate_s=self.gen_s / max(1, self.gen_batches),
            mean_batch_seqs=self.gen_seqs / max(1, self.gen_batches),
            inflight_updates=self.inflight_updates,
            mixed_version_frac=self.mixed / max(1, consumed),
            tokens_per_weight_version=self.gen_tokens / max(1, self.loads),
        )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
