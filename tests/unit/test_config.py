"""Config loading: TOML, `--set` overrides, strict errors naming the key, shipped presets."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import RunConfig, load_config, to_toml

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


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
