"""A quality classifier trained inside the pipeline, and the stage that scores every document.

The classifier is logistic regression over hashed word 1- and 2-grams: each document is the set of
its n-grams, hashed into `n_features` buckets, L2-normalised (every present bucket 1/sqrt(k)),
and scikit-learn's SGDClassifier (log loss, L2 penalty, fixed seed) learns one weight per bucket.
That is fastText's supervised model without its embedding layer. On 300 WikiText-2 paragraphs
against 300 junk documents (a held-out quarter, tests/data/test_quality.py) it reaches AUC 0.992,
accuracy 0.93; fastText 0.9.3 (wordNgrams=2) 0.999 and 0.97, the gap being documents of shuffled
words. keel does not use fastText: its pip packages (`fasttext` 0.9.3, `fasttext-wheel` 0.9.2)
fail at predict time under numpy 2, and upstream is archived.

    from keel.data.quality import QualityConfig, run_quality, train_quality_classifier

    model = train_quality_classifier("wiki_docs/", "junk_docs/")
    model.save("models/quality_model.npz")
    run_quality("docs/", "scored/", QualityConfig(model_path="models/quality_model.npz"))

run_quality adds attributes and drops nothing: `language`, `language_score` (langid.py), the
heuristic columns (heuristics.py) and `quality_score`, the model's probability that a document
belongs to the positive set, in [0, 1]. filter.py then drops documents by thresholds over them.

Features are computed here with Arrow and numpy, not with scikit-learn, so scoring needs neither
scikit-learn nor scipy (training does) and a model file means the same on every version of them:
lowercase the text; tokens are runs of letters, digits, marks and "_" of 2 or more characters;
a token's hash is xxh3-64 of its UTF-8 bytes, an n-gram's is _mix(previous (n-1)-gram hash, next
token hash); the bucket is the hash modulo n_features.

The model file is an .npz archive (no pickle): `weights` float32 [n_features], `bias` float64 [],
`meta` a JSON string (feature settings, held-out metrics). It is byte-identical for the same data,
config and scikit-learn version.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import logging
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from keel.core import paths
from keel.core.errors import UsageError
from keel.data import documents, inputs
from keel.data.heuristics import heuristic_columns
from keel.data.langid import language_columns
from keel.data.runner import run_stage
from keel.data.stage import MAP, BatchFunction, Mapped, Stage, kept_all
from keel.flow import RunOptions

logger = logging.getLogger(__name__)

STAGE = "quality"
QUALITY_COLUMN = "quality_score"
MODEL_FILE = "quality_model.npz"
"""The conventional name of a model file in a step's output."""
_FORMAT = "keel.quality/1"
_NOT_TOKEN = r"[^\p{L}\p{N}\p{M}_]+"
"""What separates tokens."""


@dataclass(frozen=True)
class QualityTrainConfig:
    """How to train the quality classifier."""

    n_features: int = 2**20
    """Hashed feature dimension (the model file holds this many float32 weights: 4 MiB)."""
    ngram_max: int = 2
    """Word n-grams 1..ngram_max are features."""
    alpha: float = 1e-6
    """L2 regularisation strength of SGDClassifier."""
    epochs: int = 20
    """Passes over the training documents."""
    seed: int = 0
    """Seed of SGD's shuffling: the same data and seed give the same model, byte for byte."""
    holdout_fraction: float = 0.1
    """Fraction of documents held out (chosen by a hash of the text) to measure accuracy and
    AUC; they are not trained on."""
    max_documents: int | None = 100_000
    """Documents read per class: the first ones in input order (None: all)."""

    def __post_init__(self) -> None:
        if self.n_features < 2 or self.ngram_max < 1 or self.epochs < 1 or self.alpha <= 0:
            raise UsageError(
                "QualityTrainConfig: n_features >= 2, ngram_max >= 1, epochs >= 1 and alpha > 0 "
                f"are needed, got {self}"
            )
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise UsageError(
                "QualityTrainConfig.holdout_fraction must be in [0, 1), got "
                f"{self.holdout_fraction}"
            )


