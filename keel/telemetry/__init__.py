"""Layer 1: the telemetry store (namespaced tables in indexed Parquet segments, queried with
DuckDB). Built by the telemetry issue.
"""
