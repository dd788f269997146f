"""`keel train --preset cpu-speedrun --data FILE.txt --eval-data VAL.txt`: your own text in one
command, as a user runs it (the preset shrunk further: a 512-id vocabulary, 4 steps). One run
(module scope) is shared: it trains, a second command on a copy of the text finds the tokenized
caches, a recomputation from the saved parameters checks the final bits per byte, and bad inputs
fail with one `error:` line before anything trains."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_support import error_lines

WIKITEXT = Path(__file__).resolve().parents[3] / "shared/datasets/wikitext2"
SEQ_LEN = 64
SHRINK = (
    "--steps", "4",
    "--set", "model.vocab_size=512",
    "--set", "batch_size=4",
    "--set", f"phases.0.seq_len={SEQ_LEN}",
    "--set", "phases.0.schedule.warmup_steps=1",
)  # fmt: skip


def keel(root: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "keel", "train", "--preset", "cpu-speedrun", *args],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200"},
    )


def slice_text(name: str, start: int, size: int) -> str:
    """`size` characters of a WikiText-2 split from `start`, cut at line ends."""
    text = (WIKITEXT / name).read_text(encoding="utf-8")[start:]
    return text[: text.index("\n", size) + 1]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("own-text")
    (root / "texts").mkdir()
    (root / "texts" / "train.txt").write_text(slice_text("valid.txt", 0, 60_000), "utf-8")
    (root / "texts" / "val.txt").write_text(slice_text("test.txt", 2_000, 12_000), "utf-8")
    args = ("--data", "texts/train.txt", "--eval-data", "texts/val.txt", *SHRINK)
    result = keel(root, *args, "--prefix", "out", "--json")
    assert result.returncode == 0, result.stderr
    caches = {
        Path(line.split(" -> ")[0].removeprefix("data: ")).name: line.split(" -> ")[1].split()[0]
        for line in result.stderr.splitlines()
        if line.startswith("data: ")
    }
    return {"root": root, "result": result, "caches": caches, "args": args}


def test_trains_on_text_and_reports_the_eval_set_by_its_stem(run):
    assert "(tokenized)" in run["result"].stderr
    assert set(run["caches"]) == {"train.txt", "val.txt"}
    printed = json.loads(run["result"].stdout)
    run_dir = run["root"] / "out" / "train-cpu-speedrun"
    result = json.loads((run_dir / "result.json").read_text())
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert result["step"] == 4 and 1.0 < result["eval/val/bpb"] < 12.0
    assert printed["eval/val/bpb"] == result["eval/val/bpb"] == last["eval/val/bpb"]
    assert 1.0 < result["eval/train-heldout/bpb"] < 12.0  # the training text's held-out part


def test_the_same_text_elsewhere_reuses_the_caches(run):
    root = run["root"]
    copies = root / "copies"
    copies.mkdir()
    shutil.copy(root / "texts" / "train.txt", copies / "corpus.txt")
    shutil.copy(root / "texts" / "val.txt", copies / "val.txt")
    before = {p: p.stat().st_mtime_ns for p in (root / "out").glob("tokenize_text-*/manifest.json")}
    again = keel(
        root, "--data", "copies/corpus.txt", "--eval-data", "copies/val.txt", *SHRINK,
        "--prefix", "out",
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("(cached)") == 2 and "(tokenized)" not in again.stderr
    assert "already trained to step 4" in again.stdout
    after = {p: p.stat().st_mtime_ns for p in (root / "out").glob("tokenize_text-*/manifest.json")}
    assert after == before and len(after) == 2  # no new cache, nothing rewritten


def test_final_eval_bpb_matches_a_recomputation_over_the_whole_set(run):
    import jax
    from tokenizers import Tokenizer

    from keel.core.config import load_config
    from keel.data.token_cache import TokenCache
    from keel.model.transformer import forward
    from keel.train.checkpoint import Checkpoints
    from keel.train.config import TrainConfig
    from keel.train.layout import initial_state
    from keel.train.schedule import piecewise_lr

    run_dir = run["root"] / "out" / "train-cpu-speedrun"
    config = load_config(str(run_dir / "config.yaml"), TrainConfig)
    assert not config.mask_documents and config.eval_names == ("val",)
    fresh, _, _ = initial_state(config, piecewise_lr(config.segments()))
    checkpoints = Checkpoints(str(run_dir), every=1, keep=1)
    assert checkpoints.latest_step() == 4
    state = checkpoints.restore(fresh)
    checkpoints.close()

    text = (run["root"] / "texts" / "val.txt").read_text("utf-8")
    tokenizer = Tokenizer.from_file(str(Path(run["caches"]["train.txt"]) / "tokenizer.json"))
    encoding = tokenizer.encode(text, add_special_tokens=False)
    eos = tokenizer.token_to_id("<|endoftext|>")
    stream = np.array([*encoding.ids, eos], np.int32)  # the document, then its end
    cache = TokenCache(run["caches"]["val.txt"])
    assert np.array_equal(cache.slice(0, cache.total_tokens), stream)
    assert (len(stream) - 1) % SEQ_LEN != 0  # a partial last window to score

    model = jax.jit(lambda params, tokens: forward(params, tokens, config.model, None)[0])
    full = (len(stream) - 1) // SEQ_LEN
    starts = np.arange(full) * SEQ_LEN
    windows = [stream[starts[:, None] + np.arange(SEQ_LEN + 1)], stream[None, full * SEQ_LEN :]]
    nats = 0.0
    for batch in windows:  # every target once: the whole windows, then the shorter tail
        logits = np.asarray(model(state.params, jax.numpy.asarray(batch[:, :-1])), np.float64)
        top = logits.max(-1, keepdims=True)
        log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
        picked = np.take_along_axis(logits, batch[:, 1:, None], -1)[..., 0]
        nats += float((log_z - picked).sum())
    first_token_bytes = len(text[: encoding.offsets[0][1]].encode("utf-8"))
    target_bytes = len(text.encode("utf-8")) - first_token_bytes  # EOS stands for no text
    expected = nats / math.log(2) / target_bytes

    reported = json.loads((run_dir / "result.json").read_text())["eval/val/bpb"]
    assert reported == pytest.approx(expected, rel=1e-5)


def test_bad_inputs_are_one_error_line_and_exit_2(run, wikitext_cache):
    root = run["root"]
    bad = root / "bad"
    (bad / "empty-dir").mkdir(parents=True)
    (bad / "empty-dir" / "README.md").write_text("not a document\n")
    (bad / "empty.txt").write_text("")
    (bad / "a").mkdir()
    (bad / "b").mkdir()
    (bad / "a" / "val.txt").write_text("one\n")
    (bad / "b" / "val.txt").write_text("two\n")
    train_cache = run["caches"]["train.txt"]
    cases = [
        (("--data", "bad/nothing.txt"), "does not exist"),
        (("--data", "bad/empty.txt"), "is empty"),
        (("--data", "bad/empty-dir"), "holds no documents"),
        (("--data", train_cache, "--eval-data", wikitext_cache), "another vocabulary"),
        (("--data", "texts/train.txt", "--eval-data", "bad/a/val.txt", "--eval-data",
          "bad/b/val.txt"), "one stem, 'val'"),
    ]  # fmt: skip
    for args, message in cases:
        result = keel(root, *args, *SHRINK, "--prefix", "bad-out", timeout=120)
        assert result.returncode == 2, (args, result.stderr)
        errors = error_lines(result.stderr)
        assert len(errors) == 1 and message in errors[0], (args, result.stderr)
        assert "Traceback" not in result.stderr
    assert not (root / "bad-out").exists() or not list((root / "bad-out").glob("train-*"))


@pytest.mark.parametrize(("seq_len", "batch_size"), [(64, 4), (7, 3), (1000, 2)])
def test_whole_set_batches_score_every_token_after_the_first_once(
    wikitext_cache, seq_len, batch_size
):
    from keel.data.token_cache import TokenCache
    from keel.train.loader import WindowRange, scored_batches

    cache = TokenCache(wikitext_cache)
    tokens = cache.slice(0, cache.total_tokens)
    whole = WindowRange(cache.path, seq_len, 0, cache.num_windows(seq_len))
    scored = []
    for windows, weights in scored_batches(whole, batch_size, tail=True):
        assert windows.shape == (batch_size, seq_len + 1) and weights.shape == (batch_size, seq_len)
        scored.extend(windows[:, 1:][weights == 1].tolist())
    assert scored == tokens[1:].tolist()  # each target once, in order, none skipped
    sampled = list(scored_batches(whole, batch_size, max_batches=1, tail=True))
    assert len(sampled) == 1 and sampled[0][1].sum() == batch_size * seq_len  # no tail
