"""Layer 2: DataKit, raw documents -> deduplicated, decontaminated training tokens, on keel/flow.

See docs/data.md. documents.py holds the document-set format every stage reads and writes.
"""