@dataclass(frozen=True, eq=False)
class QualityModel:
    """A trained classifier: P(positive | text) = sigmoid(features(text) . weights + bias)."""

    weights: np.ndarray = dataclasses.field(repr=False)
    """float32 [n_features]."""
    bias: float
    ngram_max: int
    metrics: dict
    """What training measured: documents per class and split, holdout accuracy (at 0.5) and
    AUC (None without a holdout of both classes)."""

    def score(self, texts: Sequence[str | None] | pa.Array) -> np.ndarray:
        """P(positive) per text: float64 [len(texts)], in [0, 1]; a null text counts as empty."""
        doc, bucket, value = hashed_features(texts, len(self.weights), self.ngram_max)
        weights = self.weights[bucket].astype(np.float64) * value
        logits = np.bincount(doc, weights=weights, minlength=len(texts)) + self.bias
        return 0.5 * (1.0 + np.tanh(0.5 * logits))

    def save(self, path: str) -> None:
        """Write the model to `path` (an .npz file; local or fsspec URL)."""
        meta = {
            "format": _FORMAT,
            "features": "hashed word n-grams, binary, l2 (keel.data.quality.hashed_features)",
            "n_features": len(self.weights),
            "ngram_max": self.ngram_max,
            "metrics": self.metrics,
        }
        arrays = {
            "weights": self.weights.astype(np.float32),
            "bias": np.float64(self.bias),
            "meta": np.array(json.dumps(meta, sort_keys=True)),
        }
        with paths.open_file(path, "wb") as handle:
            handle.write(_npz_bytes(arrays))

    @classmethod
    def load(cls, path: str) -> QualityModel:
        """Read a model written by `save`."""
        try:
            with paths.open_file(path, "rb") as handle:
                data = handle.read()
        except FileNotFoundError as err:
            raise UsageError(
                f"quality model not found: {path}; train one with train_quality_classifier and "
                "save it there"
            ) from err
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            meta = json.loads(archive["meta"].item()) if "meta" in archive.files else {}
            if meta.get("format") != _FORMAT:
                raise UsageError(
                    f"{path} is not a keel quality model (format {meta.get('format')!r}, "
                    f"expected {_FORMAT!r}); write it with QualityModel.save"
                )
            return cls(
                archive["weights"], float(archive["bias"]), meta["ngram_max"], meta["metrics"]
            )


def fit_quality_model(
    positive: Sequence[str], negative: Sequence[str], config: QualityTrainConfig
) -> QualityModel:
    """Train on two lists of texts, holding out `config.holdout_fraction` of each (by a hash of
    the text) to measure accuracy and AUC."""
    if not positive or not negative:
        raise UsageError(
            f"a quality classifier needs positive and negative documents, got {len(positive)} "
            f"positive and {len(negative)} negative"
        )
    texts = [*positive, *negative]
    labels = np.array([1] * len(positive) + [0] * len(negative))
    held_out = np.array([_unit_hash(text) < config.holdout_fraction for text in texts])
    if held_out.all():
        raise UsageError("every document fell into the holdout: lower holdout_fraction")
    train = np.flatnonzero(~held_out)
    from scipy.sparse import csr_matrix  # training only: scoring needs neither
    from sklearn.linear_model import SGDClassifier

    doc, bucket, value = hashed_features(
        [texts[i] for i in train], config.n_features, config.ngram_max
    )
    features = csr_matrix((value, (doc, bucket)), shape=(len(train), config.n_features))
    classifier = SGDClassifier(
        loss="log_loss",
        alpha=config.alpha,
        max_iter=config.epochs,
        tol=None,
        class_weight="balanced",
        random_state=config.seed,
    )
    classifier.fit(features, labels[train])
    model = QualityModel(
        classifier.coef_[0].astype(np.float32),
        float(classifier.intercept_[0]),
        config.ngram_max,
        {},
    )
    metrics = {
        "positive_documents": len(positive),
        "negative_documents": len(negative),
        "train_documents": len(train),
        **_holdout_metrics(model, texts, labels, held_out),
    }
    return dataclasses.replace(model, metrics=metrics)


