"""A real S3-compatible server on localhost for the tests of run directories on object storage:
moto's server mode (the `test` extra's moto[server]) on 127.0.0.1 at a free port, started once a
session with one bucket, stopped at the end.

`s3` (per test) points this process and the keel commands a test starts (they inherit the
environment) at it: dummy credentials, a region, and AWS_ENDPOINT_URL, which botocore, and so
s3fs, honours. Only tests that use the fixture see these variables.
"""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

BUCKET = "keel-test"


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    """http://127.0.0.1:PORT"""
    env: dict[str, str]
    """The variables a client needs to reach the server."""

    def url(self, name: str) -> str:
        """A fresh s3:// URL in the test bucket (unique per call, so tests never share files)."""
        return f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ACCESS_KEY_ID": "keel-test",
        "AWS_SECRET_ACCESS_KEY": "keel-test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }
    import boto3

    boto3.client("s3", endpoint_url=endpoint, **_credentials(env)).create_bucket(Bucket=BUCKET)
    try:
        yield S3Server(endpoint, env)
    finally:
        server.stop()


def _credentials(env: dict[str, str]) -> dict[str, str]:
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_DEFAULT_REGION"],
    }


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The session's server, with this process's environment (and so the keel commands the test
    starts) pointed at it for the test."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server
