"""Document embeddings and k-means clusters: adds `embedding` and `cluster` to every document.

Features of a text: its lowercased words (runs of Unicode letters, digits and marks), word n-grams
up to `word_ngrams`, and optionally the character n-grams of each word ("<word>", fastText style),
each hashed (xxh3-64) into 2**feature_bits buckets and weighted (1 + ln count) * IDF**idf_power,
damped by df / (min_df * n) for features rarer than `min_df`. A sparse random projection with a
fixed seed (`projection_nonzeros` entries of random sign per bucket, the sparse
Johnson-Lindenstrauss transform) maps them to `dimension` floats, then L2-normalised.

The IDF and the k-means centroids are fitted in the coordinator on a deterministic sample: the
`sample_size` documents whose xxh3-64 of the id is smallest (uniform, independent of file order
and workers). They are saved as `embed_model.parquet` in the output; `model_path` reuses one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from keel.core import paths
from keel.core.errors import UsageError
from keel.data.documents import ID_COLUMN, TEXT_COLUMN, StageReport, parquet_glob, stage_output
from keel.data.inputs import read_documents
from keel.data.kmeans import fit_kmeans, nearest
from keel.flow import Dataset, RunOptions, pooled, read_parquet

logger = logging.getLogger(__name__)

EMBEDDING_COLUMN = "embedding"
CLUSTER_COLUMN = "cluster"
MODEL_FILE = "embed_model.parquet"
MODEL_FIELDS = (
    *("dimension", "clusters", "word_ngrams", "char_ngrams", "feature_bits"),
    *("projection_nonzeros", "seed"),
)
"""The EmbedConfig fields a saved model fixes: a run reusing it must agree on them."""
SLICE_BYTES = 1 << 20
"""Text bytes featurised at once inside a chunk: bounds the feature arrays to tens of MB."""
OVERSAMPLE = 1.25
"""Drawn beyond sample_size before cutting to it, so that chance rarely leaves it short."""
_POSITIVE_FIELDS = (
    *("dimension", "clusters", "word_ngrams", "projection_nonzeros", "sample_size"),
    *("kmeans_iterations", "kmeans_restarts"),
)
_WORD_PATTERN = r"[^\pL\pN\pM]+"
_CHAR_SEED = 0x5EED
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class EmbedConfig:
    """How documents are embedded and clustered."""

    dimension: int = 128
    """Floats per embedding (4 bytes each)."""
    clusters: int = 16
    """k of k-means: the `cluster` column is in [0, clusters)."""
    word_ngrams: int = 1
    """Word n-grams of length 1..word_ngrams are features."""
    char_ngrams: tuple[int, int] | None = None
    """(shortest, longest) character n-grams of each word as extra features; None: words only."""
    feature_bits: int = 20
    """Features are hashed into 2**feature_bits buckets (the IDF holds one float32 per bucket)."""
    projection_nonzeros: int = 8
    """Embedding coordinates each hashed feature adds to (sparse random projection density)."""
    idf_power: float = 0.5
    """Exponent of the IDF: 1 is classic tf-idf; below 1 damps rare features, which a projection
    to few dimensions turns into noise that hides the topic."""
    min_df: float = 0.01
    """Features in a fraction df / n < min_df of the sample's documents weigh df / (min_df * n)
    as much (unseen ones count df = 1): near zero, yet a text of rare words only still gets one."""
    sample_size: int = 20_000
    """Documents the IDF and the k-means centroids are fitted on."""
    kmeans_iterations: int = 100
    """Most Lloyd iterations per k-means run; it stops earlier once fewer than 1% of the sample
    change cluster."""
    kmeans_restarts: int = 3
    """k-means++ initialisations tried; the run with the lowest inertia is kept."""
    seed: int = 0
    """Seeds the projection and k-means."""
    model_path: str | None = None
    """An embed_model.parquet of an earlier run: use its IDF and centroids instead of fitting."""

    def __post_init__(self) -> None:
        for name in _POSITIVE_FIELDS:
            if getattr(self, name) < 1:
                raise UsageError(
                    f"EmbedConfig.{name} must be at least 1, got {getattr(self, name)}"
                )
        for name, low, high in (("feature_bits", 8, 28), ("idf_power", 0, 2), ("min_df", 0, 0.5)):
            if not low <= getattr(self, name) <= high:
                raise UsageError(
                    f"EmbedConfig.{name} must be in [{low}, {high}], got {getattr(self, name)}"
                )
        ngrams = self.char_ngrams
        if ngrams is not None and not (len(ngrams) == 2 and 1 <= ngrams[0] <= ngrams[1]):
            raise UsageError(
                f"EmbedConfig.char_ngrams must be (low, high) with 1 <= low <= high, got {ngrams}"
            )


@dataclass(frozen=True, eq=False)
class EmbedModel:
    """Everything that assigns embeddings and clusters: the settings, IDF and centroids."""

    config: EmbedConfig
    idf: np.ndarray
    """[2**feature_bits] float32."""
    centroids: np.ndarray
    """[clusters, dimension] float32."""
    sample_documents: int
    """Documents the IDF and centroids were fitted on."""


# -- features -------------------------------------------------------------------------------------
def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 (wrapping arithmetic): a bijective bit mixer."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _char_ngram_hashes(word: str, low: int, high: int) -> list[int]:
    marked = f"<{word}>"
    return [
        xxhash.xxh3_64_intdigest(marked[i : i + n].encode(), seed=_CHAR_SEED)
        for n in range(low, high + 1)
        for i in range(len(marked) - n + 1)
    ]


def feature_hashes(texts: pa.Array, config: EmbedConfig) -> tuple[np.ndarray, np.ndarray]:
    """Every feature occurrence of `texts` ([n] strings): (document index, 64-bit hash), each
    [occurrences] (int64, uint64). Tokens are hashed once per distinct token in the batch."""
    split = pc.split_pattern_regex(pc.utf8_lower(texts.fill_null("")), _WORD_PATTERN)
    tokens, docs = pc.list_flatten(split), pc.list_parent_indices(split).to_numpy()
    nonempty = pc.greater(pc.binary_length(tokens), 0)
    tokens, docs = tokens.filter(nonempty), docs[nonempty.to_numpy(zero_copy_only=False)]
    encoded = pc.dictionary_encode(tokens)
    vocabulary = encoded.dictionary.to_pylist()
    which = encoded.indices.to_numpy().astype(np.int64)
    words = np.array([xxhash.xxh3_64_intdigest(w.encode()) for w in vocabulary], np.uint64)[which]
    all_docs, all_hashes, gram = [docs], [words], words
    for n in range(2, config.word_ngrams + 1):  # n-gram hash: mix(hash of first n-1, next word)
        gram = _mix(gram[:-1] * _GOLDEN + words[n - 1 :] + np.uint64(n))
        same = docs[: len(gram)] == docs[n - 1 :]
        all_docs.append(docs[: len(gram)][same])
        all_hashes.append(gram[same])
    if config.char_ngrams is not None:
        per_word = [_char_ngram_hashes(w, *config.char_ngrams) for w in vocabulary]
        counts = np.array([len(h) for h in per_word], dtype=np.int64)
        flat = np.array([h for hashes in per_word for h in hashes], dtype=np.uint64)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        lengths = counts[which]
        before = np.cumsum(lengths) - lengths
        index = np.repeat(starts[which] - before, lengths) + np.arange(lengths.sum())
        all_docs.append(np.repeat(docs, lengths))
        all_hashes.append(flat[index])
    return np.concatenate(all_docs).astype(np.int64), np.concatenate(all_hashes)


def term_counts(texts: pa.Array, config: EmbedConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document index, bucket, count) of every distinct (document, bucket) pair, sorted by
    document then bucket: a sparse [n, 2**feature_bits] count matrix."""
    docs, hashes = feature_hashes(texts, config)
    buckets = (hashes & np.uint64((1 << config.feature_bits) - 1)).astype(np.int64)
    keys, counts = np.unique((docs << config.feature_bits) | buckets, return_counts=True)
    return keys >> config.feature_bits, keys & ((1 << config.feature_bits) - 1), counts