def train_quality_classifier(
    positive: str,
    negative: str,
    config: QualityTrainConfig = QualityTrainConfig(),
    options: RunOptions | None = None,
) -> QualityModel:
    """Train from two document sets (directories or globs): up to `config.max_documents` texts
    of each, read with keel/flow."""
    return fit_quality_model(
        _read_texts(positive, config.max_documents, options),
        _read_texts(negative, config.max_documents, options),
        config,
    )


def run_train_quality(
    input: Sequence[str],
    output: str,
    config: QualityTrainConfig = QualityTrainConfig(),
    options: RunOptions | None = None,
) -> documents.StageReport:
    """The training as a stage (for data_step): `input` is (positive, negative) document sets;
    writes `output`/quality_model.npz, then stage.json with the held-out metrics. A later stage
    loads the model with `QualityConfig(model_path=output_of(step, MODEL_FILE))`."""
    if isinstance(input, str) or len(input) != 2:
        raise UsageError(
            f"run_train_quality needs input=(positive, negative) document sets, got {input!r}"
        )
    with documents.stage_output(output, input) as staging:
        model = train_quality_classifier(input[0], input[1], config, options)
        model.save(paths.join(staging, MODEL_FILE))
        read = model.metrics["positive_documents"] + model.metrics["negative_documents"]
        report = documents.StageReport(
            "quality_train",
            documents_in=read,
            documents_out=read,
            details={"model_file": MODEL_FILE, **model.metrics},
        )
        report.write(staging)
    return report


@dataclass(frozen=True)
class QualityConfig:
    """What run_quality adds."""

    model_path: str | None = None
    """A model file written by QualityModel.save; None: no quality_score column, only the
    language and heuristic columns."""


def run_quality(
    input: str,
    output: str,
    config: QualityConfig = QualityConfig(),
    options: RunOptions | None = None,
) -> documents.StageReport:
    """Every document of `input`, with the attribute columns added (replaced if present), to
    `output`; then stage.json. No document is dropped."""
    return run_stage(QUALITY, input, output, config, options)


def quality_batches(config: QualityConfig) -> BatchFunction:
    """The quality stage's batch function, with the model loaded once (keel.data.stage)."""
    model = QualityModel.load(config.model_path) if config.model_path else None
    if model is None:
        logger.warning(
            "quality: no model (--model), so %s is not computed: the documents have no "
            "score (null) for `keel data filter --set min_quality_score=...` or `keel data "
            "stats`; train one with `keel data train-quality`",
            QUALITY_COLUMN,
        )
    return functools.partial(quality_mapped, model=model)


def quality_mapped(batch: pa.RecordBatch, model: QualityModel | None) -> Mapped:
    return kept_all(quality_attributes(batch, model))


def _quality_details(config: QualityConfig) -> dict:
    model = QualityModel.load(config.model_path) if config.model_path else None
    return {"model_path": config.model_path, "model_metrics": model.metrics if model else None}


def _quality_adds(config: QualityConfig) -> tuple[str, ...]:
    """The attribute columns' names, as computing them for one empty text gives them."""
    text = pa.array([""], pa.string())
    columns = (*language_columns(text), *heuristic_columns(text))
    return (*columns, QUALITY_COLUMN) if config.model_path else columns


def quality_attributes(batch: pa.RecordBatch, model: QualityModel | None) -> pa.RecordBatch:
    """A batch of documents with `language`, `language_score`, the heuristic columns and (with a
    model) `quality_score` appended; columns of those names already there are replaced."""
    if documents.TEXT_COLUMN not in batch.schema.names:
        raise UsageError(
            f"documents have no '{documents.TEXT_COLUMN}' column: {batch.schema.names}"
        )
    texts = batch.column(documents.TEXT_COLUMN)
    columns = {**language_columns(texts), **heuristic_columns(texts)}
    if model is not None:
        columns[QUALITY_COLUMN] = pa.array(model.score(texts), pa.float64())
    kept = [name for name in batch.schema.names if name not in columns]
    arrays = [batch.column(name) for name in kept] + list(columns.values())
    return pa.RecordBatch.from_arrays(arrays, names=kept + list(columns))


