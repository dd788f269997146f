"""Experiment definitions shipped with keel: each module is an experiment file (a STEPS list).

`keel quickstart` runs quickstart.py; `keel run path/to/file.py` runs any experiment file.
"""
