"""Layer 2: DataKit stages (ingest, extract, quality, dedup, decontamination, mixing,
tokenization). Built by the DataKit issue.
"""
