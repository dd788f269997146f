"""`keel dashboard`: a local web UI over the telemetry store, the step store and the job controller.

sources.py   what the dashboard reads: a prefix (--root) or a telemetry server (--url)
runs.py      training runs: the runs table, metric series, config diffs
data_view.py DataKit stage funnels (the numbers of stage.json and `keel data stats`)
jobs.py      steps with their state, controller jobs and their logs, log search, SQL
server.py    the JSON endpoints and the page, served through keel.core.http_server
static/      the single-page app and the vendored uPlot (see NOTICE); nothing from a CDN
"""
