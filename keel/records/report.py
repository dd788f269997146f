"""`keel experiment report ID`: the record's runs as report/report.md (figures beside it as PNG
files) and report/report.html (one self-contained page: figures embedded as base64 PNGs).

Both are rendered from one list of blocks (headings, text, tables, figures), so they say the
same thing. Sections: the record (hypothesis, status, conclusion); every training run with its
state (failed and stopped runs marked) and final metrics; loss and evaluation curves against
the baseline; router load and drop rates (MoE runs); data-stage accounting; each run's config
diff against the baseline; and what reproduces it (invocations with git commits and commands,
step hashes).
"""

from __future__ import annotations

import base64
import html
import os
from dataclasses import dataclass
from pathlib import Path

from keel.core import paths
from keel.records import plots
from keel.records.collect import ExperimentData, TrainingRun, collect, config_diff
from keel.records.record import ExperimentRecord
from keel.records.runs import RUNNING

REPORT_DIR = "report"
MARKDOWN_FILE, HTML_FILE = "report.md", "report.html"


@dataclass(frozen=True)
class Link:
    text: str
    target: str
    """Relative to the report directory (a local file), or a URL."""


@dataclass(frozen=True)
class Heading:
    text: str
    level: int = 2


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: list[tuple[object, ...]]


@dataclass(frozen=True)
class Figure:
    file: str
    png: bytes
    caption: str


Block = Heading | Text | Table | Figure


@dataclass(frozen=True)
class WrittenReport:
    markdown: Path
    html: Path
    runs: int


def write_report(record: ExperimentRecord, output: Path | None = None) -> WrittenReport:
    """Collect the record's runs and write both files into `output` (default: report/ in the
    record); returns their paths."""
    directory = output or record.directory / REPORT_DIR
    directory.mkdir(parents=True, exist_ok=True)
    data = collect(record)
    blocks = report_blocks(data, directory)
    for block in blocks:
        if isinstance(block, Figure):
            (directory / block.file).write_bytes(block.png)
    markdown, page = directory / MARKDOWN_FILE, directory / HTML_FILE
    markdown.write_text(to_markdown(blocks))
    page.write_text(to_html(blocks, f"experiment {record.id}: {record.name}"))
    return WrittenReport(markdown, page, len(data.runs))


def report_blocks(data: ExperimentData, directory: Path) -> list[Block]:
    record, runs, baseline = data.record, data.runs, data.baseline
    blocks: list[Block] = [
        Heading(f"Experiment {record.id}: {record.name}", 1),
        Text(f"**Hypothesis.** {record.hypothesis}"),
        Text(
            f"Status: {record.status}. Created {record.created}."
            + (f" Issue: {record.issue}." if record.issue else "")
            + (f" Baseline: {baseline.dir_name}." if baseline else "")
        ),
    ]
    if record.conclusion:
        blocks.append(Text(f"**Conclusion.** {record.conclusion}"))
    blocks.append(Heading("Training runs"))
    if not runs:
        blocks.append(Text("No training run yet: `keel run FILE.py --experiment ID` adds them."))
    else:
        blocks.append(_runs_table(runs, baseline, directory))
    failed = [step for step in data.steps if step["outcome"] in ("failed", "stopped", "not run")]
    if failed:
        blocks += [
            Heading("Failed and stopped steps"),
            Table(
                ("step", "outcome", "error"),
                [(s["dir_name"], s["outcome"].upper(), s.get("error") or "-") for s in failed],
            ),
        ]
    figures = [
        ("loss.png", plots.loss_plot(runs, baseline), "training loss against step"),
        ("eval.png", plots.eval_plot(runs, baseline), "held-out bits per byte against step"),
        ("router.png", plots.router_plot(runs), "router load and drop rate (MoE runs)"),
    ]
    blocks += [Figure(file, png, caption) for file, png, caption in figures if png is not None]
    if data.stages:
        blocks += [
            Heading("Data stages"),
            Table(
                ("stage", "documents in", "kept", "dropped (reason: count)"),
                [
                    (
                        stage.name,
                        f"{stage.documents_in:,}",
                        f"{stage.documents_out:,}",
                        ", ".join(f"{k}: {v:,}" for k, v in stage.dropped.items() if v) or "-",
                    )
                    for stage in data.stages
                ],
            ),
        ]
        stages_png = plots.stages_plot(data.stages)
        if stages_png is not None:
            blocks.append(Figure("stages.png", stages_png, "documents in and kept by stage"))
    if baseline is not None and len(runs) > 1:
        blocks.append(Heading(f"Config against the baseline ({baseline.dir_name})"))
        for run in runs:
            if run is baseline:
                continue
            diff = config_diff(run.config, baseline.config)
            blocks.append(Heading(run.dir_name, 3))
            if diff:
                blocks.append(Table(("key", "baseline", "this run"), diff))
            else:
                blocks.append(Text("Same config as the baseline."))
    blocks += _reproduce(data)
    return blocks


