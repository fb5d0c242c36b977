"""Examples of training through embcache: a DLRM on a synthetic Criteo-like data set.

Run from the repository root: ``python -m examples.dlrm --help``.
"""
