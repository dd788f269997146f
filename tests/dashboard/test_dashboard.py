"""`keel dashboard` in real headless Chromium over a prefix with two training runs, the
quickstart's data stages and a finished job: what the page shows equals what the stores hold."""

import json
import socket
import subprocess

import pyarrow as pa
import pytest
from browser import wait_for
from dashboard_support import JOB_OUTPUT, KEEL, RECORDS, keel, store_loss
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from keel.data.stats import data_stats
from keel.telemetry import TelemetryStore
from keel.telemetry.sink import METRICS_NAMESPACE, METRICS_SCHEMA, now

LIVE_SECONDS = 5.0


def chart_series(browser):
    """{run: [steps, values]} of the runs chart, read from the page's uPlot object."""
    runs, data = browser.execute_script(
        "const c = window.keelCharts.runs; return c ? [c.keelRuns, c.data] : [[], [[]]];"
    )
    series = {}
    for run, values in zip(runs, data[1:], strict=True):
        points = [(x, y) for x, y in zip(data[0], values, strict=True) if y is not None]
        series[run] = [[x for x, _ in points], [y for _, y in points]]
    return series


def open_view(browser, dashboard, view):
    # A hash change alone does not reload a page already open, and a refresh right after a load
    # can be aborted by the page's own navigation on a loaded machine: load from a blank page.
    browser.get("about:blank")
    browser.get(f"{dashboard}/#{view}")


def test_runs_table_and_loss_chart_show_the_store(browser, dashboard, prefix, tmp_path):
    open_view(browser, dashboard, "runs")
    rows = wait_for(
        browser,
        lambda b: (
            (r := b.find_elements(By.CSS_SELECTOR, "#runs-table tbody tr")) and len(r) == 2 and r
        ),
    )
    shown = {row.get_attribute("data-run").split("/")[-1]: row.text for row in rows}
    assert set(shown) == {"train-a", "train-b"}
    assert all("finished" in text for text in shown.values())
    runs = {str(prefix / name) for name in shown}
    wait_for(browser, lambda b: set(chart_series(b)) == runs)
    for run, series in chart_series(browser).items():
        assert series == store_loss(prefix, run)
        assert len(series[0]) == 3
    browser.save_screenshot(str(tmp_path / "dashboard-runs.png"))


def test_chart_updates_while_the_page_is_open(browser, dashboard, prefix):
    open_view(browser, dashboard, "runs")
    run = str(prefix / "train-a")
    wait_for(browser, lambda b: run in chart_series(b))
    step, loss = 4, 7.25
    with TelemetryStore(prefix / "telemetry") as store:
        store.write(METRICS_NAMESPACE, pa.Table.from_pylist(
            [{"ts": now(), "run": run, "step": step, "name": "loss", "value": loss}],
            schema=METRICS_SCHEMA,
        ))  # fmt: skip
    series = wait_for(
        browser, lambda b: step in chart_series(b)[run][0] and chart_series(b), LIVE_SECONDS
    )
    assert series[run] == store_loss(prefix, run)
    assert series[run][1][-1] == loss


def test_smoothing_draws_the_moving_average_of_the_stored_values(browser, dashboard, prefix):
    open_view(browser, dashboard, "runs")
    run = str(prefix / "train-b")
    wait_for(browser, lambda b: run in chart_series(b))
    browser.execute_script(
        "const s = document.getElementById('smoothing'); s.value = '0.5';"
        "s.dispatchEvent(new Event('input'));"
    )
    steps, stored = store_loss(prefix, run)
    average, expected = 0.0, []
    for i, value in enumerate(stored):  # as W&B smooths: an EMA with bias correction
        average = 0.5 * average + 0.5 * value
        expected.append(average / (1 - 0.5 ** (i + 1)))
    series = wait_for(browser, lambda b: chart_series(b)[run][1] != stored and chart_series(b))
    assert series[run][0] == steps
    assert series[run][1] == pytest.approx(expected, rel=1e-12)
    browser.execute_script(
        "const s = document.getElementById('smoothing'); s.value = '0';"
        "s.dispatchEvent(new Event('input'));"
    )
    wait_for(browser, lambda b: chart_series(b)[run] == [steps, stored])


def test_config_diff_of_the_two_runs(browser, dashboard, prefix):
    open_view(browser, dashboard, "runs")
    a = str(prefix / "train-a")
    b = str(prefix / "train-b")
    wait_for(browser, lambda b_: len(b_.find_elements(By.CSS_SELECTOR, "#diff-a option")) == 2)
    Select(browser.find_element(By.ID, "diff-a")).select_by_value(a)
    Select(browser.find_element(By.ID, "diff-b")).select_by_value(b)
    changed = '#diff-table tr[data-key="optimizer.clip_norm"]'
    row = wait_for(browser, lambda b_: b_.find_elements(By.CSS_SELECTOR, changed))[0]
    cells = [cell.text for cell in row.find_elements(By.TAG_NAME, "td")]
    assert cells[0] == "optimizer.clip_norm" and cells[2] == "0.5" and cells[1] != cells[2]


