"""Benchmarks of embcache against the in-memory ceiling and its peers; `python -m bench` runs the suite."""
