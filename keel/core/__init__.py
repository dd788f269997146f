"""Layer 0: canonical hashing, config loading and overrides, fsspec paths, atomic commit, errors,
logging. Everything else in keel builds on these; they import nothing from keel above them."""
