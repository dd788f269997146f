"""Decontamination: drop documents (or cut the spans) that share word n-grams with evaluation sets.

Normalisation, the same for eval items and documents (`words`): a word is a maximal run of Unicode
word characters (Python's `\\w`: letters, digits, underscore), lowercased; everything else
(punctuation, symbols, whitespace) only separates words. So "Janet’s DUCKS, lay" and "janet's ducks
lay" are both [janet, s, ducks, lay]. Eval text is NFC-normalised first (documents already are).

Each text field of each eval item contributes its word n-grams (`ngram` words, default 13); a text
shorter than `ngram` words contributes its whole text as one shorter n-gram, and documents are then
checked for windows of that length too. No n-gram spans two fields or two items.

An n-gram's 128-bit hash is built from one xxh3-128 per distinct word: sum_j c_j * h(word_j) mod
2**64 per half, with fixed odd constants c_j, so all windows of a batch are hashed with a few numpy
operations. One Bloom filter over all eval sets screens every document window; each window it lets
through is then looked up in each set's sorted array of 128-bit n-gram hashes. So the overlaps are
exact (barring a 128-bit collision) and attributed per eval set; the filter's false-positive rate
costs time, never correctness.

A document is flagged by an eval set when at least `min_matches` of its windows (counted with
repeats) are n-grams of that set. The run is two keel/flow passes over the input: the first finds
the flagged documents (a small table back to the coordinator), the second writes every document,
dropping or cleaning the flagged ones (recomputed from their text). Both ship the index in the map
function's closure.
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from keel.core import paths
from keel.core.errors import UsageError
from keel.data import documents, inputs, ngrams
from keel.data.bloom import BloomFilter
from keel.data.documents import StageReport
from keel.flow import RunOptions, pooled
from keel.flow.readers import parquet_schema
from keel.flow.readers import read_jsonl as read_jsonl_file
from keel.flow.readers import read_parquet as read_parquet_file

CONTAMINATED_FILE = "contaminated.parquet"
REPORT_FILE = "report.json"
MODES = ("drop", "remove_spans")
"""Words hashed at once (about 64 bytes of numpy memory each)."""
_FLAGGED = pa.schema(
    [
        ("id", pa.string()),
        ("eval_sets", pa.list_(pa.string())),
        ("overlaps", pa.list_(pa.int64())),
        ("dropped", pa.bool_()),
    ]
)
_CONTAMINATED = pa.schema([("id", pa.string()), ("eval_set", pa.string()), ("overlap", pa.int64())])

Windows = dict[str, list[tuple[int, int]]]
"""Eval set name -> the (first word, length in words) of each document window found in it."""


@dataclass(frozen=True)
class EvalSet:
    """An evaluation set: a JSONL (plain, .gz, .zst) or Parquet file and its text fields."""

    path: str
    fields: tuple[str, ...] = ("question",)
    """Columns whose text is checked; each is a string or a list of strings (null: skipped)."""
    name: str | None = None
    """Shown in reports and reasons; default the file name without its suffixes."""

    @property
    def label(self) -> str:
        """`name`, or the file name without suffixes: "gsm8k/test.jsonl.gz" -> "test"."""
        if self.name:
            return self.name
        base = self.path.rstrip("/").rsplit("/", 1)[-1]
        return re.sub(r"(\.(gz|zst))?$", "", base).rsplit(".", 1)[0]


@dataclass(frozen=True)
class DecontamConfig:
    """What counts as contamination (module doc) and what happens to a contaminated document."""

    eval_sets: tuple[EvalSet, ...] = ()
    ngram: int = 13
    """Words per n-gram."""
    min_matches: int = 1
    """Matching windows (repeats counted) that flag a document; 1: one shared n-gram flags it."""
    mode: str = "drop"
    """"drop": drop flagged documents; "remove_spans": cut the matching words out, keep the rest
    (a document left without words is dropped)."""
    false_positive_rate: float = 1e-6
    """Of the Bloom filter that screens windows before the exact check (affects speed only)."""


@dataclass(frozen=True)
class EvalIndex:
    """The n-grams of the eval sets, built in the coordinator and shipped to workers."""

    names: tuple[str, ...]
    ngram: int
    lengths: tuple[int, ...]
    """Window lengths to check, ascending: `ngram` and the lengths of shorter eval texts."""
    bloom: BloomFilter
    keys: tuple[np.ndarray, ...]
    """Per eval set: its distinct 128-bit n-gram hashes, uint64 [2, n_ngrams], sorted by the
    first half (row 0), then the second (row 1)."""
    stats: tuple[dict, ...]
    """Per eval set: path, fields, items, texts, short_texts, ngrams."""
    coefficients: np.ndarray
    """The n-gram hash's per-position constants: uint64 [ngram, 2]."""


