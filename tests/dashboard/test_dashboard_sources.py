"""The dashboard's other sources, without a browser: a telemetry server (`--url`), a run that
never reported to telemetry (its metrics.jsonl), task logs searched through the store; a run name
it does not know is refused."""

import json
import shutil
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime

import pyarrow as pa
import pytest
from dashboard_support import store_loss

from keel.cluster.logs import NAMESPACE, SCHEMA
from keel.core.errors import UsageError
from keel.dashboard import jobs, runs
from keel.dashboard.server import DashboardServer
from keel.dashboard.sources import open_sources
from keel.telemetry import TelemetryStore
from keel.telemetry.server import TelemetryServer


def get(url):
    with urllib.request.urlopen(url, timeout=30) as answer:
        return json.loads(answer.read())


def test_a_telemetry_server_shows_its_runs_and_their_metrics(prefix):
    run = str(prefix / "train-a")
    expected = store_loss(prefix, run)
    with (
        TelemetryStore(prefix / "telemetry") as store,
        TelemetryServer(store) as telemetry,
    ):
        sources = open_sources(None, telemetry.url)
        with DashboardServer(sources) as dashboard:
            shown = {run["name"]: run for run in get(f"{dashboard.url}/api/runs")["runs"]}
            assert set(shown) == {"train-a", "train-b"}
            assert shown["train-a"]["run"] == run
            query = urllib.parse.urlencode({"run": run, "name": "loss"})
            series = get(f"{dashboard.url}/api/metrics?{query}")["series"]["loss"]
            assert series == expected
            assert get(f"{dashboard.url}/api/stages")["stages"] == []  # no prefix: no stages
            with pytest.raises(urllib.error.HTTPError) as refused:
                get(f"{dashboard.url}/api/config-diff?a=/etc&b={run}")
            assert refused.value.code == 400
        sources.close()


def test_a_run_without_telemetry_is_read_from_its_metrics_file(prefix, tmp_path):
    root = tmp_path / "keel-out"
    for name in ("metrics.jsonl", "config.yaml", "result.json"):
        (root / "solo").mkdir(parents=True, exist_ok=True)
        shutil.copy(prefix / "train-a" / name, root / "solo" / name)
    sources = open_sources(str(root), None)
    (shown,) = runs.list_runs(sources)
    lines = [json.loads(line) for line in (root / "solo/metrics.jsonl").read_text().splitlines()]
    assert shown["name"] == "solo" and shown["state"] == "finished"
    assert shown["step"] == lines[-1]["step"] and shown["loss"] == lines[-1]["loss"]
    series = runs.metric_series(sources, shown["run"], ["loss", "router.drop_rate.0"])
    assert series["loss"] == [[line["step"] for line in lines], [line["loss"] for line in lines]]
    assert series["router.drop_rate.0"] == [[], []]  # a dense run has no router
    assert runs.config_diff(sources, shown["run"], shown["run"]) == []
    with pytest.raises(UsageError, match="no run"):
        runs.run_config(sources, str(prefix / "train-a"))


def test_log_search_finds_task_log_lines_through_the_store(tmp_path):
    root = tmp_path / "keel-out"
    lines = ["loading shard 3", "step 10 loss 2.5", "ERROR: shard 3 missing", "it's done"]
    with TelemetryStore(root / "telemetry") as store:
        store.create(NAMESPACE, SCHEMA)
        rows = [
            {"ts": datetime(2026, 12, 1, 0, 0, i), "job_id": "j-000007", "replica": 0,
             "attempt": 0, "stream": "stdout", "line": line}
            for i, line in enumerate(lines)
        ]  # fmt: skip
        store.write(NAMESPACE, pa.Table.from_pylist(rows, schema=SCHEMA))
    sources = open_sources(str(root), None)
    found = jobs.search_logs(sources, "shard 3")
    line = found["columns"].index("line")
    assert [row[line] for row in found["rows"]] == ["ERROR: shard 3 missing", "loading shard 3"]
    assert [row[line] for row in jobs.search_logs(sources, "it's")["rows"]] == ["it's done"]
    assert jobs.search_logs(sources, "nowhere")["rows"] == []
    sources.close()
