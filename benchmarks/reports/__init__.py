"""Turning the benchmarks' results into the committed Markdown, JSON and PNG: ``reports/X.py``
renders what ``suites/X.py`` (or, for the codec breakdown, ``harness/analysis.py``) measures."""
