"""`keel logs ...`: the telemetry store from the command line, on disk (--root) or via a server
(--url): serve it over HTTP, write rows, query with SQL, tail, compact."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import typer
from rich.markup import escape
from rich.table import Table

from keel.cli.output import stdout, user_errors
from keel.core.errors import UsageError
from keel.telemetry import wire
from keel.telemetry.client import HttpTelemetry, Telemetry, poll_rows
from keel.telemetry.schema import TelemetryInputError
from keel.telemetry.server import TelemetryServer
from keel.telemetry.store import StoreOptions, TelemetryStore
from keel.telemetry.times import check_time_unit

logger = logging.getLogger(__name__)

DEFAULT_ROOT = "keel-out/telemetry"
DEFAULT_PORT = 8470
SERVER_COMPACT_SECONDS = 300.0
"""A served store compacts itself this often (seconds)."""

app = typer.Typer(
    name="logs",
    help="Telemetry: namespaced tables of rows (metrics, task logs) in indexed Parquet segments, "
    "queried with SQL. Use a store directory (--root) or a server (--url, see `keel logs serve`).",
    no_args_is_help=True,
)

ROOT = typer.Option(
    None, "--root", help=f"The store's directory (default: {DEFAULT_ROOT}); not with --url."
)
URL = typer.Option(None, "--url", help="A telemetry server, e.g. http://host:8470.")
TOKEN = typer.Option(
    None,
    "--token",
    envvar="KEEL_TELEMETRY_TOKEN",
    help="The server's bearer token (or set KEEL_TELEMETRY_TOKEN).",
)
JSON = typer.Option(False, "--json", help="Print JSON on stdout instead of a table.")


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="logs")


class _Terminated(Exception):
    """SIGTERM arrived: stop serving as on Ctrl-C."""


@app.command("serve")
@user_errors
def serve_command(
    root: str = typer.Option(DEFAULT_ROOT, "--root", help="The store's directory."),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Address to listen on (not loopback: needs --token)."
    ),
    port: int = typer.Option(DEFAULT_PORT, "--port", help="TCP port (0: any free port)."),
    token: str | None = TOKEN,
) -> None:
    """Serve a store over HTTP until Ctrl-C or SIGTERM; then close it cleanly.

    Examples:
      keel logs serve --root runs/telemetry
      KEEL_TELEMETRY_TOKEN=s3cret keel logs serve --host 0.0.0.0 --port 8470
    """
    with TelemetryStore(root, StoreOptions(auto_compact_seconds=SERVER_COMPACT_SECONDS)) as store:
        store.flush()  # takes the writer lock now: a second server on this root fails here
        server = TelemetryServer(store, host=host, port=port, token=token)
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        logger.info("telemetry server at %s for store %s; Ctrl-C to stop", server.url, root)
        try:
            server.serve_forever()
        except (KeyboardInterrupt, _Terminated):
            logger.info("stopping the telemetry server")
        finally:
            signal.signal(signal.SIGTERM, previous)
    logger.info("telemetry store %s closed", root)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough; let the close finish
    raise _Terminated()


@app.command("write")
@user_errors
def write_command(
    file: Path = typer.Argument(
        ..., help="Rows to write: a .parquet, .jsonl or .json file (JSON plain, .gz or .zst)."
    ),
    namespace: str = typer.Option(..., "--namespace", "-n", help="e.g. train.metrics."),
    root: str | None = ROOT,
    url: str | None = URL,
    token: str | None = TOKEN,
    as_json: bool = typer.Option(False, "--json", help="Print {namespace, rows} as JSON."),
    time_unit: str | None = typer.Option(
        None,
        "--time-unit",
        help="Read epoch numbers in time columns as s, ms, us or ns since 1970 (without it they "
        "are refused: send ISO-8601 text); a namespace this write creates keeps the unit.",
    ),
) -> None:
    """Write a file's rows into a namespace, all or nothing (a new namespace takes their schema).

    Examples:
      keel logs write --namespace train.metrics metrics.jsonl
      keel logs write --namespace train.metrics metrics.jsonl --time-unit ms
      keel logs write --namespace cluster.task_log tasks.parquet --url http://head:8470
    """
    check_time_unit(time_unit)
    data = read_rows(file)
    with _open(root, url, token, create=True) as telemetry:
        rows = telemetry.write(namespace, data, time_unit=time_unit)
    if as_json:
        typer.echo(orjson.dumps({"namespace": namespace, "rows": rows}).decode())
        return
    stdout.print(f"wrote {rows} rows to {namespace}")


@app.command("query")
@user_errors
def query_command(
    sql: str = typer.Argument(..., help='DuckDB SQL; each namespace is a table ("a.b" quoted).'),
    root: str | None = ROOT,
    url: str | None = URL,
    token: str | None = TOKEN,
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON list of row objects (keys in SELECT order)."
    ),
) -> None:
    """Run a SQL query over the namespaces.

    Examples:
      keel logs query 'SELECT step, loss FROM "train.metrics" ORDER BY step DESC LIMIT 5'
      keel logs query 'SELECT level, count(*) AS n FROM "app.log" GROUP BY level' --json
    """
    with _open(root, url, token) as telemetry:
        table = telemetry.query(sql)
    _show(table.to_pylist() if as_json else table, as_json)


@app.command("tail")
@user_errors
def tail_command(
    namespace: str = typer.Argument(..., help="The namespace, e.g. train.metrics."),
    lines: int = typer.Option(20, "-n", "--lines", min=0, help="How many of the latest rows."),
    follow: bool = typer.Option(
        False, "--follow", "-f", help="Then print new rows as they arrive, until Ctrl-C."
    ),
    root: str | None = ROOT,
    url: str | None = URL,
    token: str | None = TOKEN,
    as_json: bool = typer.Option(
        False, "--json", help="Print JSON (with --follow: one object per line)."
    ),
) -> None:
    """Print a namespace's latest rows, oldest first.

    Examples:
      keel logs tail train.metrics -n 5
      keel logs tail cluster.task_log --follow --url http://head:8470
    """
    with _open(root, url, token) as telemetry:
        if not follow:
            table = telemetry.tail(namespace, lines)
            _show(table.to_pylist() if as_json else table, as_json)
            return
        try:
            for row in _follow(telemetry, namespace, lines):
                if as_json:
                    typer.echo(orjson.dumps(row, default=wire.json_default).decode())
                else:
                    stdout.print(escape(_row_line(row)), highlight=False)
        except KeyboardInterrupt:
            return


@app.command("compact")
@user_errors
def compact_command(
    namespace: str | None = typer.Option(
        None, "--namespace", "-n", help="Only this namespace (default: all)."
    ),
    root: str | None = ROOT,
    url: str | None = URL,
    token: str | None = TOKEN,
    as_json: bool = JSON,
) -> None:
    """Merge small segments into large ones and drop segments past their retention.

    Examples:
      keel logs compact
      keel logs compact --namespace train.metrics --url http://head:8470
    """
    with _open(root, url, token, create=True) as telemetry:
        report = telemetry.compact(namespace)
    if as_json:
        typer.echo(orjson.dumps(report.to_dict()).decode())
        return
    names = sorted(set(report.merged) | set(report.dropped))
    if not names:
        stdout.print("nothing to compact")
    for name in names:
        merged, written = report.merged.get(name, []), report.written.get(name, [])
        dropped = report.dropped.get(name, [])
        stdout.print(
            f"{name}: merged {len(merged)} segments into {len(written)}, "
            f"dropped {len(dropped)} expired segments"
        )
    if report.rows_dropped:
        stdout.print(f"{report.rows_dropped} expired rows dropped")


class _Opened:
    """A Telemetry for a command, closed on exit."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry

    def __enter__(self) -> Telemetry:
        return self.telemetry

    def __exit__(self, *exc_info: object) -> None:
        self.telemetry.close()


