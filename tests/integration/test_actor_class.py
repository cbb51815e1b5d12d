"""The `Actor` class itself, with a real TorchEngine (and a real hub where it talks to one): a
verifier that raises or returns NaN marks samples `reward_failed` and the actor carries on,
and credits ask only for weights the learner publishes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from actor_cases import ACTOR_ID, Learner, actor_on_hub, write_config
from transformers import AutoTokenizer

from actors.actor import Actor
from actors.engines.torch_engine import TorchEngine
from actors.envs.sort_task import SortEnv, SortVerifier
from actors.rewards.pipeline import RewardResult
from asyncrl.config import load_config
from asyncrl.protocol.messages import Credits
from asyncrl.transport.connection import HubConnection
from replay.core import weights_floor


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
    verifier = FlakyVerifier()  # one for all episodes: it fails in turn
    with actor_on_hub(tmp_path, cfg, config, tiny_model_dir, lambda: SortEnv(verifier)) as a:
        actor, endpoint, _ = a
        # One round: the hub granted the whole window (2 x concurrency) in one message, so half
        # of it is left unused and must come back.
        actor.run(max_groups=cfg.actor.concurrency)  # returns normally: failures are data
        learner = Learner(endpoint, cfg)
        try:
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
            learner.conn.close()


@pytest.mark.parametrize(
    ("publish_every", "eta", "credit_versions", "need"),
    [(1, 1, [5], 4), (2, 1, [4], 2), (3, 2, [8, 7], 6), (4, 3, [6], 0), (1, 4, [2], 0)],
)
def test_credits_ask_only_for_published_weights(
    tiny_model_dir: Path, publish_every: int, eta: int, credit_versions: list[int], need: int
) -> None:
    """Credits granted at hub version c need weights >= c - η, rounded down to a version the
    learner publishes (every publish_every-th); waiting for any other would never end. The hub
    computes that floor (`replay.core.weights_floor`) and its Credits carry it; the actor keeps
    the highest it was given."""
    overrides = [f"learner.publish_every={publish_every}", f"replay.max_staleness={eta}"]
    cfg = load_config(None, [f"model.path={json.dumps(str(tiny_model_dir))}", *overrides])
    conn = HubConnection(
        "tcp://127.0.0.1:1",
        role="actor",
        client_id=ACTOR_ID,
        config_hash=cfg.config_hash(),
        concurrency=2,
    )  # never started
    actor = Actor(
        cfg,
        actor_id=ACTOR_ID,
        conn=conn,
        engine=TorchEngine(tiny_model_dir),
        tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir),
        make_env=lambda: SortEnv(SortVerifier()),
    )
    for version in credit_versions:
        floor = weights_floor(version, eta, publish_every)
        actor.handle(
            Credits(group_size=4, policy_version=version, items=(), min_weights_version=floor)
        )
    assert actor.min_weights_version == need