def test_stage_funnels_equal_keel_data_stats(browser, dashboard, prefix, tmp_path):
    open_view(browser, dashboard, "data")
    rows = wait_for(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "#stages-table tbody tr"))
    stages = {row.get_attribute("data-step"): row for row in rows}
    on_disk = {path.name for path in prefix.iterdir() if (path / "stage.json").is_file()}
    assert set(stages) == on_disk and any(name.startswith("filter-") for name in on_disk)
    for name, row in stages.items():
        report = data_stats(str(prefix / name)).stage
        shown = [
            row.find_element(By.CLASS_NAME, c).text for c in ("docs-in", "docs-out", "docs-dropped")
        ]
        assert shown == [f"{n:,}" for n in (report.documents_in, report.documents_out,
                         report.documents_in - report.documents_out)]  # fmt: skip
        reasons = row.find_element(By.CLASS_NAME, "reasons").text
        assert reasons == ", ".join(f"{r}: {n}" for r, n in report.dropped.items())
    dedup = next(name for name in stages if name.startswith("filter-"))
    cli = json.loads(keel("data", "stats", str(prefix / dedup), "--json", cwd=prefix).stdout)
    assert (
        cli["stage"]["dropped"]
        and cli["stage"]["dropped"] == data_stats(str(prefix / dedup)).stage.dropped
    )
    browser.save_screenshot(str(tmp_path / "dashboard-data.png"))


def test_jobs_show_their_log_lines_and_steps_their_state(browser, dashboard, tmp_path):
    open_view(browser, dashboard, "jobs")
    button = wait_for(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "#jobs-table .show-log"))
    button[0].click()
    log = wait_for(browser, lambda b: JOB_OUTPUT in b.find_element(By.ID, "job-log").text
                   and b.find_element(By.ID, "job-log"))  # fmt: skip
    assert log.get_attribute("data-job") == "j-000001"
    steps = browser.find_elements(By.CSS_SELECTOR, "#steps-table tbody tr")
    assert steps and all("SUCCESS" in row.text for row in steps)
    browser.save_screenshot(str(tmp_path / "dashboard-jobs.png"))


def test_experiments_list_the_records_and_open_their_reports(browser, dashboard, tmp_path):
    open_view(browser, dashboard, "experiments")
    rows = wait_for(
        browser,
        lambda b: (
            (r := b.find_elements(By.CSS_SELECTOR, "#experiments-table tbody tr"))
            and len(r) == len(RECORDS)
            and r
        ),
    )
    shown = {row.find_elements(By.TAG_NAME, "td")[1].text: row for row in rows}
    assert set(shown) == set(RECORDS)
    for name, hypothesis in RECORDS.items():
        assert hypothesis in shown[name].text
    first = shown["clip-norm"]
    record_id = first.get_attribute("data-experiment")
    link = first.find_element(By.CSS_SELECTOR, "a.report")
    assert not shown["longer-warmup"].find_elements(By.CSS_SELECTOR, "a.report")
    browser.save_screenshot(str(tmp_path / "dashboard-experiments.png"))
    browser.get(link.get_attribute("href"))
    assert browser.title == f"experiment {record_id}: clip-norm"
    assert RECORDS["clip-norm"] in browser.find_element(By.TAG_NAME, "body").text
    browser.get(f"{dashboard}/experiments/19990101-01/report")
    assert "no experiment '19990101-01'" in browser.page_source


def test_sql_box_runs_a_select_and_refuses_writes(browser, dashboard):
    open_view(browser, dashboard, "sql")
    box = wait_for(browser, lambda b: b.find_element(By.ID, "sql"))
    box.clear()
    box.send_keys(f'SELECT count(DISTINCT run) AS runs FROM "{METRICS_NAMESPACE}"')
    browser.find_element(By.ID, "sql-run").click()
    cell = wait_for(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "#sql-result tbody td"))
    assert cell[0].text == "2"
    box.clear()
    box.send_keys(f'DELETE FROM "{METRICS_NAMESPACE}"')
    browser.find_element(By.ID, "sql-run").click()
    error = wait_for(browser, lambda b: b.find_element(By.ID, "error").text)
    assert "only SELECT" in error


def test_bad_root_and_port_in_use_are_one_error_line(prefix, tmp_path):
    missing = subprocess.run(
        [*KEEL, "dashboard", "--root", str(tmp_path / "nowhere")], capture_output=True, text=True
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = subprocess.run(
            [*KEEL, "dashboard", "--root", str(prefix), "--port", str(port)],
            capture_output=True,
            text=True,
        )
    for result, words in ((missing, "no such directory"), (busy, "cannot listen")):
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], lines