def build_index(config: DecontamConfig) -> EvalIndex:
    """Read every eval set and hash its n-grams (UsageError for a missing file or field)."""
    _check(config)
    coefficients = ngrams.coefficients(config.ngram)
    keys, stats, all_lengths = [], [], set()
    for eval_set in config.eval_sets:
        texts, items = _read_texts(eval_set)
        tokens = [ngrams.words(unicodedata.normalize("NFC", text)) for text in texts]
        sizes = np.array([len(t) for t in tokens], dtype=np.int64)
        lengths = (*sorted({int(n) for n in sizes if 0 < n < config.ngram}), config.ngram)
        found = [np.zeros((0, 2), np.uint64)]
        for base, block in ngrams.blocks(tokens):
            for length, doc, first, hashed in ngrams.hashed_windows(coefficients, block, lengths):
                if length < config.ngram:  # a short text is one window: all of it
                    hashed = hashed[(first == 0) & (sizes[doc + base] == length)]
                found.append(hashed)
        unique = np.unique(np.concatenate(found), axis=0)
        keys.append(np.ascontiguousarray(unique.T))
        all_lengths.update(min(int(n), config.ngram) for n in sizes if n)
        short = int(np.count_nonzero((sizes > 0) & (sizes < config.ngram)))
        stats.append(
            {
                "path": eval_set.path,
                "fields": list(eval_set.fields),
                "items": items,
                "texts": int(np.count_nonzero(sizes)),
                "short_texts": short,
                "ngrams": len(unique),
            }
        )
    bloom = BloomFilter.for_capacity(sum(k.shape[1] for k in keys), config.false_positive_rate)
    for set_keys in keys:
        bloom.add(set_keys.T)
    names = tuple(eval_set.label for eval_set in config.eval_sets)
    lengths = tuple(sorted(all_lengths)) or (config.ngram,)
    return EvalIndex(names, config.ngram, lengths, bloom, tuple(keys), tuple(stats), coefficients)


def find_windows(index: EvalIndex, texts: Sequence[str]) -> list[Windows]:
    """Per text, the eval sets it shares n-grams with and where: {name: [(first word, length)]},
    names in config order, windows in text order (word indices into `ngrams.words(text)`)."""
    tokens = [ngrams.words(text) for text in texts]
    hits: list[tuple[int, int, int, int]] = []
    for base, block in ngrams.blocks(tokens):
        for length, doc, first, hashed in ngrams.hashed_windows(
            index.coefficients, block, index.lengths
        ):
            maybe = index.bloom.query(hashed)
            doc, first, hashed = doc[maybe] + base, first[maybe], hashed[maybe]
            for number, keys in enumerate(index.keys):
                hit = ngrams.contains(keys, hashed)
                found = np.column_stack([doc[hit], first[hit]]).tolist()
                hits.extend((d, number, f, length) for d, f in found)
    found: list[Windows] = [{} for _ in texts]
    for doc, number, first, length in sorted(hits):
        found[doc].setdefault(index.names[number], []).append((first, length))
    return found


