"""The dashboard's HTTP server: the page, its assets and the JSON endpoints it polls.

Served by keel.core.http_server under keel.core.http's policy like every keel server (loopback
unless a token is set, Host and Origin checked, JSON-only writes): see docs/http.md. Everything is
a GET except the SQL box, a JSON POST; the telemetry store only runs SELECT.

    GET  /                              the single-page app (static/index.html)
    GET  /static/NAME                   its script, styles and the vendored uPlot
    GET  /api/overview                  {"label", "has_root", "namespaces"}
    GET  /api/runs                      the runs table (keel.dashboard.runs.list_runs)
    GET  /api/metric-names?run=R        names R reported
    GET  /api/metrics?run=R&name=N...   {"run", "series": {N: [steps, values]}}
    GET  /api/config-diff?a=R1&b=R2     {"a", "b", "rows": [{"key", "a", "b"}]}
    GET  /api/stages                    DataKit stage funnels
    GET  /api/steps, /api/jobs          steps with state; the controller's jobs
    GET  /api/jobs/ID/logs              a job's output
    GET  /api/search?q=TEXT             task log lines containing TEXT
    GET  /api/experiments               experiment records (keel.dashboard.experiments_view)
    GET  /experiments/ID/report         its report.html as `keel experiment report` wrote it
    POST /api/sql {"sql": "SELECT ..."} {"columns", "rows", "total"}
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from keel.cluster.state import UnknownJobError
from keel.core.http import HttpError, HttpPolicy
from keel.core.http_server import (
    HttpServer,
    ServedApi,
    endpoints,
    json_response,
    read_json,
)
from keel.core.http_server import run_in_threadpool as in_pool
from keel.dashboard import data_view, experiments_view, jobs, runs
from keel.dashboard.sources import Sources
from keel.telemetry.schema import QueryLimitError, TelemetryQueryError
from keel.telemetry.wire import json_default

STATIC_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
ERRORS = (
    (UnknownJobError, 404, "usage"),
    (QueryLimitError, 400, "limit"),
    (TelemetryQueryError, 400, "query"),
)
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}

REPORT_HEADERS = {
    **SECURITY_HEADERS,
    # a report is one self-contained page: its own <style>, figures as data: URIs, no script
    "Content-Security-Policy": "default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
    "frame-ancestors 'none'",
}


class DashboardServer(ServedApi):
    """Serves the dashboard over `sources` on host:port (port 0: any free port; see `url`).
    `token`: required as `Authorization: Bearer TOKEN` when set (needed beyond loopback)."""

    def __init__(
        self, sources: Sources, host: str = "127.0.0.1", port: int = 0, token: str | None = None
    ) -> None:
        self.sources = sources
        app = endpoints(
            {
                "/": {"GET": self._page},
                "/static/{name}": {"GET": self._static},
                "/api/overview": {"GET": self._overview},
                "/api/runs": {"GET": self._runs},
                "/api/metric-names": {"GET": self._metric_names},
                "/api/metrics": {"GET": self._metrics},
                "/api/config-diff": {"GET": self._config_diff},
                "/api/stages": {"GET": self._stages},
                "/api/steps": {"GET": self._steps},
                "/api/jobs": {"GET": self._jobs},
                "/api/jobs/{job_id}/logs": {"GET": self._job_logs},
                "/api/search": {"GET": self._search},
                "/api/sql": {"POST": self._sql},
                "/api/experiments": {"GET": self._experiments},
                "/experiments/{record}/report": {"GET": self._report},
            }
        )
        policy = HttpPolicy(token=token or None)
        self._http = HttpServer(app, policy, host, port, ERRORS, name="dashboard")

    # -- endpoints ------------------------------------------------------------------------------

    async def _page(self, request: Request) -> Response:
        return _asset("index.html")

    async def _static(self, request: Request) -> Response:
        return _asset(request.path_params["name"])

    async def _overview(self, request: Request) -> Response:
        names = await in_pool(jobs.namespaces, self.sources)
        return _json(
            {
                "label": self.sources.label,
                "has_root": self.sources.root is not None,
                "namespaces": names,
            }
        )

    async def _runs(self, request: Request) -> Response:
        return _json({"runs": await in_pool(runs.list_runs, self.sources)})

    async def _metric_names(self, request: Request) -> Response:
        run = _param(request, "run")
        return _json({"run": run, "names": await in_pool(runs.metric_names, self.sources, run)})

    async def _metrics(self, request: Request) -> Response:
        run = _param(request, "run")
        names = request.query_params.getlist("name")
        series = await in_pool(runs.metric_series, self.sources, run, names)
        return _json({"run": run, "series": series})

    async def _config_diff(self, request: Request) -> Response:
        a, b = _param(request, "a"), _param(request, "b")
        rows = await in_pool(runs.config_diff, self.sources, a, b)
        return _json({"a": a, "b": b, "rows": rows})

    async def _stages(self, request: Request) -> Response:
        return _json({"stages": await in_pool(data_view.stage_funnels, self.sources)})

    async def _steps(self, request: Request) -> Response:
        return _json({"steps": await in_pool(jobs.list_steps, self.sources)})

    async def _jobs(self, request: Request) -> Response:
        return _json({"jobs": await in_pool(jobs.jobs, self.sources)})

    async def _job_logs(self, request: Request) -> Response:
        return _json(await in_pool(jobs.job_logs, self.sources, request.path_params["job_id"]))

    async def _search(self, request: Request) -> Response:
        return _json(await in_pool(jobs.search_logs, self.sources, _param(request, "q")))

    async def _experiments(self, request: Request) -> Response:
        rows = await in_pool(experiments_view.list_experiments, self.sources.records)
        return _json({"experiments": rows})

    async def _report(self, request: Request) -> Response:
        key = request.path_params["record"]
        page = await in_pool(experiments_view.report_page, self.sources.records, key)
        return Response(page.read_bytes(), media_type=STATIC_TYPES[".html"], headers=REPORT_HEADERS)

    async def _sql(self, request: Request) -> Response:
        payload = await read_json(request)
        sql = payload.get("sql")
        if not isinstance(sql, str):
            raise HttpError(400, 'send {"sql": "SELECT ..."}')
        return _json(await in_pool(jobs.run_sql, self.sources, sql))


def _json(payload: Any) -> Response:
    response = json_response(payload, default=json_default)
    response.headers.update(SECURITY_HEADERS)
    return response


def _param(request: Request, name: str) -> str:
    value = request.query_params.get(name)
    if not value:
        raise HttpError(400, f"give ?{name}=...")
    return value


def _asset(name: str) -> Response:
    """A file of keel/dashboard/static (no subdirectories; 404 for anything else)."""
    suffix = name[name.rfind(".") :] if "." in name else ""
    asset = resources.files("keel.dashboard") / "static" / name
    if "/" in name or suffix not in STATIC_TYPES or not asset.is_file():
        raise HttpError(404, f"no asset {name!r}")
    return Response(asset.read_bytes(), media_type=STATIC_TYPES[suffix], headers=SECURITY_HEADERS)
