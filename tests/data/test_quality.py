"""Language id, Gopher heuristics, the in-pipeline quality classifier and threshold filters, on real
text: WikiText-2 paragraphs (the bundled sample) as good text, and junk made from them and from the
Python documentation's navigation lines."""

import gzip
import html
import itertools
import json
import random
import re
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keel.core.errors import UsageError
from keel.data.documents import StageReport, write_texts
from keel.data.filter import FilterConfig, first_failed_rule, rules, run_filter
from keel.data.heuristics import COLUMNS, heuristic_columns, heuristics
from keel.data.langid import identify_language, language_columns
from keel.data.quality import (
    MODEL_FILE,
    QualityConfig,
    QualityModel,
    QualityTrainConfig,
    fit_quality_model,
    run_quality,
    run_train_quality,
)
from keel.flow import LocalBackend, RunOptions

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "keel" / "experiments" / "sample" / "wikitext2.jsonl.gz"
PYDOCS = ROOT.parent / "shared" / "datasets" / "pydocs" / "pages.jsonl.gz"
TRAIN = QualityTrainConfig(holdout_fraction=0.25)


def paragraphs() -> list[str]:
    """WikiText-2 paragraphs of at least 50 words (headings are lines starting with '=')."""
    with gzip.open(SAMPLE, "rt", encoding="utf-8") as lines:
        texts = [json.loads(line)["text"] for line in lines]
    return [
        p for t in texts for p in t.split("\n") if not p.startswith("=") and len(p.split()) >= 50
    ]


def navigation_lines(pages: int = 40) -> list[str]:
    """Short lines (6 words or fewer) of Python documentation pages with the tags stripped:
    menus, breadcrumbs, tables of contents, footers."""
    found = []
    with gzip.open(PYDOCS, "rt", encoding="utf-8") as lines:
        for line in itertools.islice(lines, pages):
            page = re.sub(r"(?s)<(script|style)\b.*?</\1>", "", json.loads(line)["html"])
            for text in html.unescape(re.sub(r"<[^>]+>", "\n", page)).split("\n"):
                text = " ".join(text.split())
                if text and len(text.split()) <= 6:
                    found.append(text)
    return found


@pytest.fixture(scope="module")
def corpus() -> tuple[list[str], list[str]]:
    """300 good paragraphs; 300 junk documents: 100 with shuffled words (other paragraphs), 100 of
    40 navigation lines, 100 of five navigation lines repeated eight times."""
    texts = paragraphs()
    positive = texts[0::2][:300]
    rng = random.Random(0)
    shuffled = []
    for text in texts[1::2][:100]:
        words = text.split()
        rng.shuffle(words)
        shuffled.append(" ".join(words))
    navigation = navigation_lines()
    boilerplate = ["\n".join(navigation[i * 40 : (i + 1) * 40]) for i in range(100)]
    repeated = ["\n".join(navigation[5000 + i * 5 : 5005 + i * 5] * 8) for i in range(100)]
    return positive, shuffled + boilerplate + repeated


@pytest.fixture(scope="module")
def pool():
    """Two worker processes, reused by every run of this module but the one-worker run."""
    with LocalBackend(workers=2) as backend:
        yield RunOptions(backend=backend)


@pytest.fixture(scope="module")
def trained(corpus, pool, tmp_path_factory) -> tuple[StageReport, str]:
    """run_train_quality's report and model file, trained from two document sets."""
    root = tmp_path_factory.mktemp("quality")
    positive, negative = corpus
    sets = (
        write_texts(root / "positive", positive, 1, "test"),
        write_texts(root / "negative", negative, 1, "test"),
    )
    report = run_train_quality(sets, str(root / "model"), TRAIN, pool)
    return report, str(root / "model" / MODEL_FILE)


def test_classifier_separates_held_out_documents(trained):
    metrics = trained[0].details
    message = (
        f"held-out accuracy {metrics['holdout_accuracy']:.3f}, AUC {metrics['holdout_auc']:.4f}"
    )
    assert metrics["holdout_documents"] > 100, message
    assert metrics["holdout_accuracy"] >= 0.9, message
    assert metrics["holdout_auc"] >= 0.98, message
    print(message, metrics)


