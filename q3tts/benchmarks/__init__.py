"""Benchmarks (GPU): `q3tts bench decode` and `q3tts bench streaming`; results in shared/bench/RESULTS.md format."""
