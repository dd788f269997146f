"""The tasks `keel eval` runs: lm-eval task configs read from local files only.

Two ship with keel, built on its bundled samples (keel/experiments/sample/):
- gsm8k_sample: the 200 GSM8K problems of gsm8k.jsonl.gz, generation scored by exact match of
  the final number (lm-eval's gsm8k recipe, zero-shot: "strict-match" reads "#### N",
  "flexible-extract" the last number);
- wikitext_cloze: multiple choice from wikitext2.jsonl.gz: given two sentences of an article,
  pick the sentence that follows among it and the same sentence slot of three other articles
  (acc, acc_norm).
A user's task file is an lm-eval task YAML whose data are local (`dataset_path: json`, `csv`,
`parquet`, `text` or `arrow` with `data_files`, or a local directory); relative data_files are
read relative to the task file. Its keys are checked against lm-eval's TaskConfig, so a typo is
one UsageError naming the key and the closest known one.

This module imports lm-eval's task config and YAML loader: only `keel eval` imports it.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from keel.core.errors import UsageError, did_you_mean

LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")
"""`dataset_path` values the datasets library reads from `data_files` without downloading."""
EXTRA_TASK_KEYS = frozenset({"include", "group", "task_list", "class", "dataset_kwargs"})
"""Keys a task YAML may hold besides TaskConfig's fields (lm-eval reads them itself)."""


def require_lm_eval(what: str) -> None:
    """Import lm-eval (and datasets) once; UsageError (one line) naming the eval extra when they
    are missing. `what` says who needs them (`keel eval`, `eval_tasks`)."""
    try:
        import datasets  # noqa: F401
        import lm_eval.evaluator  # noqa: F401
    except ModuleNotFoundError as error:
        if error.name is None or not error.name.startswith(("lm_eval", "datasets")):
            raise
        raise UsageError(
            f"{what} needs lm-eval ({error.name} is missing): pip install 'keel[eval]'"
        ) from error


def _sample(name: str) -> Path:
    """A file of the bundled samples (keel/experiments/sample/; named, not imported)."""
    return Path(str(resources.files("keel.experiments") / "sample" / name))


def _gsm8k_sample(_: Path) -> dict[str, Any]:
    return {
        "task": "gsm8k_sample",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(_sample("gsm8k.jsonl.gz"))}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{answer}}",
        "num_fewshot": 0,
        "generation_kwargs": {
            "until": ["Question:", "\n\n"],
            "do_sample": False,
            "temperature": 0.0,
            "max_gen_toks": 256,
        },
        "metric_list": [
            {
                "metric": "exact_match",
                "aggregation": "mean",
                "higher_is_better": True,
                "ignore_case": True,
                "ignore_punctuation": False,
                "regexes_to_ignore": [",", "\\$", "(?s).*#### ", "\\.$"],
            }
        ],
        "filter_list": [
            {
                "name": "strict-match",
                "filter": [
                    {"function": "regex", "regex_pattern": "#### (\\-?[0-9\\.\\,]+)"},
                    {"function": "take_first"},
                ],
            },
            {
                "name": "flexible-extract",
                "filter": [
                    {
                        "function": "regex",
                        "group_select": -1,
                        "regex_pattern": "(-?[$0-9.,]{2,})|(-?[0-9]+)",
                    },
                    {"function": "take_first"},
                ],
            },
        ],
        "metadata": {"version": 1.0},
    }


def _wikitext_cloze(work: Path) -> dict[str, Any]:
    data = work / "wikitext_cloze.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in cloze_documents()))
    return {
        "task": "wikitext_cloze",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": 1.0},
    }


BUNDLED_TASKS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "gsm8k_sample": _gsm8k_sample,
    "wikitext_cloze": _wikitext_cloze,
}
"""Task name -> its config (a function of a scratch directory for generated data files)."""