def _holdout_metrics(
    model: QualityModel, texts: list[str], labels: np.ndarray, held_out: np.ndarray
) -> dict:
    indices = np.flatnonzero(held_out)
    if len(indices) == 0:
        return {"holdout_documents": 0, "holdout_accuracy": None, "holdout_auc": None}
    from sklearn.metrics import roc_auc_score

    scores = model.score([texts[i] for i in indices])
    truth = labels[indices]
    auc = float(roc_auc_score(truth, scores)) if len(set(truth.tolist())) == 2 else None
    return {
        "holdout_documents": len(indices),
        "holdout_accuracy": float(np.mean((scores >= 0.5) == (truth == 1))),
        "holdout_auc": auc,
    }


def _read_texts(input: str, limit: int | None, options: RunOptions | None) -> list[str]:
    texts = inputs.read_documents(input, columns=[documents.TEXT_COLUMN])
    table = texts.to_table(options) if limit is None else texts.to_table(options, limit=limit)
    return [text or "" for text in table.column(documents.TEXT_COLUMN).to_pylist()]


def hashed_features(
    texts: Sequence[str | None] | pa.Array, n_features: int, ngram_max: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The feature matrix of a batch, as coordinates: (document, bucket, value) per distinct
    bucket of each document, sorted by document then bucket; value = 1/sqrt(distinct buckets of
    the document). Int64, int64, float64 arrays of equal length."""
    texts = texts if isinstance(texts, pa.Array) else pa.array(texts, pa.large_string())
    split = pc.split_pattern_regex(pc.utf8_lower(pc.fill_null(texts, "")), _NOT_TOKEN)
    tokens = pc.list_flatten(split)
    keep = _numpy(pc.greater_equal(pc.utf8_length(tokens), 2))
    token_doc = _numpy(pc.list_parent_indices(split))[keep]
    encoded = pc.dictionary_encode(tokens.filter(pa.array(keep)))
    unique_hashes = [
        xxhash.xxh3_64_intdigest(token.encode()) for token in encoded.dictionary.to_pylist()
    ]
    token_hash = np.array(unique_hashes, dtype=np.uint64)[_numpy(encoded.indices)]
    hashes, docs, ngram = [token_hash], [token_doc], token_hash
    for n in range(2, ngram_max + 1):
        ngram = _mix(ngram[:-1], token_hash[n - 1 :])
        within = token_doc[: len(ngram)] == token_doc[n - 1 :]
        hashes.append(ngram[within])
        docs.append(token_doc[: len(ngram)][within])
    keys = np.unique(
        np.concatenate(docs) * n_features
        + (np.concatenate(hashes) % np.uint64(n_features)).astype(np.int64)
    )
    doc, bucket = keys // n_features, keys % n_features
    per_doc = np.bincount(doc, minlength=len(texts))
    return doc, bucket, 1.0 / np.sqrt(per_doc[doc])


def _mix(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """A 64-bit hash of two 64-bit hashes (splitmix64's finaliser over left * phi ^ right)."""
    with np.errstate(over="ignore"):
        x = (left * np.uint64(0x9E3779B97F4A7C15)) ^ right
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _numpy(array: pa.Array) -> np.ndarray:
    return array.to_numpy(zero_copy_only=False)


def _unit_hash(text: str) -> float:
    """A number in [0, 1) that depends only on the text."""
    return xxhash.xxh3_64_intdigest(text.encode("utf-8")) / 2**64


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An .npz archive (np.load reads it) with fixed timestamps, so equal arrays give equal bytes
    (np.savez stamps the current time)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, array in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            with archive.open(info, "w") as member:
                np.lib.format.write_array(member, np.asarray(array), allow_pickle=False)
    return buffer.getvalue()


QUALITY = Stage(
    STAGE,
    QualityConfig,
    MAP,
    batches=quality_batches,
    help="Add attribute columns: language, heuristics (Gopher), quality_score (with a model).",
    adds=_quality_adds,
    details=_quality_details,
)
