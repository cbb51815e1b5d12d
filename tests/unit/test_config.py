"""Config loading: TOML, `--set` overrides, strict errors naming the key, shipped presets."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from asyncrl.config import ALARM_NAMES, RunConfig, load_config, to_toml

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
CONFIGS = sorted(CONFIGS_DIR.glob("*.toml"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_defaults_without_a_file() -> None:
    assert load_config(None) == RunConfig()


def test_toml_values_are_applied(tmp_path: Path) -> None:
    cfg = load_config(
        write(tmp_path, '[replay]\nmax_staleness = 2\nsampling = "freshest"\n[learner]\nlr = 1\n')
    )
    assert cfg.replay.max_staleness == 2 and cfg.replay.sampling == "freshest"
    assert cfg.learner.lr == 1.0 and isinstance(cfg.learner.lr, float)


def test_set_overrides_win_over_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[replay]\nmax_staleness = 2\n")
    cfg = load_config(
        path,
        [
            "replay.max_staleness=0",
            "actor.engine=vllm",
            "loss.adv_std_norm=false",
            'replay.bind="ipc:///tmp/x"',
            "weights.timeout_s=2.5",
        ],
    )
    assert cfg.replay.max_staleness == 0 and cfg.actor.engine == "vllm"
    assert cfg.loss.adv_std_norm is False and cfg.replay.bind == "ipc:///tmp/x"
    assert cfg.weights.timeout_s == 2.5


@pytest.mark.parametrize(
    ("text", "overrides", "key"),
    [
        ("[nosuch]\nx = 1\n", [], "nosuch"),
        ("[replay]\nnosuch = 1\n", [], "replay.nosuch"),
        ("[replay]\nmax_staleness = -1\n", [], "replay.max_staleness"),
        ("[replay]\nmax_staleness = 1.5\n", [], "replay.max_staleness"),
        ("[replay]\nsampling = 'random'\n", [], "replay.sampling"),
        ("[loss]\nadv_std_norm = 1\n", [], "loss.adv_std_norm"),
        ("[replay]\nheartbeat_timeout_s = 0.5\n", [], "replay.heartbeat_timeout_s"),
        ("", ["learner.groups_per_step=0"], "learner.groups_per_step"),
        ("", ["actor.nosuch=1"], "actor.nosuch"),
        ("", ["replay.max_staleness"], "replay.max_staleness"),
        ("", ["max_staleness=1"], "max_staleness"),
        ("replay = 3\n", [], "replay"),
        ("", ["actor.concurrency=4", "actor.credit_window=2"], "actor.credit_window"),
        ("", ["actor.temperature=3.0"], "actor.temperature"),
        ("", ["run.num_actors=0"], "run.num_actors"),
        ("", ["replay.snapshot_keep_segments=0"], "replay.snapshot_keep_segments"),
        ("", ["replay.io_threads=0"], "replay.io_threads"),
        ("", ["model.hidden_size=130"], "model.hidden_size"),
        ("", ["replay.max_staleness=1", "learner.publish_every=3"], "learner.publish_every"),
        ("", ["learner.groups_per_step=2", "learner.minibatches=3"], "learner.minibatches"),
    ],
)
def test_bad_settings_fail_naming_the_key(
    tmp_path: Path, text: str, overrides: list[str], key: str
) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(write(tmp_path, text), overrides)


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        load_config(tmp_path / "absent.toml")
    with pytest.raises(ValueError, match="invalid TOML"):
        load_config(write(tmp_path, "[replay\n"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig) and len(cfg.config_hash()) == 16


def test_shipped_configs_exist() -> None:
    assert any(p.name == "tiny_cpu.toml" for p in CONFIGS)


def test_resolved_config_round_trips_through_toml(tmp_path: Path) -> None:
    cfg = load_config(None, ["replay.max_staleness=3", "actor.engine=vllm"])
    assert load_config(write(tmp_path, to_toml(cfg))) == cfg


def test_config_hash_covers_shared_settings_only() -> None:
    base = load_config(None).config_hash()
    assert load_config(None, ["replay.max_staleness=1"]).config_hash() != base
    assert load_config(None, ["actor.group_size=4"]).config_hash() != base
    assert load_config(None, ["run.run_dir=elsewhere"]).config_hash() == base
    assert load_config(None, ["replay.bind=ipc:///tmp/hub"]).config_hash() == base
    assert load_config(None, ["replay.io_threads=1"]).config_hash() == base  # the hub's own


def test_the_shipped_configs_are_all_loaded() -> None:
    assert {p.name for p in CONFIGS} >= {
        "tiny_cpu.toml",
        "tiny_reward_cpu.toml",
        "tiny_tools_cpu.toml",
    }


def test_every_section_class_is_importable_from_asyncrl_config() -> None:
    import asyncrl.config as config

    for name in config.__all__:
        assert hasattr(config, name), name
    for f in dataclasses.fields(RunConfig):
        assert type(getattr(RunConfig(), f.name)).__name__ in config.__all__, f.name


# --- lists and maps: TOML arrays and tables --------------------------------------------------


def test_lists_and_maps_are_toml_arrays_and_tables(tmp_path: Path) -> None:
    cfg = load_config(
        write(
            tmp_path,
            '[task]\ntools = ["calculator", "lookup"]\n'
            '[reward]\ngates = ["format", "judge>=0.6"]\n'
            "[reward.weights]\ntask = 1\nformat = 0.2\n"
            '[reward.modules]\nmine = "my_pkg.scorers:make_component"\n'
            '[alarms]\npause_on = ["ess_collapse"]\nstop_on = ["all"]\n'
            "[launch]\nactor_resources = {env_worker = 1}\n",
        )
    )
    assert cfg.task.tools == ("calculator", "lookup")
    assert cfg.reward.weights == {"task": 1.0, "format": 0.2}
    assert all(isinstance(w, float) for w in cfg.reward.weights.values())
    assert cfg.reward.gate_list == [("format", ">", 0.0), ("judge", ">=", 0.6)]
    assert cfg.reward.modules == {"mine": "my_pkg.scorers:make_component"}
    assert cfg.alarms.names("pause_on") == ("ess_collapse",)
    assert cfg.alarms.names("stop_on") == ALARM_NAMES
    assert cfg.launch.actor_resources == {"env_worker": 1.0}
    assert load_config(write(tmp_path, to_toml(cfg))) == cfg


def test_set_overrides_one_entry_of_a_table_or_the_whole_value(tmp_path: Path) -> None:
    path = write(tmp_path, "[reward.weights]\ntask = 1\nformat = 0.2\n")
    cfg = load_config(
        path, ["reward.weights.format=0.5", "reward.modules.mine=my_pkg.scorers:make"]
    )
    assert cfg.reward.weights == {"task": 1.0, "format": 0.5}
    assert cfg.reward.modules == {"mine": "my_pkg.scorers:make"}
    # an entry over no table in the file joins the default table
    assert load_config(None, ["reward.weights.format=0.5"]).reward.weights == {
        "task": 1.0,
        "format": 0.5,
    }
    cfg = load_config(
        path,
        [
            "reward.weights={format = 1}",
            'task.tools=["calculator"]',
            'alarms.stop_on=["nan"]',
            "launch.actor_resources.env_worker=2",
        ],
    )
    assert cfg.reward.weights == {"format": 1.0} and cfg.task.tools == ("calculator",)
    assert cfg.alarms.stop_on == ("nan",) and cfg.launch.actor_resources == {"env_worker": 2.0}


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        (
            '[reward]\nweights = "task=1, format=0.2"\n',
            [],
            "reward.weights: must be a TOML table, write weights = {task = 1.0, format = 0.2} "
            "under [reward]",
        ),
        (
            "",
            ['reward.modules="mine=pkg.mod:make"'],
            'reward.modules: must be a TOML table, write modules = {mine = "pkg.mod:make"}',
        ),
        (
            "",
            ["task.tools=calculator,lookup"],
            'task.tools: must be a TOML array, write tools = ["calculator", "lookup"] under [task]',
        ),
        ("", ['reward.gates="format"'], 'write gates = ["format"] under [reward]'),
        ("", ["alarms.pause_on=kl_spike"], 'write pause_on = ["kl_spike"] under [alarms]'),
        ("", ['launch.actor_resources="gpu_a=1"'], "write actor_resources = {gpu_a = 1.0}"),
        ('[reward]\nweights = "task=1"\n', ["reward.weights.format=1"], "write weights ="),
    ],
)
def test_the_comma_separated_string_forms_are_refused_with_the_toml_to_write(
    tmp_path: Path, text: str, overrides: list[str], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(write(tmp_path, text), overrides)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["reward.weights.format=high"], "reward.weights.format: must be a number"),
        (["reward.weights={}"], "reward.weights: must be a table naming at least one component"),
        (["reward.modules.mine=no_colon"], "reward.modules.mine: must look like"),
        (['reward.gates=["format>>1"]'], "reward.gates"),
        (["task.tools=[1]"], r"task.tools\[0\]: must be a string"),
        (['alarms.pause_on=["typo"]'], "alarms.pause_on: unknown alarms"),
        (
            ["launch.actor_resources.gpu_a=-1"],
            "launch.actor_resources.gpu_a: must be a number >= 0",
        ),
        (["replay.max_staleness.x=1"], "replay.max_staleness is not a table"),
        (["reward.nosuch.x=1"], "reward.nosuch: unknown key"),
        (["a.b.c.d=1"], "expected section.key=value or section.key.name=value"),
    ],
)
def test_bad_list_and_table_values_name_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        load_config(None, overrides)


def test_config_hash_is_stable_for_configs_without_tools() -> None:
    # What `Hello` carries: processes of another asyncrl build compare it.
    assert load_config(None).config_hash() == "4074372236dc1e1c"
    assert load_config(CONFIGS_DIR / "tiny_cpu.toml").config_hash() == "4035cd443f6ace8f"
    tools = load_config(None, ['task.tools=["calculator", "lookup"]']).config_hash()
    assert tools != "4074372236dc1e1c"
