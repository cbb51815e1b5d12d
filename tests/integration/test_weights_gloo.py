"""Weight broadcast over gloo between real processes on loopback.

The learner side (a `WeightPublisher` holding the tiny Llama's parameters) runs in the test
process; each actor is a spawned process running a `WeightReceiver` whose plan comes from the
model directory's safetensors headers. Announcements travel as msgpack bytes over a queue,
standing in for the hub; received tensors come back over another queue and are compared bit
for bit. Processes are ended by pid.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import torch.multiprocessing as mp

from asyncrl.weights.broadcast import WeightPublisher, WeightReceiver
from asyncrl.weights.bucket_plan import BucketPlan, params_from_module, params_from_safetensors

BUCKET_BYTES = 64 * 1024  # small, so the tiny model spans many buckets
TIMEOUT_S = 15.0  # generous for a tiny model on a shared box; only a failing path waits it out


def _receiver_main(
    model_dir: str, actor_id: str, bucket_bytes: int, inbox: Any, outbox: Any
) -> None:
    """An actor's weight path: announcements in, received tensors out."""
    plan = BucketPlan.from_params(params_from_safetensors(model_dir), bucket_bytes)
    receiver = WeightReceiver(plan, actor_id, timeout_s=TIMEOUT_S)

    def report() -> None:
        while receiver.wait_ready(None):
            got = receiver.poll()
            if got is not None:
                # raw bytes, not tensors: a tensor in a queue needs its (maybe killed) sender
                outbox.put(("weights", actor_id, got[0], {n: _raw(t) for n, t in got[1]}))

    threading.Thread(target=report, daemon=True).start()
    outbox.put(("ready", actor_id, plan.plan_hash))
    while (blob := inbox.get()) is not None:
        try:
            receiver.on_announce(msgpack.unpackb(blob))
        except ValueError as exc:
            outbox.put(("refused", actor_id, str(exc)))
    receiver.close()


