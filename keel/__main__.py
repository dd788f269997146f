"""`python -m keel` is the `keel` command."""

from keel.cli.main import main

main()
