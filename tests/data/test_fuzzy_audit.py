"""Audited fuzzy dedup and exact dedup by text: no transitive chains, evidence that recomputes,
the per-source guard, and repeated texts found under the input's own ids."""

import json
import random
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from keel.data import fuzzy_verify
from keel.data.dedup import run_exact_dedup
from keel.data.documents import document_id
from keel.data.fuzzy import FuzzyDedupConfig, find_buckets, run_fuzzy_dedup
from keel.data.fuzzy_clusters import SourceGuardError
from keel.data.fuzzy_verify import candidate_groups, components
from keel.flow import LocalBackend, RunOptions

VOCABULARY = [f"w{n}" for n in range(5000)]


@pytest.fixture(scope="module")
def pool():
    with LocalBackend(workers=2) as backend:
        yield RunOptions(backend=backend)


def _shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    """Word 5-grams after lowercasing and splitting on non-word runs: computed here, not by keel."""
    words = re.sub(r"[^\w\s]+", " ", text.lower()).split()
    if 0 < len(words) < n:
        return {tuple(words)}
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def _jaccard(left: str, right: str) -> float:
    a, b = _shingles(left), _shingles(right)
    return len(a & b) / len(a | b)


def _write(rows: list[dict], directory: Path) -> str:
    directory.mkdir(parents=True)
    half = len(rows) // 2
    for part, chunk in enumerate((rows[:half], rows[half:])):
        table = pa.Table.from_pylist(chunk)
        pq.write_table(table, directory / f"part-{part:05d}-of-00002.parquet")
    return str(directory)


def _doc(text: str, source: str) -> dict:
    return {"id": document_id(text), "text": text, "source": source}


def _removed(directory: Path) -> list[dict]:
    return pq.read_table(directory / "removed.parquet").to_pylist()


def test_a_chain_a_b_c_keeps_a_and_c_and_evidence_recomputes(tmp_path, pool):
    words = random.Random(0).sample(VOCABULARY, 240)
    a, b, c = (" ".join(words[shift : shift + 200]) for shift in (0, 12, 24))
    assert _jaccard(a, b) >= 0.8 and _jaccard(b, c) >= 0.8 and _jaccard(a, c) < 0.8
    other = " ".join(random.Random(1).sample(VOCABULARY, 200))
    rows = [_doc(a, "a"), _doc(other, "o"), _doc(b, "b"), _doc(c, "c")]
    report = run_fuzzy_dedup(_write(rows, tmp_path / "in"), str(tmp_path / "out"), options=pool)

    removed = _removed(tmp_path / "out")
    assert [(row["source"], row["duplicate_of"]) for row in removed] == [("b", document_id(a))]
    kept = pq.read_table(sorted((tmp_path / "out").glob("part-*.parquet"))).to_pylist()
    assert sorted(row["source"] for row in kept) == ["a", "c", "o"]
    evidence = pq.read_table(tmp_path / "out" / "evidence.parquet").to_pylist()
    assert len(evidence) == 1 and evidence[0]["removed_id"] == document_id(b)
    assert evidence[0]["jaccard"] == pytest.approx(_jaccard(a, b))
    assert evidence[0]["shared_shingles"] == len(_shingles(a) & _shingles(b))
    assert report.details["pairs_rejected"] >= 1  # C ~ A proposed by LSH, turned down


def test_every_removal_has_evidence_with_its_true_jaccard(tmp_path, pool):
    rng = random.Random(2)
    rows = []
    for _ in range(30):
        words = rng.sample(VOCABULARY, 150)
        original = " ".join(words)
        rows.append(_doc(original, "web"))
        for _ in range(rng.randint(0, 3)):  # a few edited copies, some near the threshold
            edited = list(words)
            for position in rng.sample(range(150), rng.randint(1, 6)):
                edited[position] = rng.choice(VOCABULARY)
            rows.append(_doc(" ".join(edited), "web"))
    rng.shuffle(rows)
    texts = {row["id"]: row["text"] for row in rows}
    config = FuzzyDedupConfig(max_source_drop=1.0)
    run_fuzzy_dedup(_write(rows, tmp_path / "in"), str(tmp_path / "out"), config, options=pool)

    removed = _removed(tmp_path / "out")
    evidence = pq.read_table(tmp_path / "out" / "evidence.parquet").to_pylist()
    assert len(removed) > 10
    assert [(e["removed_id"], e["kept_id"]) for e in evidence] == [
        (row["id"], row["duplicate_of"]) for row in removed
    ]
    kept_ids = {row["id"] for row in rows} - {row["id"] for row in removed}
    for row in evidence:
        true = _jaccard(texts[row["removed_id"]], texts[row["kept_id"]])
        assert row["jaccard"] == pytest.approx(true) and true >= 0.8
        assert row["kept_id"] in kept_ids  # linked to a kept document, never to a removed one
        union = row["removed_shingles"] + row["kept_shingles"] - row["shared_shingles"]
        assert row["shared_shingles"] / union == pytest.approx(true)


def test_the_source_guard_stops_a_run_that_would_drop_90_percent_of_a_source(tmp_path, pool):
    rng = random.Random(3)
    rows = []
    for _ in range(20):  # 20 texts, each with 9 near copies: 180 of the 200 "web" documents
        words = rng.sample(VOCABULARY, 120)
        rows.append(_doc(" ".join(words), "web"))
        for _ in range(9):
            edited = list(words)
            edited[rng.randrange(120)] = rng.choice(VOCABULARY)
            rows.append(_doc(" ".join(edited), "web"))
    rows += [_doc(" ".join(rng.sample(VOCABULARY, 120)), "books") for _ in range(100)]
    source = _write(rows, tmp_path / "in")
    with pytest.raises(SourceGuardError, match=r"would drop 90\.0% of source 'web' \(180 of 200"):
        run_fuzzy_dedup(source, str(tmp_path / "out"), options=pool)
    assert not (tmp_path / "out").exists()  # nothing written

    config = FuzzyDedupConfig(max_source_drop=1.0)
    report = run_fuzzy_dedup(source, str(tmp_path / "out"), config, options=pool)
    assert report.details["sources"]["web"] == {"documents": 200, "removed": 180, "fraction": 0.9}
    assert report.details["sources"]["books"]["removed"] == 0


