"""`keel eval` on lm-evaluation-harness: the harness's log-likelihoods are keel's own, the
bundled GSM8K slice runs end to end into eval.json and telemetry, and bad input is one `error:`
line with exit code 2.

Needs the `eval` extra (lm-eval); skipped cleanly without it."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer

from keel.model.transformer import forward
from keel.telemetry.client import connect
from keel.train.lm_scoring import LOGITS_BUDGET, Scorer, ScoreRequest, bucket
from keel.train.trained import load_trained

pytest.importorskip("lm_eval")

TOLERANCE = 1e-4


def keel_eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "keel", "eval", *args], capture_output=True, text=True, timeout=240
    )


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one `error:` line of a refused command (asserting there is exactly one, exit 2)."""
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


def summed_logprob(trained, context: list[int], continuation: list[int]) -> float:
    """keel's own log p(continuation | context): one forward pass, no batching or padding."""
    tokens = jnp.asarray([context + continuation], jnp.int32)
    logits, _ = forward(trained.params, tokens, trained.model, trained.router_bias)
    logp = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))
    start = len(context)
    return float(sum(logp[start - 1 + i, t] for i, t in enumerate(continuation)))


def test_the_harness_loglikelihood_is_keels_summed_logprob(trained_run):
    from lm_eval.api.instance import Instance

    from keel.train.lm_eval_adapter import KeelLM

    trained = load_trained(str(trained_run))
    model = KeelLM(Scorer(trained, max_length=64, batch_size=4), Tokenizer.from_file(
        trained.tokenizer_path))  # fmt: skip
    pairs = [
        ("The European lobster is a species of", " lobster from the eastern Atlantic"),
        ("It may grow to a length of", " 60 cm"),
        ("", "Mating occurs in the summer"),  # the end-of-document id is the context
        ("In life , the lobsters are blue ,", " only becoming red on cooking ."),
        ("Homarus", " gammarus"),  # 5 requests, batches of 4: one padded batch
    ]
    requests = [Instance("loglikelihood", {}, pair, index) for index, pair in enumerate(pairs)]
    got = model.loglikelihood(requests)
    for (context, continuation), (logprob, _) in zip(pairs, got, strict=True):
        context_ids, continuation_ids = model.encode_pair(context, continuation)
        whole = model.encode(context + continuation)
        assert context_ids + continuation_ids == (whole if context else [trained.eos_id, *whole])
        want = summed_logprob(trained, context_ids, continuation_ids)
        assert abs(logprob - want) <= TOLERANCE, (context, logprob, want)
    # rolling: a text longer than the context (64) is scored in windows of 64 predictions,
    # every token once, each window with a full context where the text has one
    text = " ".join(pair[0] + pair[1] for pair in pairs)
    ids = model.encode(text)
    assert 64 < len(ids) <= 192
    (rolling,) = model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    full, want = [trained.eos_id, *ids], 0.0
    for begin in range(0, len(ids), 64):
        end = min(begin + 64, len(ids))
        start = max(0, end - 64)
        want += summed_logprob(trained, full[start : begin + 1], full[begin + 1 : end + 1])
    assert abs(rolling - want) <= TOLERANCE


def test_scoring_buckets_and_row_budget_leave_every_score_unchanged(trained_run):
    """Lengths pad to two buckets per octave; a batch on a CPU holds as many rows as its logits
    budget allows; one row per pass (a budget of one row) scores the same."""
    assert [bucket(n, 2) for n in (1, 32, 33, 48, 49, 65, 96, 97, 129, 200)] == [
        32, 32, 48, 48, 64, 96, 96, 128, 192, 256,
    ]  # fmt: skip
    assert [bucket(n) for n in (1, 32, 33, 65, 129)] == [32, 32, 64, 128, 256]
    trained = load_trained(str(trained_run))
    rng = np.random.default_rng(0)
    vocab = trained.model.vocab_size
    requests = [  # lengths across four buckets, the longest cut to max_length + 1
        ScoreRequest(tuple(int(t) for t in rng.integers(1, vocab, n)), k)
        for n, k in ((5, 2), (40, 7), (90, 1), (150, 60), (3, 1))
    ]
    batched = Scorer(trained, max_length=128, batch_size=4)
    assert jax.default_backend() != "cpu" or batched.rows(97) == min(
        4, LOGITS_BUDGET // (97 * vocab)
    )
    one_row = Scorer(trained, max_length=128, batch_size=4)
    one_row.logits_budget = 1  # every batch a single row
    assert one_row.rows(33) == 1
    got, alone = batched.score(requests), one_row.score(requests)
    for a, b in zip(got, alone, strict=True):
        assert abs(a.logprob - b.logprob) <= 1e-5 and a.greedy == b.greedy
    tokens = list(requests[3].tokens[-129:])  # cut: its last 129 tokens, 60 of them scored
    want = summed_logprob(trained, tokens[:-60], tokens[-60:])
    assert abs(got[3].logprob - want) <= TOLERANCE


