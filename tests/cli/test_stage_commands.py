"""`keel data <stage>` commands generated from the registry: a flag per simple config field, with
the field's default and docstring as help, plus the common options and --set."""

import json

import typer.main
from typer.testing import CliRunner

from keel.cli.main import app
from keel.data import registry
from keel.data.documents import write_texts
from keel.data.filter import FilterConfig


def _data_group():
    group = typer.main.get_command(app)
    context = group.make_context("keel", ["data", "--help"], resilient_parsing=True)
    return group.get_command(context, "data")


def test_every_registered_stage_has_a_command_with_its_fields_as_flags():
    data = _data_group()
    for stage in registry.STAGES.values():
        assert stage.name.replace("_", "-") in data.commands, stage.name
    flags = {
        option: parameter
        for parameter in data.commands["extract"].params
        for option in parameter.opts
    }
    assert {"--html-field", "--keep-html", "--input", "-i", "--output", "--set", "--json"} <= set(
        flags
    )
    assert flags["--html-field"].default == "html"
    assert flags["--html-field"].help == "The column holding each page's HTML (a string)."
    assert "--model" in {o for p in data.commands["quality"].params for o in p.opts}


def test_a_field_flag_and_set_configure_the_stage(tmp_path):
    words = "the cat sat on the mat and it was happy with the day " * 3
    docs = write_texts(tmp_path / "docs", [words, "short words here"], source="t")
    runner = CliRunner()
    scored = runner.invoke(
        app, ["data", "quality", "-i", docs, "-o", str(tmp_path / "q"), "--quiet"]
    )
    assert scored.exit_code == 0, scored.output
    args = ["data", "filter", "-i", str(tmp_path / "q"), "--quiet", "--json", "--workers", "1"]
    ran = runner.invoke(
        app, [*args, "-o", str(tmp_path / "f"), "--min-word-count", "3", "--set", "languages=null"]
    )
    assert ran.exit_code == 0, ran.output
    config = json.loads(ran.stdout)["details"]["config"]
    assert config["min_word_count"] == 3 and config["languages"] is None
    assert config["max_word_count"] == FilterConfig().max_word_count  # the field's default
    bad = runner.invoke(app, [*args, "-o", str(tmp_path / "g"), "--min-word-count", "many"])
    assert bad.exit_code == 2 and "Invalid value" in bad.output
