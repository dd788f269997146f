"""Configs a user can discover: --print-config round trips to the same run, a YAML may start from
a preset, list settings take --set by index, and contradicting settings are named."""

import subprocess
import sys
from pathlib import Path

import pytest

from keel.core.errors import ConfigError, UsageError
from keel.train.config import DataSource, apply_train_overrides
from keel.train.presets import PRESETS, load_run_config, preset


def keel(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "keel", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=120)


def test_printed_config_given_back_is_the_same_run(tmp_path):
    printed = keel("train", "--preset", "tiny-moe", "--steps", "40", "--print-config", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    config_file = tmp_path / "run.yaml"
    config_file.write_text(printed.stdout)
    expected = preset("tiny-moe")
    expected = type(expected)(**{**vars(expected), "steps": 40})
    assert load_run_config(str(config_file)) == expected
    assert f"run identity {expected.identity()[:16]}" in printed.stdout.splitlines()[0]

    again = keel("train", str(config_file), "--print-config", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout == printed.stdout  # every key, and the same identity line


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_round_trips_through_yaml(tmp_path, name):
    from keel.cli.train_commands import config_yaml

    path = tmp_path / "run.yaml"
    path.write_text(config_yaml(preset(name)))
    assert load_run_config(str(path)).identity() == preset(name).identity()


def test_a_yaml_may_start_from_a_preset_with_overrides_on_top(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("preset: tiny-moe\nmodel: {top_k: 1}\n")
    from_yaml = load_run_config(str(path))
    from_set = apply_train_overrides(preset("tiny-moe"), ["model.top_k=1"])
    assert from_yaml == from_set and from_yaml.identity() == from_set.identity()
    assert from_yaml.model.n_routed_experts == 8  # the rest of the preset's model is kept

    path.write_text("preset: tiny-moe\nsteps: 50\n")
    assert load_run_config(str(path), ["model.top_k=1"]) == apply_train_overrides(
        preset("tiny-moe"), ["steps=50", "model.top_k=1"]
    )
    path.write_text("preset: tiny-mo\n")
    with pytest.raises(UsageError, match="no preset 'tiny-mo'; choose one of: tiny-moe"):
        load_run_config(str(path))
    path.write_text("preset: tiny-moe\nmodel: {topk: 1}\n")
    with pytest.raises(ConfigError, match=r"run\.yaml: config\.model\.topk: unknown key"):
        load_run_config(str(path))


def test_list_settings_take_set_by_index():
    config = apply_train_overrides(
        preset("tiny-dense"),
        ["data.0.cache=/caches/a", "data.1.cache=/caches/b", "data.1.weight=2",
         "eval_data.0=/caches/val", "phases.0.seq_len=64"],
    )  # fmt: skip
    assert config.data == (DataSource("/caches/a"), DataSource("/caches/b", 2.0))
    assert config.eval_data == ("/caches/val",)
    assert config.phases[0].seq_len == 64
    whole = apply_train_overrides(preset("tiny-dense"), ["data=[{cache: /caches/a}]"])
    assert whole.data == (DataSource("/caches/a"),)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "data.0.weight=2",
            "--set data.0.weight=2: a new item of data needs cache: set data.0.cache first, or "
            "the list as a whole: --set 'data=[{cache: PATH}]'",
        ),
        (
            "data.2.cache=/x",
            "--set data.2.cache=/x: data has 0 items: add item 0 next (--set data.0...), or set "
            "the list as a whole: --set 'data=[{cache: PATH}]'",
        ),
    ],
)
def test_a_list_index_that_cannot_be_set_shows_the_form_that_works(override, message):
    with pytest.raises(ConfigError) as raised:
        apply_train_overrides(preset("tiny-dense"), [override])
    assert str(raised.value) == message


def test_moe_settings_on_a_dense_model_are_named_with_what_contradicts_them(tmp_path):
    assert preset("tiny-dense").contradictions() == []
    assert preset("tiny-moe").contradictions() == []
    dense = apply_train_overrides(preset("tiny-dense"), ["model.top_k=4"])
    assert dense.contradictions() == [
        "model.top_k=4: an MoE setting, but model.n_routed_experts is 0 (a dense model), so it "
        "does nothing; set model.n_routed_experts for an MoE model, or remove it"
    ]
    result = keel("train", "--preset", "tiny-dense", "--set", "model.top_k=4", "--print-config",
                  cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "model.top_k=4" in warnings[0]
    assert "model.n_routed_experts is 0" in warnings[0]
