"""keel: an open platform for training language models, end to end, from one laptop to a cluster.

The package is layered (see docs/architecture.md); each layer imports only from its own layer or a
lower one, which import-linter checks in the test suite.
"""


def __getattr__(name: str) -> str:
    """`keel.__version__`, read from the installed package's metadata when first asked:
    importing importlib.metadata costs ~40 ms, which every keel process (each command, each flow
    worker) would otherwise pay at `import keel`."""
    if name != "__version__":
        raise AttributeError(f"module 'keel' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("keel")
    except PackageNotFoundError:  # running from a source tree that was never installed
        found = "0.0.0+unknown"
    globals()["__version__"] = found
    return found
