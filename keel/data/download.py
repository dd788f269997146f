"""Download: the first DataKit stage, raw files from http(s), s3 or gcs URLs into a local directory.

    from keel.data.download import DownloadConfig, run_download

    report = run_download("https://example.org/shard-00.jsonl.gz", "raw/")
    report = run_download("urls.txt", "raw/", DownloadConfig(concurrency=16))  # a URL list

The source is one URL, or a URL list: a local file with one URL per line, optionally followed by
its SHA-256 (whitespace, comma or tab separated; blank lines and lines starting with # are
skipped). Every URL is read through fsspec (s3:// needs s3fs, gs:// gcsfs, http(s):// aiohttp).

Each file is fetched in ranges of `block_bytes` (HTTP Range requests, ranged GETs on object
stores) into `NAME.part` beside its final name, appended and flushed range by range, so a killed
or failed download continues from the partial file's size when it runs again and fetches only the
bytes still missing; a file already complete at the source's size is not fetched again. Failed
requests are retried `retries` times with exponential backoff (`backoff_seconds`, doubling),
continuing from the bytes already written. Files are fetched `concurrency` at a time.

Checksums: the list's SHA-256 column, else `URL.sha256` beside the file when the source has one
(its first word; `sha256sum`'s format); a file whose SHA-256 differs is removed and the run fails.
A missing file (404, no such key) fails the run too: both as one line (DownloadError, exit 1).

The output directory holds the files, named by their URL's last path component, and
`manifest.json` (each file's URL, name, bytes, SHA-256 and whether a checksum verified it),
written last and atomically: a directory with a manifest holds every file it lists, complete.
It holds nothing else: a directory with other files is refused before anything is fetched, and
a rerun into the directory of an earlier download of the same URLs continues it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import re
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

from keel.core import paths
from keel.core.errors import KeelError, UsageError

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
PART_SUFFIX = ".part"
_HEX = re.compile(r"^[0-9a-fA-F]{64}$")
_HASH_BLOCK = 1 << 20


class DownloadError(KeelError):
    """A file could not be fetched as asked: missing at the source, or not what its checksum
    says (exit 1)."""


@dataclass(frozen=True)
class DownloadConfig:
    """How files are fetched."""

    concurrency: int = 8
    """Files fetched at once."""
    block_bytes: int = 8 << 20
    """Bytes asked for per range request (and lost at most when a download is killed)."""
    retries: int = 5
    """Retries of a failed request (not of a missing file or a checksum mismatch)."""
    backoff_seconds: float = 1.0
    """Wait before the first retry; doubled for each next one."""
    checksums: bool = True
    """Look for `URL.sha256` beside files the list gives no checksum for."""

    def __post_init__(self) -> None:
        for name in ("concurrency", "block_bytes"):
            if getattr(self, name) < 1:
                raise UsageError(
                    f"DownloadConfig.{name} must be at least 1, got {getattr(self, name)}"
                )
        if self.retries < 0 or self.backoff_seconds < 0:
            raise UsageError("DownloadConfig.retries and backoff_seconds must not be negative")


@dataclass(frozen=True)
class Wanted:
    """One file to fetch: its URL, the SHA-256 the list gives (None: look beside it), and the
    name it gets in the output directory."""

    url: str
    sha256: str | None
    name: str


@dataclass
class Fetched:
    """What the manifest says of one file."""

    url: str
    name: str
    bytes: int
    sha256: str
    checksum: str
    """Where the verified checksum came from: "list", "sha256 file", or "none"."""
    fetched_bytes: int = 0
    """Bytes this run fetched (0 for a file complete before it ran)."""


@dataclass
class DownloadReport:
    """What a download did: written as manifest.json."""

    stage: str = "download"
    files: list[Fetched] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(item.bytes for item in self.files)

    @property
    def fetched_bytes(self) -> int:
        return sum(item.fetched_bytes for item in self.files)

    def to_dict(self) -> dict:
        return {
            "stage": self.stage,
            "bytes": self.bytes,
            "fetched_bytes": self.fetched_bytes,
            "files": [asdict(item) for item in self.files],
        }


Progress = Callable[[Fetched], None]
"""Called from the fetching threads as each file completes."""


def run_download(
    source: str,
    output: str,
    config: DownloadConfig = DownloadConfig(),
    options: object = None,
    on_file: Progress | None = None,
) -> DownloadReport:
    """Fetch the URL or URL list `source` into the local directory `output` (module doc); write
    manifest.json last. `options` (flow's RunOptions) is accepted so that data_step runs this
    like any stage, and unused: downloading is I/O on threads, not flow work."""
    del options
    if not paths.is_local(output):
        raise UsageError(f"--output {output}: download writes to a local directory")
    wanted = read_source(source)
    directory = Path(paths.local_path(output))
    _refuse_other_files(directory, wanted, output)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST_FILE).unlink(missing_ok=True)  # until every file is complete again
    fetched: dict[str, Fetched] = {}
    with ThreadPoolExecutor(max_workers=config.concurrency) as pool:
        futures = {pool.submit(fetch_file, item, directory, config): item for item in wanted}
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for future in pending:
            future.cancel()
        for future in done:
            if future.exception() is None:
                result = future.result()
                fetched[result.url] = result
                if on_file is not None:
                    on_file(result)
        failed = [future for future in done if future.exception() is not None]
        if failed:
            raise failed[0].exception()
    report = DownloadReport(files=[fetched[item.url] for item in wanted])
    paths.write_text(str(directory / MANIFEST_FILE), json.dumps(report.to_dict(), indent=2))
    return report


def _refuse_other_files(directory: Path, wanted: list[Wanted], output: str) -> None:
    """UsageError when `directory` holds anything but this download's files, their partial
    files and the manifest: a download never writes among a user's other files."""
    if not directory.exists():
        return
    if not directory.is_dir():
        raise UsageError(f"--output {output} is a file, not a directory")
    allowed = {MANIFEST_FILE}
    for item in wanted:
        allowed |= {item.name, item.name + PART_SUFFIX}
    others = sorted(path.name for path in directory.iterdir() if path.name not in allowed)
    if others:
        raise UsageError(
            f"--output {output} holds files this download does not write ({others[0]}"
            f"{', ...' if len(others) > 1 else ''}): refused; use a new or empty directory, or "
            "the one an earlier download of the same URLs wrote"
        )


def read_source(source: str) -> list[Wanted]:
    """The files a source names: a URL list (an existing local file) or one URL. UsageError for
    an empty list or two URLs with the same file name."""
    if "://" not in source and os.path.isfile(source):
        entries = list(_list_entries(Path(source).read_text(encoding="utf-8"), source))
        if not entries:
            raise UsageError(f"{source} lists no URLs")
    elif "://" in source:
        entries = [(source, None)]
    else:
        raise UsageError(f"{source}: neither a URL (scheme://...) nor a URL list file")
    wanted, names = [], {}
    for url, checksum in entries:
        name = posixpath.basename(url.split("?", 1)[0].rstrip("/"))
        if not name or name == MANIFEST_FILE:
            raise UsageError(f"{url}: cannot name a file after this URL")
        if name in names:
            raise UsageError(f"{names[name]} and {url} would both be saved as {name}")
        names[name] = url
        wanted.append(Wanted(url, checksum, name))
    return wanted


def _list_entries(text: str, source: str):
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = [part for part in re.split(r"[\s,]+", line) if part]
        checksum_ok = len(fields) == 1 or (len(fields) == 2 and _HEX.match(fields[1]))
        if "://" not in fields[0] or not checksum_ok:
            raise UsageError(
                f"{source}:{number}: expected a URL, optionally followed by its SHA-256 "
                f"(64 hex digits), got {line!r}"
            )
        yield fields[0], fields[1].lower() if len(fields) == 2 else None


def fetch_file(item: Wanted, directory: Path, config: DownloadConfig) -> Fetched:
    """Fetch one file into `directory` (continuing NAME.part), verify it, move it into place."""
    fs, fs_path = paths.filesystem(item.url)
    size = _retried(lambda: _size(fs, fs_path, item.url), item.url, config)
    expected, checksum_from = item.sha256, "list"
    if expected is None and config.checksums:
        expected, checksum_from = _sidecar_checksum(item.url, config), "sha256 file"
    final, part = directory / item.name, directory / (item.name + PART_SUFFIX)
    fetched = 0
    if final.exists() and final.stat().st_size == size:
        digest = _sha256(final)
    else:
        if final.exists():
            final.replace(part)  # a file of another size: fetch what is missing (or refetch)
        if part.exists() and part.stat().st_size > size:
            part.unlink()
        fetched = _fetch_ranges(fs, fs_path, item.url, part, size, config)
        digest = _sha256(part)
    if expected is not None and digest != expected:
        (part if part.exists() else final).unlink(missing_ok=True)
        raise DownloadError(
            f"checksum mismatch for {item.url}: expected sha256 {expected}, got {digest} "
            "(the file was removed; run again to fetch it anew)"
        )
    if part.exists():
        part.replace(final)
    logger.info("downloaded %s (%d bytes, %d fetched)", item.url, size, fetched)
    return Fetched(
        item.url, item.name, size, digest, checksum_from if expected else "none", fetched
    )


def _fetch_ranges(fs, fs_path: str, url: str, part: Path, size: int, config: DownloadConfig) -> int:
    """Append the bytes of `url` after the partial file's end, a block at a time; the bytes
    fetched."""
    fetched = 0
    with open(part, "ab") as handle:
        offset = handle.tell()
        while offset < size:
            end = min(offset + config.block_bytes, size)
            data = _retried(
                lambda start=offset, stop=end: _range(fs, fs_path, url, start, stop), url, config
            )
            handle.write(data)
            handle.flush()
            offset += len(data)
            fetched += len(data)
        os.fsync(handle.fileno())
    return fetched


def _range(fs, fs_path: str, url: str, start: int, stop: int) -> bytes:
    data = fs.cat_file(fs_path, start=start, end=stop)
    if len(data) != stop - start:
        raise OSError(f"{url}: asked for bytes {start}-{stop - 1}, got {len(data)} bytes")
    return data


def _size(fs, fs_path: str, url: str) -> int:
    try:
        info = fs.info(fs_path)
    except FileNotFoundError as error:
        raise DownloadError(f"{url}: not found at the source (404 / no such key)") from error
    size = info.get("size")
    if size is None:
        raise DownloadError(f"{url}: the source does not give the file's size")
    return int(size)


def _sidecar_checksum(url: str, config: DownloadConfig) -> str | None:
    """The SHA-256 in `URL.sha256` (its first word), or None when there is no such file."""
    fs, fs_path = paths.filesystem(url + ".sha256")
    try:
        text = _retried(lambda: fs.cat_file(fs_path), url + ".sha256", config, missing_ok=True)
    except FileNotFoundError:
        return None
    words = text.decode("utf-8", errors="replace").split()
    if not words or not _HEX.match(words[0]):
        raise DownloadError(f"{url}.sha256 does not start with a SHA-256 (64 hex digits)")
    return words[0].lower()


def _retried(call, url: str, config: DownloadConfig, missing_ok: bool = False):
    """`call()`, retried on transient errors with exponential backoff. A missing file is not
    transient: DownloadError (FileNotFoundError itself when `missing_ok`)."""
    for attempt in range(config.retries + 1):
        try:
            return call()
        except FileNotFoundError as error:
            if missing_ok:
                raise
            raise DownloadError(f"{url}: not found at the source (404 / no such key)") from error
        except (KeelError, PermissionError):
            raise
        except Exception as error:  # network errors come as aiohttp's, botocore's or OSError
            status = getattr(error, "status", None)
            if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
                raise DownloadError(f"{url}: HTTP {status} ({error})") from error
            if attempt == config.retries:
                raise DownloadError(
                    f"{url}: failed after {config.retries + 1} attempts: "
                    f"{type(error).__name__}: {error}"
                ) from error
            wait_seconds = config.backoff_seconds * 2**attempt
            logger.warning("%s: %s; retrying in %.1f s", url, error, wait_seconds)
            time.sleep(wait_seconds)
    raise AssertionError("unreachable")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()