def fit_idf(texts: pa.Array, config: EmbedConfig) -> np.ndarray:
    """The weight of each bucket from `texts` ([n] strings): the smoothed IDF
    ln((1 + n) / (1 + df)) + 1 to the power idf_power, times min(1, max(df, 1) / (min_df * n)):
    [2**feature_bits] float32."""
    df = np.zeros(1 << config.feature_bits, dtype=np.int64)
    for start, stop in _slices(texts):
        _, buckets, _ = term_counts(texts.slice(start, stop - start), config)
        df += np.bincount(buckets, minlength=df.size)
    idf = (np.log((1 + len(texts)) / (1 + df)) + 1) ** config.idf_power
    rare = np.minimum(1.0, np.maximum(df, 1) / max(1.0, config.min_df * len(texts)))
    return (idf * rare).astype(np.float32)


def embed_texts(texts: pa.Array, config: EmbedConfig, idf: np.ndarray) -> np.ndarray:
    """Embeddings of `texts` ([n] strings): [n, dimension] float32, unit L2 norm (all zeros for a
    text without weighted features). Each row depends on its own text only, not on the batch."""
    parts = [_embed_slice(texts.slice(a, b - a), config, idf) for a, b in _slices(texts)]
    return np.concatenate(parts) if parts else np.zeros((0, config.dimension), np.float32)