def test_training_is_deterministic_and_the_model_file_round_trips(corpus, trained, tmp_path):
    model = fit_quality_model(*corpus, TRAIN)  # the same texts, in memory
    loaded = QualityModel.load(trained[1])
    texts = corpus[0][:5] + corpus[1][::60]
    assert loaded.score(texts).tolist() == model.score(texts).tolist()
    assert (
        loaded.metrics
        == model.metrics
        == {key: value for key, value in trained[0].details.items() if key != "model_file"}
    )
    model.save(str(tmp_path / MODEL_FILE))
    assert (tmp_path / MODEL_FILE).read_bytes() == Path(trained[1]).read_bytes()
    with pytest.raises(UsageError, match="quality model not found"):
        QualityModel.load(str(tmp_path / "missing.npz"))


def test_langid_says_english_for_wikitext_and_names_other_languages(corpus):
    for text in corpus[0][:20]:
        language, score = identify_language(text)
        assert language == "en" and 0.9 < score <= 1.0, (language, score, text[:80])
    others = {
        "de": "Der Hund lief gestern Abend durch den Park und bellte laut, weil er Hunger hatte.",
        "fr": "Le chien a couru dans le parc hier soir et il aboyait fort parce qu'il avait faim.",
        "es": "El perro corrió por el parque anoche y ladraba fuerte porque tenía mucha hambre.",
        "ru": "Собака бегала по парку вчера вечером и громко лаяла, потому что была голодна.",
        "ja": "犬は昨日の夜、公園を走り回り、お腹が空いていたので大きな声で吠えた。",
    }
    columns = language_columns(pa.array([*others.values(), "   ", None]))
    assert columns["language"].to_pylist() == [*others, "und", "und"]
    scores = columns["language_score"].to_pylist()
    assert all(0.5 < score <= 1.0 for score in scores[:5]) and scores[5:] == [0.0, 0.0]


def test_heuristics_of_hand_made_documents():
    prose = heuristics("The cat sat on the mat, and (the) dog slept.")
    assert prose["word_count"] == 10  # punctuation stripped from word ends, "(the)" -> "the"
    assert prose["mean_word_length"] == pytest.approx(31 / 10)
    assert prose["stop_word_count"] == 2  # "the" and "and", however often
    assert prose["alpha_word_fraction"] == 1.0
    assert prose["top_2gram_char_fraction"] == 0.0  # no 2-gram occurs twice

    symbols = heuristics("# Title ...\n- one item\n* two item…\n\n- three 1990 @-@ !")
    assert symbols["word_count"] == 7  # "#", "...", "-", "*", "@-@", "!" are not words
    assert symbols["hash_to_word_ratio"] == pytest.approx(1 / 7)
    assert symbols["ellipsis_to_word_ratio"] == pytest.approx(2 / 7)
    assert symbols["bullet_line_fraction"] == pytest.approx(3 / 4)  # the blank line is not a line
    assert symbols["ellipsis_line_fraction"] == pytest.approx(2 / 4)
    assert symbols["alpha_word_fraction"] == pytest.approx(6 / 7)  # "1990" has no letter

    repeated = heuristics("buy now\nbuy now\nbuy now\ncheap pills here")
    assert repeated["duplicate_line_fraction"] == pytest.approx(2 / 4)
    assert repeated["duplicate_line_char_fraction"] == pytest.approx(14 / 37)
    # of 32 word characters: "buy now" 3 x 6, "buy now buy" 2 x 9, "buy now buy now" 2 x 12
    assert repeated["top_2gram_char_fraction"] == pytest.approx(18 / 32)
    assert repeated["top_3gram_char_fraction"] == pytest.approx(18 / 32)
    assert repeated["top_4gram_char_fraction"] == pytest.approx(24 / 32)

    assert heuristics("") == {name: 0 for name in COLUMNS}


def test_heuristics_of_a_batch_equal_those_of_each_document(corpus):
    texts = [*corpus[0][:3], "a b", "a b", "", "x y x y", *corpus[1][::50]]
    batch = heuristic_columns(pa.array(texts))
    assert list(batch) == list(COLUMNS)
    for row, text in enumerate(texts):  # n-grams and duplicate lines never span two documents
        assert {name: column[row].as_py() for name, column in batch.items()} == heuristics(text)


def test_gopher_defaults_keep_wikitext_and_drop_boilerplate(corpus):
    active = [rule for rule in rules(FilterConfig()) if rule.column in COLUMNS]

    def kept(texts):
        return (first_failed_rule(pa.table(heuristic_columns(pa.array(texts))), active) < 0).mean()

    good, navigation, repeated = corpus[0], corpus[1][100:200], corpus[1][200:]
    assert kept(good) >= 0.9 and kept(navigation) <= 0.35 and kept(repeated) == 0
    # 35 of 40 lines repeat: the repetition rule alone drops every one of them
    assert min(heuristic_columns(pa.array(repeated))["duplicate_line_fraction"].to_pylist()) > 0.3


