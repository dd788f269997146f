"""Tests for keel.core.config: typed loading, dumping and `--set` overrides of dataclass configs."""

from __future__ import annotations

import dataclasses
import enum
import json
import pathlib
import re
from typing import Literal

import pytest

from keel.core.config import (
    apply_overrides,
    dump_config,
    from_dict,
    load_config,
    parse_override,
    to_dict,
)
from keel.core.errors import ConfigError


class Precision(enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"


@dataclasses.dataclass(frozen=True)
class Model:
    d_model: int
    n_layers: int = 2
    activation: Literal["gelu", "relu"] = "gelu"


@dataclasses.dataclass(frozen=True)
class Train:
    lr: float = 0.1
    warmup: int | None = None
    compile: bool = False
    precision: Precision = Precision.FP32
    betas: tuple[float, float] = (0.9, 0.95)
    schedule: list[int] = dataclasses.field(default_factory=lambda: [10, 20])


@dataclasses.dataclass(frozen=True)
class Config:
    model: Model
    train: Train = Train()
    name: str = "run"
    out_dir: pathlib.Path = pathlib.Path("runs")
    weights: dict[str, float] = dataclasses.field(default_factory=lambda: {"web": 1.0})
    tags: tuple[str, ...] = ()


SAMPLE = {
    "model": {"d_model": 64, "n_layers": 4},
    "train": {"lr": 3, "precision": "bf16", "betas": [0.8, 0.9], "warmup": 100},
    "name": "tiny",
    "out_dir": "/tmp/out",
    "weights": {"web": 0.5, "code": 0.5},
    "tags": ["a", "b"],
}

EXPECTED = Config(
    model=Model(d_model=64, n_layers=4),
    train=Train(lr=3.0, precision=Precision.BF16, betas=(0.8, 0.9), warmup=100),
    name="tiny",
    out_dir=pathlib.Path("/tmp/out"),
    weights={"web": 0.5, "code": 0.5},
    tags=("a", "b"),
)


def base() -> Config:
    return Config(model=Model(d_model=8))


def test_from_dict_builds_nested_typed_objects() -> None:
    config = from_dict(Config, SAMPLE)
    assert config == EXPECTED
    assert isinstance(config.train.lr, float)
    assert isinstance(config.out_dir, pathlib.Path)
    assert config.train.betas == (0.8, 0.9)


def test_load_yaml_and_json(tmp_path: pathlib.Path) -> None:
    (tmp_path / "c.yaml").write_text(
        "model:\n  d_model: 64\n  n_layers: 4\ntrain:\n  lr: 3\n  precision: bf16\n"
        "  betas: [0.8, 0.9]\n  warmup: 100\nname: tiny\nout_dir: /tmp/out\n"
        "weights: {web: 0.5, code: 0.5}\ntags: [a, b]\n"
    )
    (tmp_path / "c.json").write_text(json.dumps(SAMPLE))
    assert load_config(tmp_path / "c.yaml", Config) == EXPECTED
    assert load_config(str(tmp_path / "c.json"), Config) == EXPECTED


def test_load_applies_overrides_and_reads_1e_3_as_float(tmp_path: pathlib.Path) -> None:
    (tmp_path / "c.yml").write_text("model: {d_model: 8}\ntrain: {lr: 1e-3}\n")
    config = load_config(tmp_path / "c.yml", Config, ["train.warmup=5"])
    assert config.train.lr == pytest.approx(1e-3)
    assert config.train.warmup == 5


def test_round_trip_through_to_dict_and_files(tmp_path: pathlib.Path) -> None:
    data = to_dict(EXPECTED)
    assert data["train"]["precision"] == "bf16"
    assert data["out_dir"] == "/tmp/out"
    assert data["tags"] == ["a", "b"]
    assert from_dict(Config, data) == EXPECTED
    for name in ("out.yaml", "out.json"):
        dump_config(EXPECTED, tmp_path / name)
        assert load_config(tmp_path / name, Config) == EXPECTED


def test_empty_yaml_file_means_empty_mapping(tmp_path: pathlib.Path) -> None:
    @dataclasses.dataclass
    class AllDefaults:
        x: int = 1

    (tmp_path / "empty.yaml").write_text("")
    assert load_config(tmp_path / "empty.yaml", AllDefaults) == AllDefaults()


@pytest.mark.parametrize(
    ("override", "path", "expected"),
    [
        ("model.n_layers=12", ("model", "n_layers"), 12),
        ("train.lr=0.5", ("train", "lr"), 0.5),
        ("train.lr=1e-3", ("train", "lr"), 1e-3),
        ("train.lr=2", ("train", "lr"), 2.0),
        ("name=big run", ("name",), "big run"),
        ("name=2024", ("name",), "2024"),
        ("name=", ("name",), ""),
        ("train.compile=true", ("train", "compile"), True),
        ("train.precision=bf16", ("train", "precision"), Precision.BF16),
        ("train.precision=BF16", ("train", "precision"), Precision.BF16),
        ("train.warmup=50", ("train", "warmup"), 50),
        ("train.warmup=null", ("train", "warmup"), None),
        ("train.schedule=[1, 2, 3]", ("train", "schedule"), [1, 2, 3]),
        ("train.betas=[0.5, 0.6]", ("train", "betas"), (0.5, 0.6)),
        ("out_dir=/data/x", ("out_dir",), pathlib.Path("/data/x")),
        ("model.activation=relu", ("model", "activation"), "relu"),
    ],
)
def test_override_sets_typed_nested_values(
    override: str, path: tuple[str, ...], expected: object
) -> None:
    value: object = apply_overrides(base(), [override])
    for key in path:
        value = getattr(value, key)
    assert value == expected
    assert type(value) is type(expected)


def test_overrides_return_new_object_and_leave_frozen_original_unchanged() -> None:
    original = base()
    updated = apply_overrides(original, ["model.d_model=16", "weights.web=0.25"])
    assert original == base()
    assert original.weights == {"web": 1.0}
    assert updated.model.d_model == 16
    assert updated.train is original.train


def test_override_dict_field_sets_existing_and_adds_new_keys() -> None:
    updated = apply_overrides(base(), ["weights.web=0.3", "weights.code=0.7"])
    assert updated.weights == {"web": 0.3, "code": 0.7}
    with pytest.raises(ConfigError, match=r"weights\.web=x: expected float, got str 'x'"):
        apply_overrides(base(), ["weights.web=x"])


def test_override_nested_dataclass_from_mapping() -> None:
    updated = apply_overrides(base(), ["model={d_model: 32, activation: relu}"])
    assert updated.model == Model(d_model=32, activation="relu")


def test_override_field_holding_a_placeholder_of_another_type() -> None:
    @dataclasses.dataclass(frozen=True)
    class WithPlaceholder:
        tokenizer: str

    placeholder = object()
    obj = WithPlaceholder(tokenizer=placeholder)  # type: ignore[arg-type]
    assert apply_overrides(obj, ["tokenizer=gpt2"]).tokenizer == "gpt2"


def test_parse_override() -> None:
    assert parse_override("a.b.c=3") == (("a", "b", "c"), 3)
    assert parse_override("x=[1, 2]") == (("x",), [1, 2])
    assert parse_override("x=") == (("x",), "")
    assert parse_override("x=a=b") == (("x",), "a=b")


@pytest.mark.parametrize("text", ["xyz", "=3", "a..b=1", ".a=1"])
def test_bad_override_syntax(text: str) -> None:
    with pytest.raises(ConfigError, match=f"--set expects key=value, got '{text}'"):
        parse_override(text)
    with pytest.raises(ConfigError, match="expects key=value"):
        apply_overrides(base(), [text])


def test_unknown_key_names_the_path_and_lists_valid_keys() -> None:
    data = {"model": {"d_modl": 8}}
    with pytest.raises(ConfigError) as info:
        from_dict(Config, data)
    message = str(info.value)
    assert message.startswith("config.model.d_modl: unknown key")
    assert "did you mean 'd_model'" in message
    assert "d_model, n_layers, activation" in message
    assert "\n" not in message


def test_unknown_override_key_names_the_owner_and_its_keys() -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides(base(), ["model.x=1"])
    assert (
        str(info.value)
        == "--set model.x=1: no key 'x' in Model (keys: d_model, n_layers, activation)"
    )
    with pytest.raises(ConfigError, match=r"no key 'n_layer' in Model \(did you mean 'n_layers'"):
        apply_overrides(base(), ["model.n_layer=3"])


def test_missing_required_field_is_named() -> None:
    with pytest.raises(ConfigError, match=r"config\.model: missing required key\(s\) d_model"):
        from_dict(Config, {"model": {"n_layers": 3}})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"lr": "abc"}, "config.lr: expected float, got str 'abc'"),
        ({"lr": True}, "config.lr: expected float, got bool True"),
        ({"compile": 1}, "config.compile: expected bool, got int 1"),
        ({"warmup": True}, "config.warmup: expected int, got bool True"),
        ({"warmup": "10"}, "config.warmup: expected int, got str '10'"),
        ({"precision": "fp8"}, "config.precision: expected Precision"),
        ({"betas": [0.1]}, "config.betas: expected tuple[float, float], got list [0.1]"),
        ({"schedule": [1, "x"]}, "config.schedule[1]: expected int, got str 'x'"),
    ],
)
def test_wrong_types_are_rejected(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_dict(Train, data)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.d_model=abc", "--set model.d_model=abc: expected int, got str 'abc'"),
        ("model.d_model=true", "--set model.d_model=true: expected int, got bool True"),
        ("train.compile=1", "--set train.compile=1: expected bool, got int 1"),
        ("model.d_model=null", "--set model.d_model=null: expected int, got None"),
    ],
)
def test_wrong_override_types_are_rejected(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides(base(), [override])
    assert str(info.value) == message


def test_literal_rejects_values_outside_the_set() -> None:
    with pytest.raises(ConfigError, match=r"config\.activation: expected one of 'gelu', 'relu'"):
        from_dict(Model, {"d_model": 8, "activation": "swish"})
    with pytest.raises(ConfigError, match="expected one of 'gelu', 'relu', got str 'tanh'"):
        apply_overrides(base(), ["model.activation=tanh"])


def test_missing_file(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=re.escape(f"config file not found: {missing}")):
        load_config(missing, Config)


def test_unsupported_extension(tmp_path: pathlib.Path) -> None:
    (tmp_path / "c.toml").write_text("")
    with pytest.raises(ConfigError, match=r"unsupported config format '\.toml'"):
        load_config(tmp_path / "c.toml", Config)


def test_malformed_files_name_the_file_and_line(tmp_path: pathlib.Path) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model:\n  d_model: 8\n  n_layers: [1, 2\n")
    with pytest.raises(ConfigError, match=re.escape(str(bad_yaml)) + r":\d+: invalid YAML") as info:
        load_config(bad_yaml, Config)
    assert info.value.exit_code == 2
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"model":\n  {"d_model": 8,}}')
    with pytest.raises(ConfigError, match=re.escape(f"{bad_json}:2: invalid JSON")):
        load_config(bad_json, Config)


def test_file_errors_name_the_file_and_key(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model: {d_model: 8}\ntrain: {lr: fast}\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: config.train.lr: expected float")):
        load_config(path, Config)


def test_override_an_item_of_a_tuple_or_list_by_index() -> None:
    config = apply_overrides(EXPECTED, ["train.betas.1=0.99", "train.schedule.0=5", "tags.1=c"])
    assert config.train.betas == (0.8, 0.99)
    assert config.train.schedule == [5, 20]
    assert config.tags == ("a", "c")
    with pytest.raises(ConfigError, match=r"train\.betas has 2 items, no item 2"):
        apply_overrides(EXPECTED, ["train.betas.2=0.5"])
    with pytest.raises(ConfigError, match="expected float"):
        apply_overrides(EXPECTED, ["train.betas.0=fast"])
