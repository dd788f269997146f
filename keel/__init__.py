"""keel: an open platform for training language models, end to end, from one laptop to a cluster.

The package is layered (see docs/architecture.md); each layer imports only from its own layer or a
lower one, which import-linter checks in the test suite.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("keel")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
