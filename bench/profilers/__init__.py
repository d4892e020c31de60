"""Profilers: where the time of one part goes (bench/README.md); a package so that tests import them."""
