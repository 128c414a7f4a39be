"""Benchmarks run from the CLI (`tandem bench serve`)."""