class Fleet:
    """Receiver processes plus the announce callback that reaches them."""

    def __init__(
        self, model_dir: Path, actor_ids: list[str], bucket_bytes: int = BUCKET_BYTES
    ) -> None:
        ctx = mp.get_context("spawn")
        # one outbox per receiver: a receiver killed mid-put can only tear its own pipe
        self.outboxes = {a: ctx.Queue() for a in actor_ids}
        self.inboxes = {a: ctx.Queue() for a in actor_ids}
        self.procs = {
            a: ctx.Process(
                target=_receiver_main,
                args=(str(model_dir), a, bucket_bytes, q, self.outboxes[a]),
            )
            for a, q in self.inboxes.items()
        }
        for p in self.procs.values():
            p.start()
        self._stash: list[tuple] = []
        self.announced: list[dict[str, Any]] = []
        self.hold: dict[int, threading.Event] = {}
        for a in actor_ids:
            self.expect("ready", a)

    def announce(self, ann: dict[str, Any]) -> None:
        blob = msgpack.packb(ann)  # the announcement must survive the hub's codec
        self.announced.append(ann)
        for actor, inbox in self.inboxes.items():
            if self.procs[actor].is_alive():
                inbox.put(blob)
        gate = self.hold.get(ann["policy_version"])
        if gate is not None:
            gate.wait(TIMEOUT_S)

    def expect(self, kind: str, actor: str, policy_version: int | None = None) -> tuple:
        """The next message of `kind` from `actor` (and version), waiting at most 2 timeouts."""

        def match(msg: tuple) -> bool:
            return msg[:2] == (kind, actor) and (policy_version is None or msg[2] == policy_version)

        for msg in self._stash:
            if match(msg):
                self._stash.remove(msg)
                return msg
        while True:
            try:
                msg = self.outboxes[actor].get(timeout=2 * TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(
                    f"no {kind} message from {actor} (stash: {self._stash})"
                ) from None
            if match(msg):
                return msg
            self._stash.append(msg)

    def kill(self, actor: str) -> None:
        proc = self.procs[actor]
        proc.kill()  # SIGKILL to this pid
        proc.join()

    def stop(self) -> None:
        for actor, proc in self.procs.items():
            if proc.is_alive():
                self.inboxes[actor].put(None)
        for proc in self.procs.values():
            proc.join(timeout=TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()


@pytest.fixture(scope="module")
def learner_model(tiny_model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def plan(learner_model: torch.nn.Module) -> BucketPlan:
    return BucketPlan.from_params(params_from_module(learner_model), BUCKET_BYTES)


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path) -> Iterator[Fleet]:
    f = Fleet(tiny_model_dir, ["actor-a", "actor-b"])
    yield f
    f.stop()


@pytest.fixture(scope="module")
def publisher(plan: BucketPlan, fleet: Fleet) -> Iterator[WeightPublisher]:
    pub = WeightPublisher(plan, timeout_s=TIMEOUT_S, announce=fleet.announce)
    yield pub
    pub.close()


_versions = iter(range(1, 1000))


def weights_for(model: torch.nn.Module) -> tuple[int, dict[str, torch.Tensor]]:
    """A fresh policy_version and distinct parameter values for it."""
    v = next(_versions)
    return v, {n: p.detach() * v + v for n, p in model.named_parameters()}


def _raw(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    return str(t.dtype), tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def assert_bitwise_equal(got: dict[str, tuple], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name] == _raw(tensor), name


def test_both_receivers_get_the_senders_weights_bit_for_bit(
    fleet: Fleet, publisher: WeightPublisher, learner_model: torch.nn.Module, plan: BucketPlan
) -> None:
    epochs = []
    for _ in range(2):  # the second publication reuses the epoch's group
        v, tensors = weights_for(learner_model)
        publisher.publish(v, tensors.items(), ["actor-b", "actor-a"])
        assert publisher.wait(4 * TIMEOUT_S)
        result = publisher.last_result
        assert result is not None and result.ok, result
        assert result.num_bytes == plan.total_bytes and result.num_receivers == 2
        for actor in ("actor-a", "actor-b"):
            assert_bitwise_equal(fleet.expect("weights", actor, v)[3], tensors)
        epochs.append(fleet.announced[-1]["epoch"])
    assert epochs[0] == epochs[1]
    assert fleet.announced[-1]["ranks"] == {"actor-a": 1, "actor-b": 2}
    assert len(plan.buckets) > 4


def test_a_newer_publish_supersedes_a_queued_one(
    fleet: Fleet, publisher: WeightPublisher, learner_model: torch.nn.Module
) -> None:
    before = publisher.stats.num_superseded
    (v1, t1), (v2, t2), (v3, t3) = (weights_for(learner_model) for _ in range(3))
    fleet.hold[v1] = gate = threading.Event()  # v1 stays in flight until released
    seen = len(fleet.announced)
    publisher.publish(v1, t1.items(), ["actor-a", "actor-b"])
    while len(fleet.announced) == seen:  # the publisher thread has started v1
        threading.Event().wait(0.01)
    publisher.publish(v2, t2.items(), ["actor-a", "actor-b"])
    publisher.publish(v3, t3.items(), ["actor-a", "actor-b"])  # replaces the queued v2
    gate.set()
    assert publisher.wait(4 * TIMEOUT_S)
    assert publisher.stats.num_superseded == before + 1
    assert [a["policy_version"] for a in fleet.announced[seen:]] == [v1, v3]
    assert publisher.last_result is not None and publisher.last_result.ok
    for actor in ("actor-a", "actor-b"):
        assert_bitwise_equal(fleet.expect("weights", actor, v3)[3], t3)
    assert not [m for m in fleet._stash if m[0] == "weights" and m[2] == v2]


def test_a_member_that_never_joins_fails_the_publication_not_the_learner(
    fleet: Fleet, publisher: WeightPublisher, learner_model: torch.nn.Module
) -> None:
    v, tensors = weights_for(learner_model)
    publisher.publish(v, tensors.items(), ["actor-a", "actor-b", "ghost"])
    assert publisher.wait(4 * TIMEOUT_S)  # bounded by the formation timeout
    failed = publisher.last_result
    assert failed is not None and not failed.ok and "BroadcastError" in failed.error
    v, tensors = weights_for(learner_model)
    publisher.publish(v, tensors.items(), ["actor-a", "actor-b"])
    assert publisher.wait(4 * TIMEOUT_S)
    assert publisher.last_result is not None and publisher.last_result.ok
    assert publisher.last_result.epoch == failed.epoch + 1
    for actor in ("actor-a", "actor-b"):
        assert_bitwise_equal(fleet.expect("weights", actor, v)[3], tensors)


def test_a_killed_receiver_fails_one_publish_then_the_rest_carry_on(
    tiny_model_dir: Path, plan: BucketPlan, learner_model: torch.nn.Module
) -> None:
    fleet = Fleet(tiny_model_dir, ["actor-a", "actor-b"])
    publisher = WeightPublisher(plan, timeout_s=TIMEOUT_S, announce=fleet.announce)
    try:
        v, tensors = weights_for(learner_model)
        publisher.publish(v, tensors.items(), ["actor-a", "actor-b"])
        assert publisher.wait(4 * TIMEOUT_S) and publisher.last_result.ok
        fleet.expect("weights", "actor-a", v)
        fleet.kill("actor-b")

        v, tensors = weights_for(learner_model)
        publisher.publish(
            v, tensors.items(), ["actor-a", "actor-b"]
        )  # the learner does not know yet
        assert publisher.wait(4 * TIMEOUT_S)  # no hang
        assert publisher.last_result is not None and not publisher.last_result.ok

        v, tensors = weights_for(learner_model)
        publisher.publish(v, tensors.items(), ["actor-a"])
        assert publisher.wait(4 * TIMEOUT_S)
        assert publisher.last_result is not None and publisher.last_result.ok, publisher.last_result
        assert_bitwise_equal(fleet.expect("weights", "actor-a", v)[3], tensors)
        assert publisher.stats.num_failed == 1
    finally:
        publisher.close()
        fleet.stop()


def test_an_announcement_with_another_plan_is_refused(plan: BucketPlan) -> None:
    other = BucketPlan.from_params(plan.params(), BUCKET_BYTES * 2)
    receiver = WeightReceiver(other, "actor-a", timeout_s=TIMEOUT_S)
    announcement = {
        "policy_version": 7,
        "plan_hash": plan.plan_hash,
        "backend": "gloo",
        "epoch": 1,
        "store_host": "127.0.0.1",
        "store_port": 1,
        "world_size": 2,
        "ranks": {"actor-a": 1},
        "nccl_unique_id": None,
    }
    try:
        with pytest.raises(ValueError) as err:
            receiver.on_announce(announcement)
        assert plan.plan_hash in str(err.value) and other.plan_hash in str(err.value)
        assert receiver.poll() is None and receiver.stats.num_received == 0
    finally:
        receiver.close()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"epoch": "1"}, "epoch"),
        ({"ranks": {"actor-a": 5}}, "ranks"),
        ({"nccl_unique_id": "abc"}, "nccl_unique_id"),
        ({"backend": "nccl"}, "backend"),
    ],
)
def test_a_malformed_announcement_is_refused_naming_the_field(
    plan: BucketPlan, change: dict, field: str
) -> None:
    receiver = WeightReceiver(plan, "actor-a", timeout_s=TIMEOUT_S)
    announcement = {
        "policy_version": 7,
        "plan_hash": plan.plan_hash,
        "backend": "gloo",
        "epoch": 1,
        "store_host": "127.0.0.1",
        "store_port": 1,
        "world_size": 2,
        "ranks": {"actor-a": 1},
        "nccl_unique_id": None,
    }
    try:
        with pytest.raises(ValueError, match=field):
            receiver.on_announce({**announcement, **change})
        bare = dict(announcement)
        del bare[field]
        with pytest.raises(ValueError, match=f"missing fields \\['{field}'\\]"):
            receiver.on_announce(bare)
    finally:
        receiver.close()
