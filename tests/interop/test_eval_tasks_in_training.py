"""eval_tasks during training: the chosen tasks' scores join the metrics lines at their cadence,
each equal to what `keel eval` gives on that step's checkpoint; a bad task name is one `error:`
line before training. Needs the `eval` extra (lm-eval); skipped cleanly without it."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from mesh_support import small_dense

from keel.train.evaluate import EvalRequest, run_eval
from keel.train.trainer import train

pytest.importorskip("lm_eval")

EVERY, LIMIT = 2, 6
PERPLEXITY_TASK = """\
task: lobster_ppl
dataset_path: json
dataset_kwargs: {data_files: {test: lobster.jsonl}}
test_split: test
output_type: loglikelihood
doc_to_text: "{{context}}"
doc_to_target: "{{continuation}}"
metric_list:
  - {metric: perplexity, aggregation: perplexity, higher_is_better: false}
"""
LOBSTER = [
    {"context": "The European lobster is a species of", "continuation": " clawed lobster"},
    {"context": "It may grow to a length of", "continuation": " 60 cm"},
    {"context": "In life , the lobsters are", "continuation": " blue , not red ."},
]


def test_task_scores_appear_at_their_cadence_and_equal_keel_eval(wikitext_cache, tmp_path):
    task_file = tmp_path / "lobster.yaml"
    task_file.write_text(PERPLEXITY_TASK)
    (tmp_path / "lobster.jsonl").write_text("".join(json.dumps(d) + "\n" for d in LOBSTER))
    config = small_dense(
        f"data=[{{cache: {wikitext_cache}}}]", "steps=4", "checkpoint_every=2",
        "eval_every=1000", "phases.0.schedule.warmup_steps=1",
        f"eval_tasks=[wikitext_cloze, {task_file}]", f"eval_tasks_every={EVERY}",
        f"eval_tasks_limit={LIMIT}",
    )  # fmt: skip
    run = tmp_path / "run"
    train(config, str(run), devices=jax.devices()[:1])
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scored = {line["step"]: line for line in lines if "eval_task/wikitext_cloze/acc" in line}
    assert sorted(scored) == [2, 4]
    for step, line in scored.items():
        got = {k: v for k, v in line.items() if k.startswith("eval_task/")}
        assert set(got) == {
            "eval_task/wikitext_cloze/acc",
            "eval_task/wikitext_cloze/acc_norm",
            "eval_task/lobster_ppl/perplexity",
        }
        request = EvalRequest(
            run=str(run),
            output=str(tmp_path / f"eval-{step}"),
            tasks=("wikitext_cloze",),
            task_files=(str(task_file),),
            step=step,
            limit=LIMIT,
        )
        tasks = run_eval(request)["tasks"]
        want = {
            f"eval_task/{task}/{metric.removesuffix(',none')}": value
            for task, metrics in tasks.items()
            for metric, value in metrics.items()
        }
        assert want.keys() == got.keys()
        for name, value in got.items():
            assert abs(value - want[name]) <= 1e-6, (step, name, value, want[name])
    ppl = [scored[step]["eval_task/lobster_ppl/perplexity"] for step in (2, 4)]
    assert ppl[0] != ppl[1] and all(p > 1 for p in ppl)  # a different model each time


def test_an_unknown_task_in_the_config_is_one_error_line_before_training(wikitext_cache, tmp_path):
    run = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "keel", "train", "--preset", "tiny-dense", "--steps", "2",
         "--output", str(run), "--set", f"data=[{{cache: {wikitext_cache}}}]",
         "--set", "model.vocab_size=512", "--set", "eval_tasks=[wikitext_clozee]"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: eval_tasks: unknown task"), lines
    assert "did you mean 'wikitext_cloze'" in lines[0]
    assert not Path(run, "metrics.jsonl").exists()
