"""`keel logs ...` through the real command: write files, query as JSON, tail, compact, serve, and
one-line errors for the usual mistakes."""

import gzip
import json
import re
import select
import signal
import time
from datetime import datetime, timedelta

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from cli_support import error_lines

from keel.telemetry import StoreOptions, TelemetryStore
from keel.telemetry.client import HttpTelemetry
from keel.telemetry.manifest import load_manifest

NS = "app.log"
START = datetime(2026, 11, 1)


def log_table(first: int, rows: int) -> pa.Table:
    return pa.table(
        {
            "ts": pa.array(
                [START + timedelta(seconds=i) for i in range(first, first + rows)],
                pa.timestamp("us"),
            ),
            "level": ["INFO", "WARN"] * (rows // 2) + ["INFO"] * (rows % 2),
            "msg": [f"event {i}" for i in range(first, first + rows)],
        }
    )


def seeded_store(root, batches: int = 1) -> None:
    """A store with `batches` segments of 10 rows each, written in this process."""
    with TelemetryStore(root, StoreOptions(background=False)) as store:
        for batch in range(batches):
            store.write(NS, log_table(batch * 10, 10))
            store.flush()


def test_write_jsonl_then_query_as_json_in_select_order(cli):
    lines = [
        {"ts": "2026-11-01T00:00:02", "level": "INFO", "msg": "started"},
        {"ts": "2026-11-01T00:00:01", "level": "WARN", "msg": "slow disk"},
        {"ts": "2026-11-01T00:00:03", "level": "INFO", "msg": "done"},
    ]
    jsonl = cli.write("events.jsonl", "\n".join(json.dumps(line) for line in lines) + "\n")
    root = str(cli.root / "telemetry")
    written = cli.run("logs", "write", "--namespace", NS, str(jsonl), "--root", root)
    assert written.returncode == 0, written.stderr
    assert written.stdout.strip() == f"wrote 3 rows to {NS}"
    sql = f'SELECT msg, ts, level FROM "{NS}" ORDER BY ts'
    queried = cli.run("logs", "query", sql, "--json", "--root", root)
    assert queried.returncode == 0, queried.stderr
    rows = json.loads(queried.stdout)  # exactly one JSON document
    assert [list(row) for row in rows] == [["msg", "ts", "level"]] * 3
    assert rows == [
        {"msg": "slow disk", "ts": "2026-11-01T00:00:01", "level": "WARN"},
        {"msg": "started", "ts": "2026-11-01T00:00:02", "level": "INFO"},
        {"msg": "done", "ts": "2026-11-01T00:00:03", "level": "INFO"},
    ]


def test_epoch_numbers_need_time_unit_and_are_then_read_in_it(cli):
    root = str(cli.root / "telemetry")
    jsonl = cli.write("epochs.jsonl", '{"ts": 1793491201000, "msg": "a"}\n')  # ms
    refused = cli.run("logs", "write", "-n", NS, str(jsonl), "--root", root)
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "'ts'" in lines[0] and "--time-unit" in lines[0], lines
    assert not (cli.root / "telemetry" / NS).exists()
    written = cli.run("logs", "write", "-n", NS, str(jsonl), "--root", root, "--time-unit", "ms")
    assert written.returncode == 0, written.stderr
    with TelemetryStore(root) as store:
        assert store.query(f'SELECT ts FROM "{NS}"').to_pylist() == [
            {"ts": START + timedelta(seconds=1)}
        ]


def test_write_reads_gzip_and_zstd_json_lines_and_a_truncated_file_is_one_line(cli):
    lines = "".join(json.dumps({"step": step, "loss": 3.0 - step}) + "\n" for step in range(4))
    (cli.root / "metrics.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (cli.root / "metrics.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(lines.encode())
    )
    root = str(cli.root / "telemetry")
    for name in ("metrics.jsonl.gz", "metrics.jsonl.zst"):
        written = cli.run("logs", "write", "-n", "train.metrics", name, "--root", root)
        assert written.returncode == 0, written.stderr
        assert written.stdout.strip() == "wrote 4 rows to train.metrics"
    counted = cli.run("logs", "query", 'SELECT count(*) AS n FROM "train.metrics"', "--json",
                      "--root", root)  # fmt: skip
    assert json.loads(counted.stdout) == [{"n": 8}]
    (cli.root / "cut.jsonl.gz").write_bytes(gzip.compress(lines.encode())[:-12])
    cut = cli.run("logs", "write", "-n", "train.metrics", "cut.jsonl.gz", "--root", root)
    errors = error_lines(cut.stderr)
    assert cut.returncode == 1 and len(errors) == 1 and "cut.jsonl.gz" in errors[0], cut.stderr


def test_write_parquet_then_compact_merges_the_segments(cli):
    root = cli.root / "telemetry"
    seeded_store(root, batches=2)
    parquet = cli.root / "more.parquet"
    pq.write_table(log_table(20, 10), parquet)
    written = cli.run("logs", "write", "-n", NS, str(parquet), "--root", str(root))
    assert written.returncode == 0, written.stderr
    assert written.stdout.strip() == f"wrote 10 rows to {NS}"
    compacted = cli.run("logs", "compact", "--root", str(root))
    assert compacted.returncode == 0, compacted.stderr
    assert compacted.stdout.strip() == f"{NS}: merged 3 segments into 1, dropped 0 expired segments"
    assert len(load_manifest(root / NS).segments) == 1
    with TelemetryStore(root) as store:
        assert store.query(f'SELECT * FROM "{NS}" ORDER BY ts').equals(log_table(0, 30))


def test_tail_prints_the_latest_rows_oldest_first(cli):
    root = cli.root / "telemetry"
    seeded_store(root, batches=2)
    tailed = cli.run("logs", "tail", NS, "-n", "3", "--json", "--root", str(root))
    assert tailed.returncode == 0, tailed.stderr
    assert [row["msg"] for row in json.loads(tailed.stdout)] == ["event 17", "event 18", "event 19"]


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("query", "SELEC * FROM x"), ("syntax error", "SELEC")),
        (("query", 'SELECT * FROM "no.such"'), ("no.such",)),
        (("tail", "no.such"), ("no namespace no.such",)),
        (("write", "--namespace", NS, "missing.jsonl"), ("no such file: missing.jsonl",)),
        (("query", "SELECT 1", "--url", "http://127.0.0.1:9"), ("no telemetry server at",)),
    ],
    ids=["bad-sql", "unknown-namespace", "tail-unknown-namespace", "missing-file", "no-server"],
)
def test_mistakes_are_one_error_line_and_exit_2(cli, args, fragments):
    root = cli.root / "telemetry"
    seeded_store(root)
    extra = () if "--url" in args else ("--root", str(root))
    result = cli.run("logs", *args, *extra)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines == error_lines(result.stderr), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert result.stdout == ""


