"""The actor's reward pipeline against a real hub: component values and provenance travel with
every group, and a group whose reward failed under on_failure = drop_group is not pushed (its
credit goes back, so the prompt is re-issued)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from actor_cases import Learner, actor_on_hub

from actors.envs.sort_task import SortEnv, SortVerifier
from asyncrl.config import load_config, to_toml
from replay.prompts import load_dataset

PICKY = '''
from actors.rewards.pipeline import ComponentResult, InlineComponent

class Picky(InlineComponent):
    """Fails every item whose prompt starts with an even digit."""
    name = "picky"

    def score_one(self, item):
        if int(item.prompt[0]) % 2 == 0:
            return ComponentResult(failed="picky: even prompt")
        return ComponentResult(value=0.25)

    def provenance(self):
        return {"version": "7"}

def make_component(cfg):
    return Picky()
'''


def test_drop_group_policy_and_component_values_on_the_wire(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "picky_scorer.py").write_text(PICKY)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(
        None,
        [
            f"model.path={json.dumps(str(tiny_model_dir))}",
            'actor.engine="torch"',
            "actor.group_size=4",
            "actor.concurrency=4",
            "actor.max_new_tokens=8",
            "learner.groups_per_step=1",
            "replay.max_staleness=1000",
            "task.num_prompts=400",
            "reward.weights={task = 1, picky = 1}",
            'reward.on_failure="drop_group"',
            'reward.modules.picky="picky_scorer:make_component"',
        ],
    )
    config = tmp_path / "config.toml"
    config.write_text(to_toml(cfg))
    with actor_on_hub(tmp_path, cfg, config, tiny_model_dir, lambda: SortEnv(SortVerifier())) as a:
        actor, endpoint, dataset = a
        actor.run(max_groups=8)
        pushed, dropped = actor.stats["groups_pushed"], actor.stats["reward_groups_dropped"]
        assert pushed + dropped == 8 and dropped >= 1 and pushed >= 1, (pushed, dropped)
        prompts = {r.prompt_id: r.prompt for r in load_dataset(dataset)}
        learner = Learner(endpoint, cfg)
        try:
            groups = learner.groups(int(pushed))
            for g in groups:
                assert int(prompts[g.prompt_id][0]) % 2 == 1  # no group of an even prompt came
                assert g.reward_components["picky"] == [0.25] * g.size
                assert [
                    round(r - t, 6)
                    for r, t in zip(g.rewards, g.reward_components["task"], strict=True)
                ] == [0.25] * g.size
                provenance = g.metadata["reward"]["provenance"]
                assert provenance["components"]["picky"] == {"version": "7"}
            assert learner.stats()["credits_returned"] >= dropped
        finally:
            learner.conn.close()