def _embed_slice(texts: pa.Array, config: EmbedConfig, idf: np.ndarray) -> np.ndarray:
    docs, buckets, counts = term_counts(texts, config)
    weights = (1.0 + np.log(counts)) * idf[buckets].astype(np.float64)
    s, dim = config.projection_nonzeros, config.dimension
    seed = _mix(np.array([config.seed + 1], dtype=np.uint64))
    z = _mix(
        (buckets[:, None].astype(np.uint64) * np.uint64(s) + np.arange(s, dtype=np.uint64)) ^ seed
    )
    columns = (z % np.uint64(dim)).astype(np.int64)
    signed = np.where(z >> np.uint64(63), -weights[:, None], weights[:, None])
    flat = np.bincount((docs[:, None] * dim + columns).ravel(), signed.ravel(), len(texts) * dim)
    dense = flat.reshape(len(texts), dim)
    norms = np.linalg.norm(dense, axis=1, keepdims=True)
    return (dense / np.where(norms > 0, norms, 1.0)).astype(np.float32)


def _slices(texts: pa.Array) -> Iterator[tuple[int, int]]:
    """[start, stop) ranges of `texts` of about SLICE_BYTES of text each (at least one text)."""
    ends = np.cumsum(pc.binary_length(texts).fill_null(0).to_numpy(zero_copy_only=False))
    start = 0
    while start < len(texts):
        base = ends[start - 1] if start else 0
        stop = max(int(np.searchsorted(ends, base + SLICE_BYTES, side="right")), start + 1)
        yield start, stop
        start = stop


# -- k-means ------------------------------------------------------------------------------------
def save_model(model: EmbedModel, path: str) -> None:
    """Write the model as a one-row Parquet file (settings JSON, IDF, centroids): byte-identical
    for the same model."""
    settings = {name: getattr(model.config, name) for name in MODEL_FIELDS}
    settings["sample_documents"] = model.sample_documents
    dim = model.config.dimension
    table = pa.table(
        {
            "settings": [json.dumps(settings, sort_keys=True)],
            "idf": pa.array([model.idf], pa.list_(pa.float32())),
            "centroids": pa.array(
                [model.centroids.tolist()], pa.list_(pa.list_(pa.float32(), dim))
            ),
        }
    )
    with paths.open_file(path, "wb") as handle:
        pq.write_table(table, handle, compression="zstd")


def load_model(path: str, config: EmbedConfig = EmbedConfig()) -> EmbedModel:
    """Read a saved model; UsageError when `config` disagrees with it on a MODEL_FIELDS setting."""
    if not paths.exists(path):
        raise UsageError(f"embed: model {path} does not exist: give an earlier run's {MODEL_FILE}")
    with paths.open_file(path, "rb") as handle:
        row = pq.read_table(handle).to_pylist()[0]
    settings = json.loads(row["settings"])
    if settings["char_ngrams"] is not None:
        settings["char_ngrams"] = tuple(settings["char_ngrams"])
    differing = [n for n in MODEL_FIELDS if getattr(config, n) != settings[n]]
    if differing:
        name = differing[0]
        raise UsageError(
            f"embed: model {path} was fitted with {name}={settings[name]!r} but the config says"
            f" {getattr(config, name)!r}: use the model's settings or fit a new model"
        )
    return EmbedModel(
        config,
        np.array(row["idf"], dtype=np.float32),
        np.array(row["centroids"], dtype=np.float32).reshape(config.clusters, config.dimension),
        settings["sample_documents"],
    )