def test_exact_dedup_finds_copies_under_the_inputs_own_ids(tmp_path, pool):
    rng = random.Random(4)
    texts = [f"document {n}: " + " ".join(rng.sample(VOCABULARY, 20)) for n in range(1000)]
    rows = [{"id": f"b{n + 1}", "text": text, "source": "s"} for n, text in enumerate(texts)]
    copies = [
        {"id": f"copy{n}", "text": texts[index], "source": "s"}
        for n, index in enumerate(rng.sample(range(1000), 200))
    ]
    source = _write(rows + copies, tmp_path / "in")
    report = run_exact_dedup(source, str(tmp_path / "out"), options=pool)
    assert (report.documents_in, report.documents_out) == (1200, 1000)
    kept = pq.read_table(sorted((tmp_path / "out").glob("part-*.parquet"))).column("id")
    assert sorted(kept.to_pylist()) == sorted(row["id"] for row in rows)
    removed = _removed(tmp_path / "out")
    assert sorted(row["id"] for row in removed) == sorted(row["id"] for row in copies)
    by_id = {row["id"]: row["text"] for row in rows + copies}
    assert all(by_id[row["duplicate_of"]] == by_id[row["id"]] for row in removed)
    stage = json.loads((tmp_path / "out" / "stage.json").read_text())
    assert stage["dropped"] == {"exact_duplicate": 200}


@pytest.mark.parametrize("nodes, edges", [(1, 0), (50, 10), (5_000, 4_000), (20_000, 30_000)])
def test_bucket_components_are_the_graphs_connected_components(nodes, edges):
    """Pass 2 sends each component of the buckets to one reducer: a component split in two
    would compare a candidate with too few representatives."""
    rng = np.random.default_rng(nodes)
    left, right = rng.integers(0, nodes, edges), rng.integers(0, nodes, edges)
    labels = components(nodes, left, right)
    graph = coo_matrix((np.ones(edges), (left, right)), shape=(nodes, nodes))
    count, expected = connected_components(graph, directed=False)
    assert len(set(zip(labels.tolist(), expected.tolist(), strict=True))) == count
    assert len(np.unique(labels)) == count
    assert (labels[left] == labels[right]).all()


def _groups_by_python(buckets: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """The candidates (sorted places) and the distinct buckets in order of first appearance, as
    candidate numbers: computed here with sets, dicts and tuples, not by keel."""
    places = sorted({place for bucket in buckets for place in bucket})
    number = {place: index for index, place in enumerate(places)}
    distinct = dict.fromkeys(tuple(bucket) for bucket in buckets)
    return places, [[number[place] for place in bucket] for bucket in distinct]


@pytest.mark.parametrize("collide", [False, True])
def test_candidate_groups_number_candidates_and_drop_repeated_buckets(monkeypatch, collide):
    """A bucket found in several bands is verified once. With every bucket hashed alike, the
    member-by-member check still tells different buckets apart."""
    if collide:
        monkeypatch.setattr(
            fuzzy_verify,
            "bucket_fingerprints",
            lambda members, sizes: np.zeros(len(sizes), np.uint64),
        )
    rng = random.Random(7)
    made = [sorted(rng.sample(range(300), rng.randint(2, 5))) for _ in range(400)]
    buckets = [[(n << 40) | n * 7 for n in made[rng.randrange(len(made))]] for _ in range(1500)]
    buckets += [[1, 2], [2, 1], [1, 2, 2]]  # order and repeats matter
    lists = pa.chunked_array(
        [
            pa.array(buckets[:700], pa.list_(pa.uint64())),
            pa.array(buckets[700:], pa.list_(pa.uint64())),
        ]
    )
    groups = candidate_groups(lists)
    places, distinct = _groups_by_python(buckets)
    assert groups.positions.tolist() == places
    starts = groups.bucket_starts
    found = [groups.members[starts[b] : starts[b + 1]].tolist() for b in range(len(starts) - 1)]
    assert found == distinct
    for bucket in found:  # a bucket's members are one component
        assert len(set(groups.components[bucket].tolist())) == 1


def test_candidate_groups_of_no_buckets():
    groups = candidate_groups(pa.array([], pa.list_(pa.uint64())))
    assert len(groups.positions) == 0 and groups.bucket_starts.tolist() == [0]


def test_a_bucket_found_in_every_band_comes_back_once(tmp_path, pool):
    """Ten copies of one text share all 14 bands: the workers send their bucket once, with the
    places of all ten in input order; texts of their own share no bucket."""
    rng = random.Random(5)
    copied = " ".join(rng.sample(VOCABULARY, 80))
    rows = [_doc(" ".join(rng.sample(VOCABULARY, 80)), "web") for _ in range(40)]
    at = sorted(rng.sample(range(50), 10))
    for index in at:
        rows.insert(index, {"id": f"copy-{index}", "text": copied, "source": "web"})
    source = _write(rows, tmp_path / "in")
    buckets = find_buckets(source, None, FuzzyDedupConfig(), pool).to_pylist()
    half = len(rows) // 2  # _write's two files: a place is (file << 40) | row in the file
    places = [index if index < half else (1 << 40) | (index - half) for index in at]
    assert buckets == [places]
