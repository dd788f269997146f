"""A run directory on object storage (s3://, gs://, any fsspec URL) as the trainer writes it: a
local working copy, with every checkpoint copied up by one function, `RunMirror.commit`.

Orbax and an appended metrics.jsonl need a local file system (an object store can neither rename
nor append), so for a URL the trainer works in a local directory (made under the system's
temporary directory, TMPDIR) and `commit` uploads, in this order:
    1. the files carried with checkpoints (metrics.jsonl), whole;
    2. the new checkpoint's files, under checkpoints/<step>/ (replacing any partial upload of
       that step by a killed attempt);
    3. checkpoints/committed.json, {"steps": [...]}: the steps that are complete there, written
       last in one PUT, so a run killed during an upload never resumes from a partial checkpoint;
    4. the removal of the checkpoints retention dropped locally.
A start downloads the latest committed checkpoint and the carried files into a fresh working copy;
metrics lines past that checkpoint are then dropped as they are for a local run. A remote run
directory therefore lags its working copy by at most one checkpoint interval.

For a local run directory nothing is copied: the working copy is the directory itself.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from keel.core import paths

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
"""The config a run last trained under (written when it starts or resumes)."""
METRICS_FILE = "metrics.jsonl"
RESULT_FILE = "result.json"
COMMITTED_FILE = "committed.json"
"""In a remote checkpoints/ directory: the steps uploaded completely."""


class RunMirror:
    """The local directory a run's files are written in, and the run directory it stands for."""

    def __init__(self, run_dir: str, checkpoints_dir: str) -> None:
        self.run_dir = paths.normalize(run_dir)
        self.checkpoints_dir = checkpoints_dir
        """The checkpoints' folder, relative to the run directory."""
        self.remote = not paths.is_local(run_dir)
        if self.remote:
            self.local = Path(tempfile.mkdtemp(prefix="keel-run-"))
        else:
            self.local = paths.local_path(self.run_dir).expanduser().resolve()
        """Where the trainer writes: the run directory itself, or a fresh working copy."""

    def local_file(self, name: str) -> str:
        """The path to write the run directory's file `name` at."""
        return str(self.local / name)

    def committed_steps(self) -> list[int]:
        """The checkpoint steps complete in the run directory, ascending. A remote directory
        without committed.json (a local run copied up) counts its numbered step folders."""
        checkpoints = paths.join(self.run_dir, self.checkpoints_dir)
        committed = paths.join(checkpoints, COMMITTED_FILE)
        if paths.exists(committed):
            return sorted(json.loads(paths.read_text(committed))["steps"])
        return sorted(int(name) for name in paths.list_dir(checkpoints) if name.isdigit())

    def fetch(self, files: Sequence[str], step: int | None) -> None:
        """Download `files` (those that exist) and checkpoint `step` (None: no checkpoint) into
        the working copy; nothing for a local run directory."""
        if not self.remote:
            return
        for name in files:
            source = paths.join(self.run_dir, name)
            if paths.exists(source):
                paths.copy_file(source, self.local_file(name))
        if step is not None:
            paths.copy_tree(
                paths.join(self.run_dir, self.checkpoints_dir, str(step)),
                str(self.local / self.checkpoints_dir / str(step)),
            )
            logger.info("downloaded checkpoint %d of %s", step, self.run_dir)

    def commit(self, files: Sequence[str], step: int, kept: Sequence[int]) -> None:
        """Upload `files` and the new checkpoint `step`, then record `kept` (the steps the
        working copy holds, `step` among them) as committed and delete the other remote
        checkpoints; nothing for a local run directory."""
        if not self.remote:
            return
        for name in files:
            paths.copy_file(self.local_file(name), paths.join(self.run_dir, name))
        checkpoints = paths.join(self.run_dir, self.checkpoints_dir)
        written = self.local / self.checkpoints_dir / str(step)
        target = paths.join(checkpoints, str(step))
        paths.remove_tree(target)  # an earlier attempt's partial upload, never committed
        paths.copy_tree(str(written), target)
        paths.write_text(
            paths.join(checkpoints, COMMITTED_FILE), json.dumps({"steps": sorted(kept)}) + "\n"
        )
        for name in paths.list_dir(checkpoints):
            if name.isdigit() and int(name) not in kept:
                paths.remove_tree(paths.join(checkpoints, name))
        logger.info("uploaded checkpoint %d to %s", step, self.run_dir)

    def close(self) -> None:
        """Remove a working copy (everything in it was committed or is past the last
        checkpoint); a local run directory stays."""
        if self.remote and self.local.exists():
            shutil.rmtree(self.local)
