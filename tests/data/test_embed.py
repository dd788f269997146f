"""The embed stage on real text: Wikipedia paragraphs (the bundled WikiText-2 sample) and GSM8K
math questions, two domains that k-means should keep apart."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import keel
from keel.core.errors import UsageError
from keel.data.documents import StageReport, document_id, normalize_text
from keel.data.embed import MODEL_FILE, EmbedConfig, embed_texts, load_model, run_embed
from keel.flow import LocalBackend, RunOptions

WIKITEXT = Path(keel.__file__).parent / "experiments" / "sample" / "wikitext2.jsonl.gz"
SHARED = Path(__file__).resolve().parents[3] / "shared"  # beside the repository, as CI lays it
GSM8K = (SHARED if SHARED.exists() else Path("/work/shared")) / "datasets/gsm8k/test.jsonl"
CONFIG = EmbedConfig()


def wiki_paragraphs() -> list[str]:
    paragraphs = []
    with gzip.open(WIKITEXT, "rt", encoding="utf-8") as lines:
        for line in lines:
            text = json.loads(line)["text"]
            paragraphs += [p for p in text.split("\n") if len(p) > 100 and not p.startswith("=")]
    return paragraphs


def math_questions() -> list[str]:
    with open(GSM8K, encoding="utf-8") as lines:
        return [json.loads(line)["question"] for line in lines]


def write_documents(directory: Path, texts_by_source: dict[str, list[str]], files: int) -> None:
    """A document set: `files` part files, the sources interleaved so every file has both."""
    rows = [
        {"id": document_id(normalize_text(t)), "text": normalize_text(t), "source": source}
        for source, texts in texts_by_source.items()
        for t in texts
    ]
    rows = rows[0::2] + rows[1::2]
    directory.mkdir(parents=True)
    size = -(-len(rows) // files)
    for number in range(files):
        part = pa.Table.from_pylist(rows[number * size : (number + 1) * size])
        pq.write_table(part, directory / f"part-{number:05d}-of-{files:05d}.parquet")


def read_documents(directory: Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in sorted(directory.glob("part-*.parquet")))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("embed") / "docs"
    write_documents(directory, {"wikitext": wiki_paragraphs(), "gsm8k": math_questions()}, 3)
    return directory


@pytest.fixture(scope="module")
def embedded(corpus: Path) -> dict[int, Path]:
    """The corpus embedded with 1 and with 2 workers."""
    outputs = {}
    for workers in (1, 2):
        outputs[workers] = corpus.parent / f"embedded-{workers}"
        run_embed(str(corpus), str(outputs[workers]), CONFIG, options=_options(workers))
    return outputs


@pytest.fixture(scope="module")
def one_worker():
    """Run options with one local worker kept across runs (saves starting a process per run)."""
    with LocalBackend(workers=1) as pool:
        yield RunOptions(backend=pool, progress=False)


def _options(workers: int) -> RunOptions:
    return RunOptions(workers=workers, progress=False)


def test_every_document_gets_an_embedding_and_a_cluster(corpus: Path, embedded) -> None:
    before, after = read_documents(corpus), read_documents(embedded[2])
    assert sorted(after.column("id").to_pylist()) == sorted(before.column("id").to_pylist())
    assert after.schema.field("embedding").type == pa.list_(pa.float32(), CONFIG.dimension)
    assert after.schema.field("cluster").type == pa.int32()
    vectors = np.stack(after.column("embedding").to_numpy(zero_copy_only=False))
    assert vectors.shape == (before.num_rows, CONFIG.dimension)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    clusters = after.column("cluster").to_numpy()
    assert clusters.min() >= 0 and clusters.max() < CONFIG.clusters
    report = StageReport.read(str(embedded[2]))
    assert report.documents_in == report.documents_out == before.num_rows
    assert report.dropped == {}
    assert sum(report.details["cluster_sizes"]) == before.num_rows
    assert (embedded[2] / MODEL_FILE).exists()


def test_output_is_byte_identical_for_one_and_two_workers(embedded) -> None:
    names = sorted(p.name for p in embedded[1].iterdir())
    assert names == sorted(p.name for p in embedded[2].iterdir())
    assert MODEL_FILE in names and "stage.json" in names
    for name in names:
        assert (embedded[1] / name).read_bytes() == (embedded[2] / name).read_bytes(), name


def test_the_two_domains_land_in_different_clusters(embedded) -> None:
    table = read_documents(embedded[1])
    clusters = table.column("cluster").to_numpy()
    is_math = np.array([s == "gsm8k" for s in table.column("source").to_pylist()])
    majority = sum(
        max(np.sum(is_math[clusters == c]), np.sum(~is_math[clusters == c]))
        for c in range(CONFIG.clusters)
    )
    purity = majority / len(clusters)
    print(f"cluster purity, wikitext vs gsm8k: {purity:.3f}")
    assert purity > 0.9, f"cluster purity {purity:.3f} over wikitext vs gsm8k"


def test_near_identical_texts_are_close_and_unrelated_ones_far(embedded) -> None:
    model = load_model(str(embedded[1] / MODEL_FILE), CONFIG)
    wiki, math = wiki_paragraphs()[:200], math_questions()[:200]
    originals = wiki + math
    edited = [_change_one_word(text) for text in originals]

    def embed(texts: list[str]) -> np.ndarray:
        return embed_texts(pa.array(texts), model.config, model.idf)

    near = np.sum(embed(originals) * embed(edited), axis=1)
    assert near.min() > 0.9, f"one word changed: cosine {near.min():.3f}"
    across = embed(wiki) @ embed(math).T
    assert across.mean() < 0.2 and np.quantile(across, 0.99) < 0.6, (
        f"wikitext vs gsm8k: mean cosine {across.mean():.3f}, p99 {np.quantile(across, 0.99):.3f}"
    )


def _change_one_word(text: str) -> str:
    words = text.split(" ")
    words[len(words) // 2] = "zebra"
    return " ".join(words)


def test_a_saved_model_assigns_the_same_clusters(tmp_path: Path, embedded, one_worker) -> None:
    first = read_documents(embedded[1])
    subset = tmp_path / "subset"
    write_documents(subset, {"mixed": first.column("text").to_pylist()[::7]}, 1)
    output = tmp_path / "reused"
    reuse = EmbedConfig(model_path=str(embedded[1] / MODEL_FILE))
    report = run_embed(str(subset), str(output), reuse, options=one_worker)
    again = read_documents(output)
    expected = dict(
        zip(first.column("id").to_pylist(), first.column("cluster").to_pylist(), strict=True)
    )
    assert [expected[i] for i in again.column("id").to_pylist()] == again.column(
        "cluster"
    ).to_pylist()
    assert (output / MODEL_FILE).read_bytes() == (embedded[1] / MODEL_FILE).read_bytes()
    assert report.details["model_from"] == reuse.model_path


def test_a_model_fitted_with_other_settings_is_refused(embedded) -> None:
    with pytest.raises(UsageError, match="dimension=128"):
        load_model(str(embedded[1] / MODEL_FILE), EmbedConfig(dimension=64))


def test_bad_settings_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="clusters"):
        EmbedConfig(clusters=0)
    with pytest.raises(UsageError, match="char_ngrams"):
        EmbedConfig(char_ngrams=(5, 3))


def test_the_model_is_fitted_on_a_sample_that_does_not_depend_on_the_files(
    tmp_path: Path, corpus: Path, one_worker
) -> None:
    one_file = tmp_path / "one-file"
    write_documents(one_file, {"all": read_documents(corpus).column("text").to_pylist()}, 1)
    config = EmbedConfig(sample_size=500)
    models = []
    for name, documents in (("three", corpus), ("one", one_file)):
        report = run_embed(str(documents), str(tmp_path / name), config, options=one_worker)
        assert report.details["sample_documents"] == 500
        models.append((tmp_path / name / MODEL_FILE).read_bytes())
    assert models[0] == models[1]