def _open(root: str | None, url: str | None, token: str | None, create: bool = False) -> _Opened:
    if root is not None and url is not None:
        raise UsageError("give --root or --url, not both")
    if url is not None:
        return _Opened(HttpTelemetry(url, token=token))
    root = root or DEFAULT_ROOT
    if not create and not Path(root).is_dir():
        raise UsageError(
            f"no telemetry store at {root}: write to it first, or pass --root DIR or --url URL"
        )
    return _Opened(TelemetryStore(root))


def read_rows(file: Path) -> pa.Table | list[dict[str, Any]]:
    """A .parquet file as a table; a .jsonl or .json file (plain, .gz, .zst) as a list of row
    objects."""
    from keel.flow.readers import read_decompressed  # only `write` reads files: keel.flow, ~80 ms
    from keel.flow.sources import uncompressed_name

    if not file.is_file():
        raise UsageError(f"no such file: {file}")
    name = uncompressed_name(file.name)
    if file.name.lower().endswith(".parquet"):
        try:
            return pq.read_table(file)
        except (pa.ArrowInvalid, OSError) as error:
            raise TelemetryInputError(f"{file}: not a readable Parquet file: {error}") from None
    if name.endswith((".jsonl", ".json")):
        try:
            kind = wire.NDJSON if name.endswith(".jsonl") else wire.JSON
            return wire.decode_rows(kind, read_decompressed(str(file)))
        except TelemetryInputError as error:
            raise TelemetryInputError(f"{file}: {error}") from None
    raise UsageError(
        f"{file}: expected a .parquet, .jsonl or .json file (.jsonl and .json plain, .gz or .zst)"
    )


def _follow(telemetry: Telemetry, namespace: str, lines: int) -> Iterator[dict[str, Any]]:
    if isinstance(telemetry, HttpTelemetry):
        yield from telemetry.follow(namespace, lines)
        return
    if namespace not in telemetry.namespaces():
        raise UsageError(f"no namespace {namespace!r} in the store: see `keel logs query`")
    for table in poll_rows(telemetry, namespace, lines):  # type: ignore[arg-type]
        yield from table.to_pylist()


def _show(result: pa.Table | list[dict[str, Any]], as_json: bool) -> None:
    """Rows as one JSON list of objects (keys in column order) or as a table."""
    if as_json:
        typer.echo(orjson.dumps(result, default=wire.json_default).decode())
        return
    assert isinstance(result, pa.Table)
    table = Table(*result.column_names, show_lines=False)
    for row in zip(*(column.to_pylist() for column in result.columns), strict=True):
        table.add_row(*(escape(_cell(value)) for value in row))
    stdout.print(table)
    rows = "1 row" if result.num_rows == 1 else f"{result.num_rows} rows"
    stdout.print(f"({rows})", style="dim", highlight=False)


def _cell(value: Any) -> str:
    if value is None:
        return "null"
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def _row_line(row: dict[str, Any]) -> str:
    return "  ".join(f"{key}={_cell(value)}" for key, value in row.items())