def run_decontam(
    input: str,
    output: str,
    config: DecontamConfig = DecontamConfig(),
    options: RunOptions | None = None,
) -> StageReport:
    """Drop (or clean) the documents of `input` that share n-grams with the eval sets; write the
    rest to `output` with contaminated.parquet, report.json and stage.json, committed together."""
    with documents.stage_output(output, input) as staging, pooled(options) as run_options:
        index = build_index(config)
        detect = functools.partial(_detect_batch, index=index, config=config)
        flagged = inputs.read_documents(input, columns=[documents.ID_COLUMN, documents.TEXT_COLUMN])
        table = flagged.map_batches(detect).to_table(options=run_options)
        if table.num_rows == 0:
            table = _FLAGGED.empty_table()
        candidates = table.column("id").unique()
        apply = functools.partial(_apply_batch, index=index, config=config, ids=candidates)
        written = (
            inputs.read_documents(input)
            .map_batches(apply)
            .write_parquet(staging, options=run_options, commit=False)
        )
        report = StageReport("decontam", written.stages[0].rows_in, written.rows)
        summary = _summarise(table, index, config, report)
        contaminated = pa.Table.from_pylist(summary.pop("_rows"), schema=_CONTAMINATED)
        with paths.open_file(paths.join(staging, CONTAMINATED_FILE), "wb") as handle:
            pq.write_table(contaminated, handle, compression="zstd")
        summary.update(documents_in=report.documents_in, documents_out=report.documents_out)
        paths.write_text(paths.join(staging, REPORT_FILE), json.dumps(summary, indent=2))
        report.details = summary
        report.write(staging)
    return report


# -- the map functions (run in workers) -------------------------------------------------------


def _verdicts(
    index: EvalIndex, config: DecontamConfig, texts: list[str]
) -> list[tuple[dict[str, int], str | None]]:
    """Per text: {eval set: overlap} of the sets that flag it, and (remove_spans mode) its
    cleaned text, None when nothing is left."""
    verdicts = []
    for text, windows in zip(texts, find_windows(index, texts), strict=True):
        flagged = {name: len(w) for name, w in windows.items() if len(w) >= config.min_matches}
        cleaned = None
        if flagged and config.mode == "remove_spans":
            cleaned = ngrams.remove_windows(text, [w for name in flagged for w in windows[name]])
        verdicts.append((flagged, cleaned))
    return verdicts


def _detect_batch(batch: pa.RecordBatch, index: EvalIndex, config: DecontamConfig) -> pa.Table:
    """Documents -> one row per flagged document: id, eval_sets, overlaps, dropped."""
    ids = batch.column(documents.ID_COLUMN).to_pylist()
    texts = batch.column(documents.TEXT_COLUMN).to_pylist()
    rows = [
        {
            "id": ids[row],
            "eval_sets": list(flagged),
            "overlaps": list(flagged.values()),
            "dropped": config.mode == "drop" or cleaned is None,
        }
        for row, (flagged, cleaned) in enumerate(_verdicts(index, config, texts))
        if flagged
    ]
    return pa.Table.from_pylist(rows, schema=_FLAGGED)


def _apply_batch(
    batch: pa.RecordBatch, index: EvalIndex, config: DecontamConfig, ids: pa.Array
) -> pa.RecordBatch:
    """Documents -> the kept ones; flagged ones (found again among the `ids` of pass one) are
    dropped, or cleaned with a new id."""
    candidate = pc.is_in(batch.column(documents.ID_COLUMN), value_set=ids)
    rows = np.flatnonzero(candidate.to_numpy(zero_copy_only=False))
    if not len(rows):
        return batch
    texts = batch.column(documents.TEXT_COLUMN).take(rows).to_pylist()
    keep = np.ones(batch.num_rows, dtype=bool)
    cleaned_rows, cleaned_texts = [], []
    for row, (flagged, cleaned) in zip(rows, _verdicts(index, config, texts), strict=True):
        if not flagged:
            continue
        if cleaned is None:
            keep[row] = False
        else:
            cleaned_rows.append(row)
            cleaned_texts.append(cleaned)
    if cleaned_rows:
        mask = np.zeros(batch.num_rows, dtype=bool)
        mask[cleaned_rows] = True
        columns = {
            documents.TEXT_COLUMN: cleaned_texts,
            documents.ID_COLUMN: [documents.document_id(text) for text in cleaned_texts],
        }
        for name, values in columns.items():
            position = batch.schema.get_field_index(name)
            column = batch.column(position)
            replaced = pc.replace_with_mask(column, mask, pa.array(values, type=column.type))
            batch = batch.set_column(position, batch.schema.field(position), replaced)
    return batch.filter(pa.array(keep))


# -- helpers -------------------------------------------------------------------------------


