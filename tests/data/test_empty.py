"""A stage that keeps no document hands the next stage an empty set, not an error."""

from keel.data.dedup import run_exact_dedup
from keel.data.documents import document_id
from keel.data.fuzzy import run_fuzzy_dedup
from keel.data.quality import run_quality
from keel.flow import LocalBackend, RunOptions, from_items


def test_stages_pass_an_empty_document_set_along(tmp_path):
    rows = [{"id": document_id("some text"), "text": "some text", "source": "test"}]
    with LocalBackend(workers=2) as pool:
        options = RunOptions(backend=pool)
        from_items(rows).filter(lambda row: False).write_parquet(tmp_path / "none", backend=pool)
        previous = str(tmp_path / "none")
        for name, run in (
            ("exact", run_exact_dedup),
            ("fuzzy", run_fuzzy_dedup),
            ("quality", run_quality),
        ):
            report = run(previous, str(tmp_path / name), options=options)
            assert (report.documents_in, report.documents_out, report.dropped.get("x", 0)) == (
                0,
                0,
                0,
            )
            assert (tmp_path / name / "stage.json").exists()
            previous = str(tmp_path / name)
