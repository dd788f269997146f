"""User mistakes get one line on stderr and exit code 2, never a traceback."""

import base64
import os
import subprocess

import pytest
from cli_support import error_lines


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


# -- output directories on a full disk, a read-only file system, or a file: one line ---------
def _mount(*args: str) -> None:
    """Run mount(8); as root this must work (the test fails, not skips, when it does not)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs or a read-only bind mount needs root")
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs: writing more fails with ENOSPC."""
    disk = tmp_path / "small"
    disk.mkdir()
    _mount("-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk))
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory bind-mounted read-only (EROFS even for root)."""
    source, target = tmp_path / "ro-source", tmp_path / "ro"
    source.mkdir()
    target.mkdir()
    _mount("--bind", "-o", "ro", str(source), str(target))
    yield target
    subprocess.run(["umount", "-l", str(target)], check=True)


def _incompressible_docs(root, count=300, chars=2000):
    from keel.data.documents import write_texts

    texts = [base64.b64encode(os.urandom(chars * 3 // 4)).decode() for _ in range(count)]
    return write_texts(root / "docs", texts, 2, "random")


def _in_process(*args: str) -> subprocess.CompletedProcess:
    """The real `keel` command run in this process (no interpreter start-up: for checks that
    end before any work), as a CompletedProcess. An uncaught exception fails the test."""
    from typer.testing import CliRunner

    from keel.cli.main import app

    result = CliRunner().invoke(app, [*args, "--workers", "1"])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def _assert_one_error_line(result, exit_code, *fragments):
    assert result.returncode == exit_code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = error_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_disk_full_is_one_line_and_removes_the_staging_directory(cli, small_disk):
    docs = _incompressible_docs(cli.root)
    output = small_disk / "out"
    result = cli.run("data", "dedup", "--input", docs, "--output", str(output), "--workers", "1")
    _assert_one_error_line(result, 1, "no space left", str(output))
    assert list(small_disk.iterdir()) == []  # no *.staging-* directory filling the disk


def test_read_only_output_is_one_line_before_any_work(cli, read_only_dir):
    docs = _incompressible_docs(cli.root, count=4)
    output = read_only_dir / "out"
    result = _in_process("data", "dedup", "--input", docs, "--output", str(output))
    _assert_one_error_line(result, 2, "read-only", str(output))
    assert "stage 0" not in result.stderr  # refused before the first pass ran


@pytest.mark.parametrize("where", ["output-is-a-file", "parent-is-a-file"])
def test_output_path_through_a_file_is_one_line(cli, where):
    docs = _incompressible_docs(cli.root, count=4)
    (cli.root / "notes.txt").write_text("keep me\n")
    output = cli.root / "notes.txt"
    if where == "parent-is-a-file":
        output = output / "out"
    result = _in_process("data", "dedup", "--input", docs, "--output", str(output))
    _assert_one_error_line(result, 2, str(cli.root / "notes.txt"))
    assert (cli.root / "notes.txt").read_text() == "keep me\n"


def test_os_errors_a_user_fixes_are_one_line_from_any_command(capsys):
    import errno

    import typer

    from keel.cli.output import user_errors

    @user_errors
    def command(code: int) -> None:
        raise OSError(code, os.strerror(code), "/data/model.npz")

    with pytest.raises(typer.Exit) as caught:
        command(errno.ENOSPC)
    assert caught.value.exit_code == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"error: {os.strerror(errno.ENOSPC)}: /data/model.npz: free space there or "
        "choose another path"
    ]
    with pytest.raises(OSError):  # anything else is a bug: its traceback is kept
        command(errno.EIO)
