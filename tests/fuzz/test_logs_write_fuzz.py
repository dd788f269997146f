"""Fuzzing `keel logs write` (in-process, typer's CliRunner) with random JSON and NDJSON files,
into a store directory (--root) and through the fuzz suite's server (--url): it writes every row
(exit 0) or none (exit 2 with one `error:` line), never a traceback."""

import json

from fuzz_support import FUZZ, stored_rows
from hypothesis import given
from hypothesis import strategies as st
from test_http_fuzz import NAMESPACES, rows, values
from typer.testing import CliRunner

from keel.cli.logs_commands import app
from keel.telemetry import TelemetryStore

files = st.one_of(
    rows.map(lambda r: (".json", json.dumps(r).encode(), len(r))),
    rows.map(lambda r: (".json", json.dumps({"rows": r}).encode(), len(r))),
    rows.map(lambda r: (".jsonl", b"\n".join(json.dumps(row).encode() for row in r), len(r))),
    values.map(lambda v: (".json", json.dumps(v).encode(), None)),
    st.tuples(st.sampled_from([".json", ".jsonl"]), st.binary(max_size=100), st.none()),
)


@FUZZ
@given(file=files, namespace=st.sampled_from(NAMESPACES), remote=st.booleans())
def test_random_files_are_written_whole_or_refused_in_one_line(
    telemetry, tmp_path_factory, file, namespace, remote
):
    suffix, content, sent = file
    directory = tmp_path_factory.mktemp("cli-write")
    path = directory / f"rows{suffix}"
    path.write_bytes(content)
    root = tmp_path_factory.getbasetemp() / "cli-store"
    where = ["--url", telemetry.url] if remote else ["--root", str(root)]

    def count() -> dict[str, int]:
        if remote:
            telemetry.store.flush()  # acknowledged rows must become a segment
            return stored_rows(telemetry.store)
        with TelemetryStore(root) as store:
            return stored_rows(store)

    before = count()
    result = CliRunner().invoke(app, ["write", str(path), "--namespace", namespace, *where])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    after = count()
    if result.exit_code == 0:
        written = after.get(namespace, 0) - before.get(namespace, 0)
        assert result.output.strip() == f"wrote {written} rows to {namespace}"
        assert sent is None or written == sent, (content, result.output)
    else:
        assert result.exit_code == 2, result.output
        assert result.output.count("error:") == 1, result.output
        assert after == before, (content, result.output)