def _runs_table(runs: list[TrainingRun], baseline: TrainingRun | None, directory: Path) -> Table:
    rows = []
    for run in runs:
        final = run.final
        name = run.dir_name + (" (baseline)" if run is baseline else "")
        rows.append(
            (
                name,
                run.state if run.state == "finished" else run.state.upper(),
                final.get("step", "-"),
                _number(final.get("loss")),
                _number(final.get("eval_loss")),
                _number(final.get("eval_bpb")),
                _number(final.get("tokens_per_s"), "{:,.0f}"),
                _number(final.get("drop_rate")),
                _link("metrics.jsonl", paths.join(run.run_dir, "metrics.jsonl"), directory),
            )
        )
    header = ("run", "state", "step", "loss", "eval loss", "eval bpb", "tokens/s", "drop rate")
    return Table((*header, "metrics"), rows)


def _reproduce(data: ExperimentData) -> list[Block]:
    blocks: list[Block] = [
        Heading("Reproduce"),
        Text(
            "Each invocation: check out its git commit and run its command; steps whose hash "
            "is committed under the prefix are reused (cached), the rest run again."
        ),
        Table(
            ("invocation", "started", "outcome", "git commit", "command"),
            [
                (
                    inv.run,
                    inv.started,
                    inv.outcome.upper() if inv.outcome != "ok" else inv.outcome,
                    inv.git_commit or "-",
                    "`" + " ".join(inv.command) + "`",
                )
                for inv in data.invocations
            ],
        ),
        Table(
            ("step", "hash (identity)", "outcome", "invocation", "output"),
            [
                (
                    step["name"],
                    step["identity"],
                    step["outcome"],
                    step["run"],
                    step.get("output") or "-",
                )
                for step in data.steps
            ],
        ),
    ]
    if any(inv.outcome == RUNNING for inv in data.invocations):
        blocks.append(Text("An invocation marked running has not finished (or was killed)."))
    return blocks


def _number(value: object, form: str = "{:.4f}") -> str:
    return form.format(value) if isinstance(value, int | float) else "-"


def _link(text: str, target: str, directory: Path) -> Link:
    if paths.is_local(target):
        return Link(text, os.path.relpath(paths.local_path(target), directory))
    return Link(text, target)


def to_markdown(blocks: list[Block]) -> str:
    out = []
    for block in blocks:
        if isinstance(block, Heading):
            out.append(f"{'#' * block.level} {block.text}")
        elif isinstance(block, Text):
            out.append(block.text)
        elif isinstance(block, Figure):
            out.append(f"![{block.caption}]({block.file})")
        else:
            lines = ["| " + " | ".join(block.header) + " |", "|" + " --- |" * len(block.header)]
            lines += [
                "| " + " | ".join(_md_cell(cell) for cell in row) + " |" for row in block.rows
            ]
            out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def _md_cell(cell: object) -> str:
    if isinstance(cell, Link):
        return f"[{cell.text}]({cell.target})"
    return str(cell).replace("|", "\\|").replace("\n", " ")


STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}
table{border-collapse:collapse;margin:1em 0;font-size:14px}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}th{background:#f4f4f4}
img{max-width:100%}figcaption{color:#555;font-size:13px}code{background:#f4f4f4}"""


def to_html(blocks: list[Block], title: str) -> str:
    out = [
        "<!DOCTYPE html>",
        f'<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>',
        f"<style>{STYLE}</style></head><body>",
    ]
    for block in blocks:
        if isinstance(block, Heading):
            out.append(f"<h{block.level}>{html.escape(block.text)}</h{block.level}>")
        elif isinstance(block, Text):
            out.append(f"<p>{_inline(block.text)}</p>")
        elif isinstance(block, Figure):
            data = base64.b64encode(block.png).decode()
            caption = html.escape(block.caption)
            out.append(
                f'<figure><img alt="{caption}" src="data:image/png;base64,{data}">'
                f"<figcaption>{caption}</figcaption></figure>"
            )
        else:
            head = "".join(f"<th>{html.escape(h)}</th>" for h in block.header)
            body = "".join(
                "<tr>" + "".join(f"<td>{_html_cell(cell)}</td>" for cell in row) + "</tr>"
                for row in block.rows
            )
            out.append(f"<table><tr>{head}</tr>{body}</table>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _html_cell(cell: object) -> str:
    if isinstance(cell, Link):
        return f'<a href="{html.escape(cell.target)}">{html.escape(cell.text)}</a>'
    return _inline(str(cell))


def _inline(text: str) -> str:
    """Markdown's **bold** and `code` in HTML; everything else escaped."""
    parts = html.escape(text).split("`")
    text = "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
    parts = text.split("**")
    return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))
