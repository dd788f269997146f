"""`keel data download` against this test's own HTTP server (which counts the bytes it serves) and
moto's S3: killed mid-way and rerun it fetches only the missing bytes, files match the source's
checksums, and a 404 or a checksum mismatch is one error line with exit 1."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from keel.core.errors import UsageError
from keel.data.download import DownloadConfig, DownloadError, run_download

SIZE = 2 << 20
BLOCK = 64 << 10


class Files:
    """What the server serves (path -> bytes), the body bytes it served per path, and a pause
    before each response (so a download takes long enough to be killed)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.served: dict[str, int] = {}
        self.pause = 0.0
        self.lock = threading.Lock()


def _handler(files: Files):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # no line per request on stderr
            pass

        def do_HEAD(self) -> None:
            self._respond(body=False)

        def do_GET(self) -> None:
            self._respond(body=True)

        def _respond(self, body: bool) -> None:
            data = files.data.get(self.path)
            if data is None:
                self.send_error(404)
                return
            start, end, status = 0, len(data), 200
            ranged = self.headers.get("Range")
            if ranged:
                first, _, last = ranged.removeprefix("bytes=").partition("-")
                start, end, status = int(first), min(int(last) + 1, len(data)), 206
            time.sleep(files.pause)
            self.send_response(status)
            self.send_header("Content-Length", str(end - start))
            self.send_header("Accept-Ranges", "bytes")
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.end_headers()
            if body:
                self.wfile.write(data[start:end])
                with files.lock:
                    files.served[self.path] = files.served.get(self.path, 0) + end - start

    return Handler


@pytest.fixture(scope="module")
def server():
    files = Files()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(files))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield files, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _keel(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "COLUMNS": "200"}
    return subprocess.Popen(
        [sys.executable, "-m", "keel", "data", "download", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def _serve(files: Files, name: str, sidecar: bool = True) -> tuple[bytes, str]:
    data = os.urandom(SIZE)
    digest = hashlib.sha256(data).hexdigest()
    files.data[f"/{name}"] = data
    if sidecar:
        files.data[f"/{name}.sha256"] = f"{digest}  {name}\n".encode()
    return data, digest


def test_killed_mid_way_a_rerun_fetches_only_the_missing_bytes(server, tmp_path):
    files, base = server
    data, digest = _serve(files, "shard.bin")
    files.pause = 0.03  # 32 ranges of 64 KiB: about a second
    process = _keel(f"{base}/shard.bin", "--output", str(tmp_path), "--set", f"block_bytes={BLOCK}")
    part = tmp_path / "shard.bin.part"
    deadline = time.monotonic() + 60
    while not (part.exists() and part.stat().st_size >= SIZE // 4):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the download never got a quarter through"
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    partial = part.stat().st_size
    assert 0 < partial < SIZE and not (tmp_path / "manifest.json").exists()

    files.pause, files.served = 0.0, {}
    report = run_download(f"{base}/shard.bin", str(tmp_path), DownloadConfig(block_bytes=BLOCK))
    assert files.served["/shard.bin"] == SIZE - partial  # only what was missing
    assert (tmp_path / "shard.bin").read_bytes() == data and not part.exists()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["files"] == [
        {"url": f"{base}/shard.bin", "name": "shard.bin", "bytes": SIZE, "sha256": digest,
         "checksum": "sha256 file", "fetched_bytes": SIZE - partial}
    ]  # fmt: skip
    assert report.fetched_bytes == SIZE - partial

    files.served = {}  # complete: a third run fetches nothing
    run_download(f"{base}/shard.bin", str(tmp_path), DownloadConfig(block_bytes=BLOCK))
    assert files.served.get("/shard.bin", 0) == 0


def test_a_url_list_with_checksums_fetches_every_file_concurrently(server, tmp_path):
    files, base = server
    listed = {name: _serve(files, name, sidecar=False) for name in ("a.bin", "b.bin", "c.bin")}
    urls = tmp_path / "urls.txt"
    urls.write_text(
        "# three shards\n" + "".join(f"{base}/{n}  {d}\n" for n, (_, d) in listed.items())
    )
    report = run_download(str(urls), str(tmp_path / "out"), DownloadConfig(concurrency=3))
    assert [item.checksum for item in report.files] == ["list"] * 3
    for name, (data, _) in listed.items():
        assert (tmp_path / "out" / name).read_bytes() == data


def test_a_404_and_a_checksum_mismatch_are_one_error_line_exit_1(server, tmp_path):
    files, base = server
    _, digest = _serve(files, "bad.bin", sidecar=False)
    urls = tmp_path / "urls.txt"
    urls.write_text(f"{base}/bad.bin,{'0' * 64}\n")
    missing = _keel(f"{base}/nothing.bin", "--output", str(tmp_path / "a"))
    mismatch = _keel(str(urls), "--output", str(tmp_path / "b"))  # both at once: start-up time

    _, err = missing.communicate(timeout=60)
    assert missing.returncode == 1, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "not found" in err
    _, err = mismatch.communicate(timeout=60)
    assert mismatch.returncode == 1, err
    assert err.startswith("error: checksum mismatch") and err.count("\n") == 1
    assert digest in err and not (tmp_path / "b" / "bad.bin").exists()


def test_s3_resumes_from_a_partial_file_and_verifies_its_checksum(s3, tmp_path):
    import fsspec

    data = os.urandom(SIZE)
    url = s3.url("shard") + ".bin"
    fs = fsspec.filesystem("s3")
    fs.pipe_file(url, data)
    fs.pipe_file(url + ".sha256", hashlib.sha256(data).hexdigest().encode())
    name = url.rsplit("/", 1)[1]
    (tmp_path / f"{name}.part").write_bytes(data[:300_000])  # a killed run's partial file
    report = run_download(url, str(tmp_path), DownloadConfig(block_bytes=BLOCK))
    assert report.files[0].fetched_bytes == SIZE - 300_000
    assert report.files[0].checksum == "sha256 file"
    assert (tmp_path / name).read_bytes() == data

    fs.pipe_file(url + ".sha256", b"f" * 64)  # the source's checksum now disagrees
    (tmp_path / name).unlink()
    with pytest.raises(DownloadError, match="checksum mismatch"):
        run_download(url, str(tmp_path), DownloadConfig(block_bytes=BLOCK))


def test_a_download_step_fetches_into_its_output(server, tmp_path):
    from keel.data.steps import download_step
    from keel.steps import executor

    files, base = server
    data, _ = _serve(files, "step.bin")
    step = download_step("raw", f"{base}/step.bin")
    report = executor.run([step], str(tmp_path / "prefix"))
    output = next((tmp_path / "prefix").glob("raw-*/step.bin"))
    assert output.read_bytes() == data and report is not None
    assert json.loads((output.parent / "manifest.json").read_text())["bytes"] == SIZE


def test_an_output_holding_other_files_is_refused_before_any_fetch(server, tmp_path):
    files, base = server
    _serve(files, "other.bin")
    (tmp_path / "notes.txt").write_text("a user's file\n")
    files.served = {}
    with pytest.raises(UsageError, match=r"holds files this download does not write \(notes"):
        run_download(f"{base}/other.bin", str(tmp_path))
    assert files.served == {} and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
