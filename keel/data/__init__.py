"""Layer 2: DataKit, raw documents -> deduplicated, decontaminated training tokens, on keel/flow.

See docs/data.md. registry.py names the stages (the package's public face), stage.py says what a
stage is, runner.py runs one or a fused chain of them, and documents.py holds the document-set
format every stage reads and writes.
"""
