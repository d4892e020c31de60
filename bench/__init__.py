"""The maintained benchmarks (bench/README.md), each a script; a package so that tests import them (`bench.*`)."""
