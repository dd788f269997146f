"""Experiment records: the written account of one question, kept in the project.

    experiments/<id>-<name>/
        README.md         hypothesis, setup, runs, results, conclusion: written by people
        experiment.yaml   the same facts, machine-readable (id, name, hypothesis, issue, ...)
        runs.jsonl        every `keel run --experiment ID` made for it (keel.records.runs)
        report/           `keel experiment report ID` (keel.records.report)

An id is the creation date and a counter of that day, `20261202-01`: stable, sortable and short
enough to type. `experiments/` is relative to the current directory (the project).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import yaml

from keel.core.errors import UsageError

RECORDS_DIR = "experiments"
"""Where a project keeps its records, relative to the current directory."""
RECORD_FILE = "experiment.yaml"
README_FILE = "README.md"
_ID = re.compile(r"\d{8}-\d{2,}")
_MAX_PER_DAY = 999


@dataclass(frozen=True)
class ExperimentRecord:
    """One record as experiment.yaml holds it; `directory` is where it lives (not stored)."""

    id: str
    name: str
    hypothesis: str
    created: str
    """ISO 8601, UTC."""
    issue: str | None = None
    baseline: str | None = None
    """The training run the others are compared to (a step name or NAME-HASH8 output);
    None: the first training run of the experiment."""
    status: str = "open"
    """open while runs are added; a person sets concluded (and writes the conclusion)."""
    conclusion: str | None = None
    directory: Path = Path()

    def to_yaml(self) -> str:
        data = {key: value for key, value in asdict(self).items() if key != "directory"}
        return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def records_root(project: Path | None = None) -> Path:
    """`experiments/` of the project (default: the current directory)."""
    return (project or Path.cwd()) / RECORDS_DIR


def slug(name: str) -> str:
    """`name` as a directory-safe word: lower case, runs of other characters as one `-`."""
    text = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if not text:
        raise UsageError(f"experiment name {name!r}: use letters or digits, e.g. moe-vs-dense")
    return text[:60]


def new_record(
    root: Path, name: str, hypothesis: str, issue: str | None = None, now: datetime | None = None
) -> ExperimentRecord:
    """Create `root/<id>-<name>/` with README.md and experiment.yaml; the new record."""
    if not hypothesis.strip():
        raise UsageError("--hypothesis is empty: say what the runs should show, in a sentence")
    word = slug(name)
    moment = now or datetime.now(UTC)
    day = moment.strftime("%Y%m%d")
    root.mkdir(parents=True, exist_ok=True)
    taken = {record.id for record in list_records(root)}
    for counter in range(1, _MAX_PER_DAY + 1):
        record_id = f"{day}-{counter:02d}"
        if record_id in taken:
            continue
        directory = root / f"{record_id}-{word}"
        try:
            directory.mkdir()
        except FileExistsError:  # another `keel experiment new` took it just now
            continue
        record = ExperimentRecord(
            id=record_id,
            name=word,
            hypothesis=hypothesis.strip(),
            created=moment.isoformat(timespec="seconds"),
            issue=issue,
            directory=directory,
        )
        (directory / README_FILE).write_text(readme(record))
        write_record(record)
        return record
    raise UsageError(f"{root}: {_MAX_PER_DAY} records made today already; that is the limit")


def write_record(record: ExperimentRecord) -> None:
    """(Re)write the record's experiment.yaml."""
    (record.directory / RECORD_FILE).write_text(record.to_yaml())


def read_record(directory: Path) -> ExperimentRecord:
    """The record in `directory`; UsageError when its experiment.yaml cannot be read as one."""
    path = directory / RECORD_FILE
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise UsageError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, dict) or not {"id", "name", "hypothesis", "created"} <= set(data):
        raise UsageError(f"{path}: an experiment record needs id, name, hypothesis and created")
    known = set(ExperimentRecord.__dataclass_fields__) - {"directory"}
    fields = {key: value for key, value in data.items() if key in known}
    return replace(ExperimentRecord(**fields), directory=directory)


def list_records(root: Path) -> list[ExperimentRecord]:
    """Every record under `root`, oldest first (ids sort by date and counter)."""
    if not root.is_dir():
        return []
    records = [read_record(path) for path in root.iterdir() if (path / RECORD_FILE).is_file()]
    return sorted(records, key=lambda record: (record.id.split("-")[0], _counter(record.id)))


def find_record(root: Path, key: str) -> ExperimentRecord:
    """The record whose id (or directory name) is `key`; UsageError listing the known ids."""
    records = list_records(root)
    for record in records:
        if key in (record.id, record.directory.name):
            return record
    known = ", ".join(record.id for record in records[-10:]) or "none yet"
    raise UsageError(
        f"no experiment {key!r} in {root} (known: {known}); create one with "
        "`keel experiment new NAME --hypothesis TEXT`"
    )


def readme(record: ExperimentRecord) -> str:
    """The README.md a new record starts with: the hypothesis, and a heading for each part."""
    issue = f"\nIssue: {record.issue}\n" if record.issue else ""
    return f"""# {record.name} (experiment {record.id})
{issue}
Created {record.created}. Status: {record.status}.

## Hypothesis

{record.hypothesis}

## Setup

What the experiment files train and why. Run each with
`keel run FILE.py --experiment {record.id}` (or set `EXPERIMENT = "{record.id}"` in the file).

## Runs

`keel experiment show {record.id}` lists them; `keel experiment report {record.id}` writes
report/report.md and report/report.html here (failed and stopped runs included).

## Results

What the report shows, with numbers.

## Conclusion

Supported, refuted or inconclusive, and why; set `status: concluded` in experiment.yaml.
"""


def _counter(record_id: str) -> int:
    return int(record_id.split("-")[1]) if _ID.fullmatch(record_id) else 0
