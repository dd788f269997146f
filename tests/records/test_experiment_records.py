"""Experiment records end to end, in real `keel` processes: `keel experiment new` -> `keel run
--experiment` -> `keel experiment report`, the id in the runs' records (never in a step's
identity), and `keel train --report-to wandb` in W&B's offline mode.

One module fixture trains the experiment once (two tiny dense runs of one compiled program and a
step that fails); the tests read what it left.
"""

import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from wandb_file import read_offline_run

from keel.core.errors import UsageError
from keel.telemetry import TelemetryStore

EXPERIMENT_FILE = """
from dataclasses import replace

from keel.steps import Step
from keel.train.config import DataSource, Phase
from keel.train.presets import preset
from keel.train.steps import train_step

EXPERIMENT = "{record}"


def tiny(seed):
    base = preset("tiny-dense")
    return replace(
        base,
        model=replace(base.model, vocab_size=512, n_layers=1),
        phases=(replace(base.phases[0], seq_len=64),),
        data=(DataSource("{cache}"),),
        steps=2, batch_size=2, eval_every=2, eval_batches=1, seed=seed,
    )


def broken(config, output):
    raise ValueError("bad value at row 7")


STEPS = [
    train_step("baseline", tiny(0)),
    train_step("seed1", tiny(1)),
    Step("broken", broken, {{"n": 1}}),
]
"""
TRAIN_ARGS = (
    *("train", "--preset", "tiny-dense", "--steps", "2", "--quiet"),
    *("--set", "model.vocab_size=512", "--set", "model.n_layers=1"),
    *("--set", "phases.0.seq_len=64", "--set", "batch_size=2"),
    *("--set", "eval_every=2", "--set", "eval_batches=1"),
)
"""The fixture's baseline as a `keel train` command: the same compiled program (cached)."""


def keel(project: Path, *args: str, env: dict | None = None, code: int = 0):
    import os

    done = subprocess.run(
        [sys.executable, "-m", "keel", *args],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )
    assert done.returncode == code, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def project(tmp_path_factory, wikitext_cache):
    """A project with two records: the first ran the experiment file (its EXPERIMENT), the
    second ran it again with --experiment (every training step cached)."""
    root = tmp_path_factory.mktemp("project")
    first = _new_record(root, "Seed noise", "Seeds differ")
    second = _new_record(root, "again", "Cached runs count")
    experiment = EXPERIMENT_FILE.format(record=first["id"], cache=wikitext_cache)
    (root / "compare.py").write_text(experiment)
    run = ("run", "compare.py", "--prefix", "out", "--json")
    runs = [
        keel(root, *run, env={"KEEL_TELEMETRY": str(root / "telemetry")}, code=1),
        keel(root, *run, "--experiment", second["id"], code=1),
    ]
    runs = [json.loads(done.stdout) for done in runs]
    reports = [keel(root, "experiment", "report", r["id"], "--json") for r in (first, second)]
    reports = [json.loads(done.stdout) for done in reports]
    return {"root": root, "records": [first, second], "runs": runs, "reports": reports}


def _new_record(root: Path, name: str, hypothesis: str) -> dict:
    done = keel(root, "experiment", "new", name, "--hypothesis", hypothesis, "--json")
    return json.loads(done.stdout)


def test_report_names_every_run_with_its_final_metrics_plots_and_links(project):
    root, report = project["root"], project["reports"][0]
    markdown = Path(report["markdown"]).read_text()
    for name in ("baseline", "seed1"):
        run_dir = next((root / "out").glob(f"{name}-*"))
        last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        row = next(line for line in markdown.splitlines() if line.startswith(f"| {run_dir.name}"))
        assert "finished" in row
        assert f"{last['loss']:.4f}" in row and f"{last['eval_bpb']:.4f}" in row
    assert re.search(r"\| broken-\w+ \| FAILED \| ValueError: bad value at row 7 \|", markdown)
    assert "| seed | 0 | 1 |" in markdown  # the config diff against the baseline
    links = re.findall(r"\]\(([^)]+)\)", markdown)
    assert {"loss.png", "eval.png"} <= set(links)
    for link in links:
        assert (Path(report["markdown"]).parent / link).is_file(), link
    page = Path(report["html"]).read_text()
    assert page.count('src="data:image/png;base64,') == 2  # self-contained: loss and eval
    assert 'src="http' not in page and "baseline" in page and "FAILED" in page


def test_cached_runs_belong_to_the_record_that_reused_them(project):
    executed, cached = project["runs"]
    assert sorted(executed["executed"]) == ["baseline", "seed1"]
    assert sorted(cached["cached"]) == ["baseline", "seed1"] and cached["failed"] == ["broken"]
    markdown = Path(project["reports"][1]["markdown"]).read_text()
    assert project["reports"][1]["training_runs"] == 2
    assert "| cached |" in markdown and "ValueError: bad value at row 7" in markdown