def cloze_documents(per_article: int = 5, choices: int = 4, seed: int = 0) -> list[dict]:
    """wikitext_cloze's items: {context, choices, label}, a pure function of the bundled
    sample. Sentences split at " . "; item k of an article is sentences k, k+1 as the context
    and sentence k+2 as the answer; the distractors are sentence k+2 of other articles."""
    with gzip.open(_sample("wikitext2.jsonl.gz"), "rt", encoding="utf-8") as lines:
        articles = [_sentences(json.loads(line)["text"]) for line in lines]
    articles = [a for a in articles if len(a) >= per_article + 2]
    rng = random.Random(seed)
    items = []
    for index, sentences in enumerate(articles):
        others = [a for i, a in enumerate(articles) if i != index]
        for k in range(per_article):
            answer = sentences[k + 2]
            wrong = [a[k + 2] for a in rng.sample(others, choices - 1)]
            label = rng.randrange(choices)
            options = [*wrong[:label], answer, *wrong[label:]]
            context = " ".join(sentences[k : k + 2])
            choices_text = [" " + option for option in options]
            items.append({"context": context, "choices": choices_text, "label": label})
    return items


def _sentences(text: str) -> list[str]:
    return [s.strip() + " ." for s in text.split(" . ") if len(s.split()) >= 4]


def task_configs(
    names: Sequence[str], task_files: Sequence[str], work: Path
) -> list[dict[str, Any]]:
    """The configs of the chosen tasks: each name bundled or defined by a task file, every task
    file's task included; UsageError (one line) for an unknown name or a bad task file."""
    from_files = {}
    for task_file in task_files:
        config = load_task_file(task_file)
        from_files[config["task"]] = config
    known = sorted({*BUNDLED_TASKS, *from_files})
    configs = list(from_files.values())
    for name in names:
        if name in from_files:
            continue
        if name not in BUNDLED_TASKS:
            raise UsageError(
                f"unknown task {name!r}{did_you_mean(name, known)}; known tasks: "
                f"{', '.join(known)}, or give a task YAML with --task-file"
            )
        configs.append(BUNDLED_TASKS[name](work))
    if not configs:
        raise UsageError(
            "nothing to evaluate: give --tasks NAMES, --task-file TASK.yaml or --eval-data PATH"
        )
    return configs


def load_task_file(path: str) -> dict[str, Any]:
    """An lm-eval task YAML with local data, checked; data_files made absolute."""
    from lm_eval.config.task import TaskConfig
    from lm_eval.tasks._yaml_loader import load_yaml

    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--task-file {path}: no such file")
    try:
        config = load_yaml(file)
    except (yaml.YAMLError, ValueError, ImportError, OSError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(f"--task-file {path} is not a valid task YAML: {first}") from error
    fields = {k for cls in TaskConfig.__mro__ for k in getattr(cls, "__annotations__", {})}
    allowed = fields | EXTRA_TASK_KEYS
    for key in config:
        if key not in allowed:
            hint = did_you_mean(key, sorted(allowed))
            raise UsageError(f"--task-file {path}: unknown key {key!r}{hint}")
    if not isinstance(config.get("task"), str):
        raise UsageError(f"--task-file {path}: `task: NAME` is missing")
    return _local_data(config, file, path)


def _local_data(config: dict[str, Any], file: Path, path: str) -> dict[str, Any]:
    """The config with its data_files resolved against the task file's directory; UsageError
    for data that would be downloaded or files that do not exist."""
    source = config.get("dataset_path")
    if source not in LOCAL_BUILDERS:
        local = source is not None and (file.parent / source).is_dir()
        if not local:
            raise UsageError(
                f"--task-file {path}: dataset_path {source!r} is not local data; use one of "
                f"{', '.join(LOCAL_BUILDERS)} with dataset_kwargs.data_files (nothing downloads)"
            )
        return {**config, "dataset_path": str((file.parent / source).resolve())}
    kwargs = dict(config.get("dataset_kwargs") or {})
    files = kwargs.get("data_files")
    if not files:
        raise UsageError(f"--task-file {path}: dataset_path {source!r} needs data_files")

    def resolved(name: str) -> str:
        target = (file.parent / name).resolve()
        if not target.exists():
            raise UsageError(f"--task-file {path}: data file {name} not found at {target}")
        return str(target)

    if isinstance(files, str):
        files = resolved(files)
    elif isinstance(files, dict):
        files = {
            split: [resolved(f) for f in names] if isinstance(names, list) else resolved(names)
            for split, names in files.items()
        }
    else:
        files = [resolved(f) for f in files]
    return {**config, "dataset_kwargs": {**kwargs, "data_files": files}}
