"""Tiny random checkpoints in the official on-disk layout, for tests and smoke runs (they produce noise)."""