def test_runs_carry_the_experiment_id_in_their_records_not_their_identity(project):
    root, (first, second) = project["root"], project["records"]
    baseline = next((root / "out").glob("baseline-*"))
    assert json.loads((baseline / ".keel/step.json").read_text())["experiment"] == first["id"]
    broken = next((root / "out/.keel/steps").glob("broken-*"))
    assert json.loads((broken / "attempt.json").read_text())["experiment"] == second["id"]
    events = [json.loads(line) for line in (baseline / "events.jsonl").read_text().splitlines()]
    assert {"event": "experiment", "step": 0, "experiment": first["id"]} in events
    rows = TelemetryStore(str(root / "telemetry")).query(
        'SELECT run, experiment FROM "experiment.runs" ORDER BY run'
    )
    assert rows.column("experiment").to_pylist() == [first["id"]] * 2
    assert rows.column("run").to_pylist()[0] == str(baseline)
    runs = yaml.safe_load(keel(root, "experiment", "show", first["id"], "--json").stdout)["runs"]
    assert [run["outcome"] for run in runs] == ["failed"]


def test_list_and_show(project):
    root, (first, second) = project["root"], project["records"]
    listed = json.loads(keel(root, "experiment", "list", "--json").stdout)["experiments"]
    assert [(r["id"], r["name"], r["runs"]) for r in listed] == [
        (first["id"], "seed-noise", 1),
        (second["id"], "again", 1),
    ]
    record = Path(first["directory"])
    assert "Seeds differ" in (record / "README.md").read_text()
    assert yaml.safe_load((record / "experiment.yaml").read_text())["hypothesis"] == "Seeds differ"


@pytest.mark.parametrize(
    "args",
    [
        ("run", "compare.py", "--experiment", "nope", "--prefix", "out"),
        ("experiment", "show", "nope"),
        ("experiment", "report", "nope"),
    ],
)
def test_an_unknown_experiment_id_is_one_error_line(project, args):
    done = keel(project["root"], *args, code=2)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: no experiment 'nope'"), done.stderr


def test_report_to_wandb_offline_mirrors_summary_config_and_history(project, tmp_path):
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    run_dir = tmp_path / "run"
    cache = yaml.safe_load(
        next((project["root"] / "out").glob("baseline-*")).joinpath("config.yaml").read_text()
    )["data"][0]["cache"]
    args = (*TRAIN_ARGS, "--data", cache, "--output", str(run_dir), "--report-to", "wandb")
    keel(tmp_path, *args, env=env)
    (log,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    mirrored = read_offline_run(log)
    assert mirrored.config == yaml.safe_load((run_dir / "config.yaml").read_text())
    result = json.loads((run_dir / "result.json").read_text())
    numbers = {k: v for k, v in result.items() if isinstance(v, float | int) and k != "step"}
    assert mirrored.summary == pytest.approx(numbers)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    expected = [{k: v for k, v in line.items() if k != "phase"} for line in metrics]
    assert mirrored.history == expected


def test_report_to_wandb_without_wandb_says_how_to_install(monkeypatch):
    from keel.train.wandb_report import INSTALL_HINT, check_report_target

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(UsageError, match=re.escape(INSTALL_HINT)):
        check_report_target("wandb")
    with pytest.raises(UsageError, match="use one of wandb"):
        check_report_target("tensorboard")


def test_a_stopped_training_run_is_reported_with_its_curve_and_marked(tmp_path):
    """A step stopped by SIGTERM: its run is in the step's work directory, not committed."""
    from keel.records.record import new_record
    from keel.records.report import write_report
    from keel.records.runs import finish_invocation, start_invocation
    from keel.steps import RunReport, Step, StepStore

    record = new_record(tmp_path / "experiments", "stop", "Stopped runs are kept")
    step = Step("train", print, {"lr": 1})
    work = Path(StepStore(str(tmp_path / "out")).control(step.dir_name), "work")
    work.mkdir(parents=True)
    lines = [{"step": s, "loss": 5.0 - s} for s in (1, 2, 3)]
    (work / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = start_invocation(record, "exp.py", str(tmp_path / "out"), ["keel", "run"], None)
    stopped = RunReport(failed=["train"], errors={step.dir_name: "Stopped: stopped by SIGTERM"})
    assert finish_invocation(record, run, [step], stopped) == "stopped"
    markdown = write_report(record).markdown.read_text()
    row = next(line for line in markdown.splitlines() if line.startswith(f"| {step.dir_name}"))
    assert "| STOPPED | 3 | 2.0000 |" in row
    assert "![training loss against step](loss.png)" in markdown


def test_step_jobs_on_a_cluster_carry_the_experiment_id(tmp_path):
    """`keel run --cluster local --experiment ID`: the job row's environment and the step's
    record name the experiment (the embedded controller exits once idle)."""
    record = _new_record(tmp_path, "jobs", "Jobs carry the id")
    (tmp_path / "one.py").write_text(
        "from pathlib import Path\nfrom keel.steps import Step\n\n\n"
        "def write(config, output):\n    Path(output, 'n.txt').write_text(str(config['n']))\n\n\n"
        "STEPS = [Step('one', write, {'n': 1})]\n"
    )
    keel(tmp_path, "run", "one.py", "--cluster", "local", "--experiment", record["id"])
    database = sqlite3.connect(tmp_path / "keel-out/cluster/state.db")
    ((spec,),) = database.execute("SELECT spec FROM jobs").fetchall()
    assert json.loads(spec)["env"]["KEEL_EXPERIMENT"] == record["id"]
    step = json.loads(next(tmp_path.glob("keel-out/one-*/.keel/step.json")).read_text())
    assert step["experiment"] == record["id"]
