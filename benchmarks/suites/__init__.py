"""One module per measurement (a package where it has several parts): each runs as
``python -m benchmarks.suites.<name>``; ``python -m benchmarks`` runs ``side_by_side``."""
