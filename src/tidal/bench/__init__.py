"""Benchmarks run by ``tidal bench``: side by side with the usual alternatives, in one process, ``--json``."""