def test_gsm8k_slice_runs_end_to_end_into_eval_json_and_telemetry(trained_run, tmp_path):
    output = tmp_path / "eval"
    telemetry = tmp_path / "telemetry"
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(json.dumps({"text": "The lobster is blue until it is cooked ."}) + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "keel", "eval", str(trained_run), "--tasks", "gsm8k_sample",
         "--limit", "20", "--eval-data", str(held_out), "--output", str(output), "--json"],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "KEEL_TELEMETRY": str(telemetry)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    written = json.loads((output / "eval.json").read_text())
    assert printed == written
    assert written["step"] == 2 and written["samples"] == {"gsm8k_sample": 20}
    metrics = written["tasks"]["gsm8k_sample"]
    assert set(metrics) == {"exact_match,strict-match", "exact_match,flexible-extract"}
    assert all(0.0 <= value <= 1.0 for value in metrics.values())
    assert written["bpb"]["held_out"] > 0
    assert not any(Path(trained_run).rglob("eval.json"))
    client = connect(str(telemetry))
    rows = client.query('SELECT task, metric, value FROM "eval.results"').to_pylist()
    client.close()
    assert {(row["task"], row["metric"]) for row in rows} == {
        ("gsm8k_sample", "exact_match,strict-match"),
        ("gsm8k_sample", "exact_match,flexible-extract"),
        ("held_out", "bpb"),
    }


def test_a_task_file_with_a_typo_is_one_error_line(trained_run, tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"q": "2 + 2 =", "a": "4"}) + "\n")
    task = tmp_path / "qa.yaml"
    task.write_text(
        "task: qa\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: qa.jsonl\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_txt: '{{q}}'\n"
        "doc_to_target: '{{a}}'\nmetric_list:\n  - metric: exact_match\n"
    )
    line = error_line(keel_eval(str(trained_run), "--task-file", str(task),
                                "--output", str(tmp_path / "out")))  # fmt: skip
    assert "doc_to_txt" in line and "doc_to_text" in line


def test_an_unknown_task_a_run_without_checkpoint_and_output_in_the_run_are_refused(
    trained_run, tmp_path
):
    """The UsageErrors `keel eval` prints as one `error:` line with exit code 2 (as above)."""
    from keel.core.errors import UsageError
    from keel.train.evaluate import EvalRequest, run_eval

    out = str(tmp_path / "out")
    with pytest.raises(UsageError, match=r"unknown task 'gsm8k_smaple'.*'gsm8k_sample'"):
        run_eval(EvalRequest(str(trained_run), out, tasks=("gsm8k_smaple",)))
    no_checkpoint = tmp_path / "run"
    no_checkpoint.mkdir()
    (no_checkpoint / "config.yaml").write_text((trained_run / "config.yaml").read_text())
    with pytest.raises(UsageError, match="holds no checkpoint"):
        run_eval(EvalRequest(str(no_checkpoint), out, tasks=("gsm8k_sample",)))
    with pytest.raises(UsageError, match="inside the run directory"):
        run_eval(EvalRequest(str(trained_run), str(trained_run / "eval"), tasks=("gsm8k_sample",)))


def test_bits_per_byte_alone_needs_no_task_and_nothing_chosen_is_refused(trained_run, tmp_path):
    """--eval-data alone scores the text (compressed JSON Lines here, named by its stem) and runs
    no task; with neither a task nor a text set there is nothing to evaluate."""
    from keel.core.errors import UsageError
    from keel.train.evaluate import EvalRequest, run_eval

    held_out = tmp_path / "held_out.jsonl.gz"
    held_out.write_bytes(gzip.compress(b'{"text": "The lobster is blue until it is cooked ."}\n'))
    results = run_eval(
        EvalRequest(str(trained_run), str(tmp_path / "out"), eval_data=(str(held_out),))
    )
    assert results["tasks"] == {} and results["bpb"]["held_out"] > 0
    with pytest.raises(UsageError, match=r"nothing to evaluate: give --tasks .* or --eval-data"):
        run_eval(EvalRequest(str(trained_run), str(tmp_path / "out2")))
