"""Benchmarks and the load generator: they drive the engine or a running deployment and
report what users feel. Not tests: they print tables and JSON and compare against a baseline
measured in the same run."""