# -- the stage ------------------------------------------------------------------------------------
def embed_batch(batch: pa.RecordBatch, model: EmbedModel) -> pa.Table:
    """A chunk of documents with `embedding` (fixed-size list of float32) and `cluster` (int32)
    columns added (replacing earlier ones)."""
    table = pa.Table.from_batches([batch])
    texts = table.column(TEXT_COLUMN).combine_chunks()
    vectors = embed_texts(texts, model.config, model.idf)
    labels, _ = nearest(vectors, model.centroids)
    table = table.drop_columns(
        [c for c in (EMBEDDING_COLUMN, CLUSTER_COLUMN) if c in table.column_names]
    )
    flat = pa.array(vectors.ravel(), pa.float32())
    table = table.append_column(
        EMBEDDING_COLUMN, pa.FixedSizeListArray.from_arrays(flat, model.config.dimension)
    )
    return table.append_column(CLUSTER_COLUMN, pa.array(labels, pa.int32()))


def _below(batch: pa.RecordBatch, threshold: int) -> pa.Table:
    """The documents of a chunk whose sampling key, xxh3-64 of the id, is at most `threshold`."""
    ids = batch.column(ID_COLUMN).to_pylist()
    keys = np.array([xxhash.xxh3_64_intdigest(i.encode()) for i in ids], dtype=np.uint64)
    table = pa.Table.from_batches([batch]).select([ID_COLUMN, TEXT_COLUMN])
    table = table.append_column("key", pa.array(keys, pa.uint64()))
    return table.filter(pa.array(keys <= np.uint64(threshold)))


def fit_model(
    documents: Dataset, count: int, config: EmbedConfig, options: RunOptions
) -> EmbedModel:
    """Fit the IDF and centroids on the `sample_size` documents (of `count`) with the smallest
    xxh3-64 of the id: a uniform sample that does not depend on files, chunks or workers."""
    rate = min(1.0, OVERSAMPLE * config.sample_size / max(count, 1))
    threshold = min(int(rate * 2.0**64), (1 << 64) - 1)
    sample = documents.map_batches(lambda b: _below(b, threshold)).to_table(options)
    sample = sample.sort_by([("key", "ascending"), (ID_COLUMN, "ascending")])
    texts = sample.column(TEXT_COLUMN).combine_chunks().slice(0, config.sample_size)
    idf = fit_idf(texts, config)
    vectors = embed_texts(texts, config, idf)
    centroids, inertia = fit_kmeans(
        vectors, config.clusters, config.seed, config.kmeans_iterations, config.kmeans_restarts
    )
    logger.info("embed: fitted on %d documents, k-means inertia %.4f", len(texts), inertia)
    return EmbedModel(config, idf, centroids, len(texts))


def run_embed(
    input: str, output: str, config: EmbedConfig = EmbedConfig(), options: RunOptions | None = None
) -> StageReport:
    """Add `embedding` and `cluster` to every document of `input` (a document-set directory or
    glob) and write them to `output`, with the model (embed_model.parquet) and stage.json,
    committed together."""
    with stage_output(output, input) as staging, pooled(options) as options:  # one pool
        documents = read_documents(input)
        if config.model_path is not None:
            model = load_model(config.model_path, config)
        else:
            count = read_documents(input, columns=[ID_COLUMN]).count(options=options)
            model = fit_model(documents, count, config, options)
        result = documents.map_batches(lambda b: embed_batch(b, model)).write_parquet(
            staging, options=options, commit=False
        )
        save_model(model, paths.join(staging, MODEL_FILE))
        sizes = np.zeros(config.clusters, dtype=np.int64)
        if result.rows:
            written = read_parquet(parquet_glob(staging), columns=[CLUSTER_COLUMN])
            clusters = written.to_table(options)
            sizes += np.bincount(clusters.column(CLUSTER_COLUMN).to_numpy(), minlength=sizes.size)
        report = _report(result, model, sizes, config)
        report.write(staging)
    return report


def _report(result, model: EmbedModel, sizes: np.ndarray, config: EmbedConfig) -> StageReport:
    """The stage.json of an embed run: counts, the model and the cluster sizes (documents)."""
    return StageReport(
        "embed",
        documents_in=result.stages[0].rows_in,
        documents_out=result.rows,
        details={
            "dimension": config.dimension,
            "clusters": config.clusters,
            "model": MODEL_FILE,
            "model_from": config.model_path,
            "sample_documents": model.sample_documents,
            "cluster_sizes": sizes.tolist(),
        },
    )
