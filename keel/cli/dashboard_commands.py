"""`keel dashboard`: serve the web UI over a prefix's runs, data stages, steps and jobs."""

from __future__ import annotations

import logging
import signal
from types import FrameType

import typer

from keel.cli.output import user_errors

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8472


def register(app: typer.Typer) -> None:
    app.command("dashboard")(dashboard_command)


class _Terminated(Exception):
    """SIGTERM arrived: stop serving as on Ctrl-C."""


@user_errors
def dashboard_command(
    root: str | None = typer.Option(
        None,
        "--root",
        help="The prefix to show: its steps, telemetry/ and cluster/ (default: keel-out).",
    ),
    url: str | None = typer.Option(
        None, "--url", help="Show a telemetry server's runs instead (`keel logs serve`)."
    ),
    experiments: str | None = typer.Option(
        None,
        "--experiments",
        help="Experiment records to list (`keel experiment new`; default: ./experiments).",
    ),
    port: int = typer.Option(DEFAULT_PORT, "--port", help="TCP port (0: any free port)."),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Address to listen on (not loopback: needs --token)."
    ),
    token: str | None = typer.Option(
        None,
        "--token",
        envvar="KEEL_DASHBOARD_TOKEN",
        help="Require `Authorization: Bearer TOKEN` (needed beyond loopback).",
    ),
    telemetry_token: str | None = typer.Option(
        None, "--telemetry-token", envvar="KEEL_TELEMETRY_TOKEN", help="The --url server's token."
    ),
) -> None:
    """A web UI: runs and live metric charts, data-stage funnels, steps, jobs, logs and SQL.

    Serves until Ctrl-C or SIGTERM; open the URL it prints. Works offline (no CDN).

    Examples:
      keel dashboard                       # ./keel-out, http://127.0.0.1:8472
      keel dashboard --root runs/keel-out --port 9000
      keel dashboard --url http://head:8470
    """
    from keel.dashboard.server import DashboardServer
    from keel.dashboard.sources import open_sources

    sources = open_sources(root, url, telemetry_token, experiments)
    try:
        server = DashboardServer(sources, host=host, port=port, token=token)
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        typer.echo(f"dashboard of {sources.label} at {server.url}/ (Ctrl-C to stop)", err=True)
        try:
            server.serve_forever()
        except (KeyboardInterrupt, _Terminated):
            logger.info("stopping the dashboard")
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        sources.close()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Terminated()
