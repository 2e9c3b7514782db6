"""Benchmark suite: django-dbqueue against its peers. Run ``bench/run``."""
