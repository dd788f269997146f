"""JAX's persistent compilation cache across `keel train` processes: the first run fills the
directory KEEL_COMPILATION_CACHE names, a second run of the same config compiles nothing new and
reads every program back."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from keel.train.compile_cache import CACHE_ENV, cache_directory


def entries(directory: Path) -> dict[str, bytes]:
    """Each cached program's last-read stamp (JAX's bounded cache rewrites it on every hit)."""
    return {
        path.name.removesuffix("-atime"): path.read_bytes() for path in directory.glob("*-atime")
    }


def keel_train(cache: str, output: Path, compile_cache: Path) -> None:
    args = ["train", "--preset", "tiny-dense", "--steps", "2", "--output", str(output)]
    changes = [
        f"data=[{{cache: {cache}}}]",
        "model.vocab_size=512",
        "model.n_layers=1",
        "phases.0.seq_len=32",
        "phases.0.schedule.warmup_steps=1",
    ]
    for change in changes:
        args += ["--set", change]
    env = {**os.environ, CACHE_ENV: str(compile_cache)}
    done = subprocess.run(
        [sys.executable, "-m", "keel", *args], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_a_second_run_reads_every_program_from_the_cache(wikitext_cache, tmp_path):
    compile_cache = tmp_path / "jax-cache"
    keel_train(wikitext_cache, tmp_path / "first", compile_cache)
    after_first = entries(compile_cache)
    assert any(name.startswith("jit_update-") for name in after_first), sorted(after_first)
    assert set(entries(compile_cache)) == {
        path.name.removesuffix("-cache") for path in compile_cache.glob("*-cache")
    }

    keel_train(wikitext_cache, tmp_path / "second", compile_cache)
    after_second = entries(compile_cache)
    assert after_second.keys() == after_first.keys()  # nothing compiled anew
    assert all(after_second[name] != stamp for name, stamp in after_first.items())  # all read


def test_the_cache_directory_comes_from_the_environment(tmp_path):
    assert cache_directory({CACHE_ENV: str(tmp_path)}) == tmp_path
    assert cache_directory({CACHE_ENV: "off"}) is None
    assert cache_directory({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "keel" / "jax"
    assert cache_directory({}) == Path.home() / ".cache" / "keel" / "jax"