def _summarise(
    table: pa.Table, index: EvalIndex, config: DecontamConfig, report: StageReport
) -> dict:
    """Count flagged, dropped and cleaned documents per eval set into `report` and a summary;
    a dropped document's reason is its first flagging set in config order."""
    per_set = {
        name: {**stats, "documents_flagged": 0, "documents_dropped": 0, "documents_cleaned": 0}
        for name, stats in zip(index.names, index.stats, strict=True)
    }
    dropped: dict[str, list[str]] = {}
    rows = []
    for flagged in table.to_pylist():
        for name, overlap in zip(flagged["eval_sets"], flagged["overlaps"], strict=True):
            rows.append({"id": flagged["id"], "eval_set": name, "overlap": overlap})
            per_set[name]["documents_flagged"] += 1
            if not flagged["dropped"]:
                per_set[name]["documents_cleaned"] += 1
        if flagged["dropped"]:
            first = flagged["eval_sets"][0]
            per_set[first]["documents_dropped"] += 1
            dropped.setdefault(first, []).append(flagged["id"])
    for name in index.names:
        if name in dropped:
            report.drop(f"contaminated:{name}", dropped[name])
    bloom = index.bloom
    return {
        "mode": config.mode,
        "ngram": config.ngram,
        "min_matches": config.min_matches,
        "window_lengths": list(index.lengths),
        "bloom": {
            "num_bits": bloom.num_bits,
            "num_hashes": bloom.num_hashes,
            "items": bloom.count,
            "expected_false_positive_rate": bloom.expected_false_positive_rate(),
        },
        "eval_sets": per_set,
        "_rows": rows,
    }


def _check(config: DecontamConfig) -> None:
    if not config.eval_sets:
        raise UsageError("decontam needs at least one eval set: DecontamConfig(eval_sets=(...))")
    if config.mode not in MODES:
        raise UsageError(f"decontam mode must be one of {MODES}, got {config.mode!r}")
    if config.ngram < 1 or config.min_matches < 1:
        raise UsageError("decontam ngram and min_matches must be at least 1")
    if not 0.0 < config.false_positive_rate < 1.0:
        raise UsageError("decontam false_positive_rate must be in (0, 1)")
    names = [eval_set.label for eval_set in config.eval_sets]
    if len(set(names)) < len(names):
        raise UsageError(f"decontam eval set names must differ, got {names}: set EvalSet(name=)")
    for eval_set in config.eval_sets:
        if not eval_set.fields or isinstance(eval_set.fields, str):
            raise UsageError(f"EvalSet {eval_set.path}: fields must be a tuple of column names")


def _read_texts(eval_set: EvalSet) -> tuple[list[str], int]:
    """The texts of an eval set's fields, item by item, and the number of items."""
    path = eval_set.path
    if not paths.exists(path):
        raise UsageError(f"eval set file {path} does not exist: check EvalSet(path=...)")
    if path.endswith(".parquet"):
        _require(path, eval_set.fields, parquet_schema(path).names)
        batches = read_parquet_file(path, columns=list(eval_set.fields))
    else:
        batches = read_jsonl_file(path)
    texts: list[str] = []
    items, seen = 0, set()
    for batch in batches:
        seen.update(batch.schema.names)
        present = [f for f in eval_set.fields if f in batch.schema.names]
        columns = [batch.column(f).to_pylist() for f in present]
        for row in range(batch.num_rows):
            for field, column in zip(present, columns, strict=True):
                texts.extend(_texts(column[row], path, field, items + row + 1))
        items += batch.num_rows
    _require(path, eval_set.fields, seen)
    return texts, items


def _require(path: str, fields: Sequence[str], present: Sequence[str] | set[str]) -> None:
    missing = [field for field in fields if field not in present]
    if missing:
        raise UsageError(
            f"eval set file {path} has no field {missing[0]!r}"
            f" (it has: {', '.join(sorted(present)) or 'none found'}): check EvalSet(fields=...)"
        )


def _texts(value: object, path: str, field: str, item: int) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise UsageError(
        f"eval set file {path}, item {item}: field {field!r} is {type(value).__name__}, "
        "expected a string or a list of strings"
    )