def test_filter_counts_each_drop_under_the_first_failing_rule():
    table = pa.table(
        {
            "language": ["en", "de", "de", "en", "en"],
            "word_count": [100, 10, 100, 10, 100],
            "quality_score": [0.9, 0.9, 0.1, 0.9, None],
        }
    )
    config = FilterConfig(min_quality_score=0.5)
    active = [rule for rule in rules(config) if rule.column in table.column_names]
    assert [rule.name for rule in active] == [
        "languages",
        "min_word_count",
        "max_word_count",
        "min_quality_score",
    ]
    # row 1 fails language and word count: counted under languages; a null fails its rule
    assert first_failed_rule(table, active).tolist() == [-1, 0, 0, 1, 3]


@pytest.fixture(scope="module")
def scored(corpus, trained, pool, tmp_path_factory) -> tuple[str, str]:
    """A document set of good and junk documents in 3 files, and run_quality's output of it."""
    root = tmp_path_factory.mktemp("scored")
    good, junk = corpus[0][:120], corpus[1][::5]  # 20 junk documents of each kind
    texts = [text for pair in itertools.zip_longest(good, junk) for text in pair if text]
    source = write_texts(root / "docs", texts, 3, "test")
    output = str(root / "scored")
    run_quality(source, output, QualityConfig(model_path=trained[1]), pool)
    return source, output


def test_run_quality_adds_attributes_and_drops_nothing(corpus, scored):
    report = StageReport.read(scored[1])
    assert report.documents_in == report.documents_out == 180 and report.dropped == {}
    table = pq.read_table(sorted(Path(scored[1]).glob("part-*.parquet")))
    extra = ["language", "language_score", *COLUMNS, "quality_score"]
    assert table.column_names == ["id", "text", "source", *extra]
    good = set(corpus[0])
    rows = table.to_pylist()
    right = [(row["quality_score"] >= 0.5) == (row["text"] in good) for row in rows]
    assert sum(right) / len(rows) >= 0.95


def test_run_filter_drop_counts_add_up(corpus, scored, pool, tmp_path):
    config = FilterConfig(min_quality_score=0.5)
    report = run_filter(scored[1], str(tmp_path / "kept"), config, pool)
    assert sum(report.dropped.values()) == report.documents_in - report.documents_out
    assert report.documents_in == 180 and report.documents_out >= 100
    assert set(report.dropped) <= {rule.name for rule in rules(config)}
    assert "min_quality_score" in report.dropped  # shuffled words pass Gopher, not the model
    kept = pq.read_table(sorted((tmp_path / "kept").glob("part-*.parquet")))
    junk_kept = set(kept.column("text").to_pylist()) - set(corpus[0])
    assert junk_kept <= set(corpus[1][:100]) and len(junk_kept) <= 5  # a few shuffled ones
    for reason, ids in report.dropped_sample.items():
        assert 0 < len(ids) <= min(20, report.dropped[reason])
    assert StageReport.read(str(tmp_path / "kept")) == report


def test_outputs_are_byte_identical_for_one_and_two_workers(trained, scored, pool, tmp_path):
    config = QualityConfig(model_path=trained[1])
    run_filter(scored[1], str(tmp_path / "kept2"), FilterConfig(), pool)
    with LocalBackend(workers=1) as single:
        run_quality(scored[0], str(tmp_path / "scored1"), config, RunOptions(backend=single))
        kept = str(tmp_path / "kept1")
        run_filter(str(tmp_path / "scored1"), kept, FilterConfig(), RunOptions(backend=single))
    pairs = [(tmp_path / "scored1", Path(scored[1])), (tmp_path / "kept1", tmp_path / "kept2")]
    for one, two in pairs:
        names = sorted(path.name for path in one.iterdir())
        assert names == sorted(path.name for path in two.iterdir()) and "stage.json" in names
        for name in names:
            assert (one / name).read_bytes() == (two / name).read_bytes(), name


def test_filter_needs_the_attribute_columns(scored, tmp_path):
    with pytest.raises(UsageError, match=r"no column 'language'.*run_quality.*languages=None"):
        run_filter(scored[0], str(tmp_path / "out"))
    config = replace(FilterConfig(), languages=None, min_word_count=None, max_word_count=None)
    with pytest.raises(UsageError, match="no column 'mean_word_length'"):
        run_filter(scored[0], str(tmp_path / "out"), config)
