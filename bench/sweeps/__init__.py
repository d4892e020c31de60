"""Tuning sweeps: the measured tables in q3tts come from these (bench/README.md)."""
