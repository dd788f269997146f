"""User mistakes get one line on stderr and exit code 2, never a traceback."""

import pytest
from conftest import error_lines


def _assert_one_line_usage_error(result, *fragments):
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines == error_lines(result.stderr), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_missing_experiment_file(cli):
    result = cli.run("run", "no/such/experiment.py")
    _assert_one_line_usage_error(result, "experiment file not found", "no/such/experiment.py")


@pytest.mark.parametrize(
    "source",
    ["x = 1\n", "STEPS = []\n", "from keel.steps import Step\nSTEPS = ['not a step']\n"],
    ids=["no-steps-variable", "empty-steps", "not-steps"],
)
def test_file_that_declares_no_steps(cli, source):
    result = cli.run("run", str(cli.write("empty.py", source)))
    _assert_one_line_usage_error(result, "empty.py")


def test_experiment_that_fails_to_import_names_file_and_line(cli):
    broken = cli.write("broken.py", "import os\nraise RuntimeError('no GPU here')\n")
    _assert_one_line_usage_error(cli.run("run", str(broken)), "broken.py:2", "no GPU here")
    syntax = cli.write("syntax.py", "def f(:\n")
    _assert_one_line_usage_error(cli.run("run", str(syntax)), "syntax.py:1", "syntax error")


UNHASHABLE = """
from keel.steps import Step

def work(config, output):
    pass

STEPS = [Step("s", work, {"transform": CONFIG_VALUE})]
"""


@pytest.mark.parametrize(
    ("value", "what"),
    [("lambda x: x", "lambda"), ("open(__file__)", "open file")],
    ids=["lambda", "open-file"],
)
def test_config_that_cannot_be_hashed(cli, value, what):
    experiment = cli.write("unhashable.py", UNHASHABLE.replace("CONFIG_VALUE", value))
    result = cli.run("run", str(experiment), "--prefix", str(cli.prefix))
    _assert_one_line_usage_error(result, "s.config.transform", what)
    assert not cli.prefix.exists()  # refused before any work


def test_set_on_a_key_that_does_not_exist(cli):
    result = cli.run("run", str(cli.experiment()), "--set", "b.valeu=3")
    _assert_one_line_usage_error(result, "b.valeu=3", "valeu", "value")


def test_set_on_a_step_that_does_not_exist(cli):
    result = cli.run("run", str(cli.experiment()), "--set", "zz.value=3")
    _assert_one_line_usage_error(result, "zz.value=3", "steps: a, b, c, d")


def test_set_with_a_value_of_the_wrong_type(cli):
    result = cli.run("run", str(cli.experiment()), "--set", "b.value=many")
    _assert_one_line_usage_error(result, "b.value=many", "expected int")


def test_set_without_equals(cli):
    _assert_one_line_usage_error(
        cli.run("run", str(cli.experiment()), "--set", "b.value"), "key=value"
    )


def test_bad_force_regex(cli):
    result = cli.run("run", str(cli.experiment()), "--force", "(")
    _assert_one_line_usage_error(result, "--force", "regular expression")
