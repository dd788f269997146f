"""The `keel` command line (typer + rich). Commands live in one module per area; main.py wires
them.
"""