def test_serve_answers_over_http_and_closes_the_store_on_sigterm(cli):
    root = cli.root / "telemetry"
    server = cli.popen("logs", "serve", "--root", str(root), "--port", "0")
    try:
        url = _served_url(server)
        with HttpTelemetry(url) as client:
            assert client.write(NS, log_table(0, 4)) == 4
            assert client.query(f'SELECT count(*) AS n FROM "{NS}"').to_pylist() == [{"n": 4}]
        server.send_signal(signal.SIGTERM)
        _, stderr = server.communicate(timeout=20)
    finally:
        server.kill()
        server.wait()
    assert server.returncode == 0, stderr
    assert "closed" in stderr and "Traceback" not in stderr
    assert list((root / NS / "segments").glob("*.parquet"))  # flushed on close
    with TelemetryStore(root) as store:  # and the writer lock was released
        assert store.write(NS, log_table(4, 2)) == 2


def _served_url(process) -> str:
    deadline = time.monotonic() + 60
    seen = ""
    while time.monotonic() < deadline and process.poll() is None:
        readable, _, _ = select.select([process.stderr], [], [], 0.5)
        if readable:
            seen += process.stderr.readline()
            found = re.search(r"http://127\.0\.0\.1:\d+", seen)
            if found:
                return found.group()
    raise AssertionError(f"the server did not log its URL: {seen}")
